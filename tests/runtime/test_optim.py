"""The user's optimizer over autoshard's CPU parameters takes the foreach path, bit for bit
equal to the per-parameter loop, and leaves its param groups as the user set them; the step's
pointwise foreach ops run on the local tensors, bit for bit equal to DTensor's dispatch."""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autoshard import AutoshardError, autoshard
from autoshard.core.models import GPT, gpt_loss
from autoshard.runtime import foreach, optim


def _train(make_opt, steps=4):
    torch.manual_seed(0)
    sharded = autoshard(GPT())
    opt = make_opt(sharded.parameters())
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 96, (2, 16), generator=g)
        gpt_loss(sharded(x), torch.roll(x, -1, 1)).backward()
        opt.step()
        opt.zero_grad()
    return sharded, opt


OPTIMIZERS = {
    "adamw": lambda ps, **k: torch.optim.AdamW(ps, lr=1e-2, **k),
    "adam_l2": lambda ps, **k: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, **k),
    "sgd_nesterov": lambda ps, **k: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                   weight_decay=0.01, **k),
    "rmsprop": lambda ps, **k: torch.optim.RMSprop(ps, lr=1e-3, centered=True, momentum=0.5,
                                                  **k),
}


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_default_flags_equal_the_per_parameter_loop_bit_for_bit(name, monkeypatch):
    make = OPTIMIZERS[name]
    calls = []
    real = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    fast, opt = _train(make)
    assert calls, "the default-flag optimizer did not take the foreach path"
    assert all(g["foreach"] is None for g in opt.param_groups)  # restored after each step
    calls.clear()
    loop, _ = _train(lambda ps: make(ps, foreach=False))
    assert not calls
    for (n, a), b in zip(fast.named_parameters(), loop.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), n


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
def test_groups_the_user_configured_and_other_tensors_are_left_alone():
    torch.manual_seed(0)
    sharded = autoshard(GPT())
    plain = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([{"params": list(sharded.parameters()), "foreach": False},
                             {"params": [plain]}])
    assert not optim._eligible(opt.param_groups[0])  # the user chose the loop
    assert not optim._eligible(opt.param_groups[1])  # not autoshard's parameters
    nadam = torch.optim.NAdam(copy.copy(list(sharded.parameters())))
    assert optim._eligible(nadam.param_groups[0])
    optim._pre(nadam, (), {})  # NAdam's foreach arithmetic differs: it keeps the loop
    assert nadam.param_groups[0]["foreach"] is None


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
def test_an_optimizer_built_before_autoshard_is_refused_at_its_first_step():
    """autoshard() replaces every parameter; an optimizer over the old ones would train
    nothing, silently. Its first step raises naming a parameter, before changing anything;
    an optimizer over the new parameters, or over unrelated tensors, steps as usual."""
    torch.manual_seed(0)
    model = GPT()
    old = list(model.parameters())
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    unrelated = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    sharded = autoshard(model)
    both = torch.optim.SGD([{"params": list(sharded.parameters())}, {"params": old[1:2]}],
                           lr=0.1)
    x = torch.randint(0, 96, (2, 16))
    gpt_loss(sharded(x), torch.roll(x, -1, 1)).backward()
    for p in old:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in old]
    for opt, fqn in ((early, "wte.weight"), (both, "wpe.weight")):
        with pytest.raises((AutoshardError, ValueError)) as e:
            opt.step()
        msg = str(e.value)
        assert f"'{fqn}'" in msg and "after autoshard" in msg, msg
    assert all(torch.equal(a, b) for a, b in zip(old, before))  # nothing stepped
    unrelated.param_groups[0]["params"][0].grad = torch.ones(3)
    unrelated.step()
    assert torch.equal(unrelated.param_groups[0]["params"][0].detach(), torch.full((3,), 0.9))
    good = torch.optim.SGD(sharded.parameters(), lr=0.1)
    good.step()


# --- the foreach ops of a step, on the local tensors (runtime/foreach.py) --------------------

def _spy_local(monkeypatch):
    """Counts of the handler's calls that ran on the local tensors and that went to DTensor's
    own dispatch."""
    seen = {"local": 0, "dtensor": 0}
    unwrap, dispatch = foreach._unwrap, foreach._dtensor_dispatch

    def counted_unwrap(args, kwargs):
        out = unwrap(args, kwargs)
        seen["local"] += out is not None
        return out

    def counted_dispatch(op, args, kwargs):
        seen["dtensor"] += 1
        return dispatch(op, args, kwargs)

    monkeypatch.setattr(foreach, "_unwrap", counted_unwrap)
    monkeypatch.setattr(foreach, "_dtensor_dispatch", counted_dispatch)
    return seen


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov", "rmsprop"])
def test_foreach_steps_on_local_tensors_equal_dtensors_dispatch_bit_for_bit(name, monkeypatch):
    """``foreach=True`` (the default on a GPU): every pointwise foreach op of the step runs
    on the local tensors, and parameters and optimizer state equal DTensor's own dispatch
    bit for bit; the handler is in DTensor's table only during the step."""
    make = OPTIMIZERS[name]
    seen = _spy_local(monkeypatch)
    fast, opt = _train(lambda ps: make(ps, foreach=True))
    assert seen["local"] > 0 and seen["dtensor"] == 0, seen
    assert not foreach.installed()
    monkeypatch.setattr(foreach, "install", lambda: False)  # DTensor's dispatch throughout
    slow, slow_opt = _train(lambda ps: make(ps, foreach=True))
    for (n, a), b in zip(fast.named_parameters(), slow.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), n
    for a, b in zip(opt.state.values(), slow_opt.state.values()):
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, DTensor):
                assert isinstance(y, DTensor) and x.placements == y.placements, k
                x, y = x.to_local(), y.to_local()
            assert torch.equal(x, y), k


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
def test_foreach_ops_it_cannot_prove_local_take_dtensors_dispatch():
    """A Partial placement, layouts that differ at a position, a plain tensor beside
    DTensors or a tensor scalar: DTensor's own dispatch, with its own result."""
    torch.manual_seed(0)
    sharded = autoshard(GPT())
    mesh = next(sharded.parameters()).device_mesh
    t = [torch.randn(4, 3), torch.randn(5)]
    shard = [DTensor.from_local(x, mesh, [Shard(0)]) for x in t]
    partial = [DTensor.from_local(x, mesh, [Partial()]) for x in t]
    repl = [DTensor.from_local(x, mesh, [Replicate()]) for x in t]
    cases = [lambda: torch._foreach_add(partial, partial),
             lambda: torch._foreach_mul(shard, repl),
             lambda: torch._foreach_add(shard, shard),
             lambda: torch._foreach_mul(shard, torch.tensor(2.0)),
             lambda: torch._foreach_add(shard, 1.5)]
    want = [c() for c in cases]
    calls = []
    dispatch = foreach._dtensor_dispatch
    foreach._dtensor_dispatch = lambda op, a, k: (calls.append(op), dispatch(op, a, k))[1]
    assert foreach.install()
    try:
        got = [c() for c in cases]
    finally:
        foreach.remove()
        foreach._dtensor_dispatch = dispatch
    assert len(calls) == 2, calls  # the Partial lists and the Shard(0) beside Replicate
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert a.placements == b.placements and torch.equal(a.to_local(), b.to_local())


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
def test_the_handler_is_out_for_other_optimizers_also_after_a_step_that_raised():
    torch.manual_seed(0)
    sharded = autoshard(GPT())
    mesh = next(sharded.parameters()).device_mesh
    ours = torch.optim.AdamW(sharded.parameters(), foreach=True)
    theirs = torch.optim.AdamW(
        [torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Shard(0)]))])
    seen = []
    spy = register_optimizer_step_pre_hook(
        lambda o, a, k: seen.append((o is ours, foreach.installed())))
    try:
        for p in sharded.parameters():
            p.grad = torch.ones_like(p)
        ours.step()
        assert not foreach.installed()
        broken = torch.optim.AdamW(sharded.parameters(), foreach=True)
        broken.param_groups[0]["betas"] = None  # raises inside the step
        with pytest.raises(TypeError):
            broken.step()
        assert foreach.installed()  # no post-hook after a step that raised
        theirs.param_groups[0]["params"][0].grad = torch.ones_like(
            theirs.param_groups[0]["params"][0])
        theirs.step()
    finally:
        spy.remove()
    assert seen == [(True, True), (False, True), (False, False)], seen
