"""The user's optimizer over autoshard's CPU parameters takes the foreach path, bit for bit
equal to the per-parameter loop, and leaves its param groups as the user set them."""

import copy

import pytest
import torch

from autoshard import AutoshardError, autoshard
from autoshard.models import GPT, gpt_loss
from autoshard.runtime import optim


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
