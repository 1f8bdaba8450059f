"""What users' training loops do that the fuzzer and client trials found breaking: each
trains as eager does, at world sizes 1 and 2, or is refused naming the cause and the fix.

- a parameter that never gets a gradient (unused in the loss) has no optimizer state, and a
  checkpoint of it saves and loads as eager ``torch.optim`` state dicts do;
- ``clip_grad_norm_(..., norm_type=inf)`` where a rank's shard is empty (fewer rows than
  ranks) is the maximum over the other shards (torch raises for an empty tensor);
- explicit ``Config.units`` and a submodule called directly (an entry of its own);
- a backward that recomputes reads the step's outputs without their graph: no gradient
  keeps one;
- a forward returning a plain dataclass of tensors;
- a parameter read outside forward belongs in a registered method (docs/api.md);
- ``torch.save(sharded.state_dict())`` holds this rank's rows; ``full_state_dict()`` the whole;
- buffers each rank updates from its own batch resume as each rank's own at the same world
  size, and as rank 0's, with a warning, at another.
"""

import dataclasses

import pytest
import torch
import torch.nn as nn

from autoshard import autoshard
from harness import Recipe, outcome, reference, run_ranks, train_sharded

TOL = 1e-5


def _batch(step, rank, rows=4, width=8):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, width, generator=g)


def _steps(model, opt, first, last, rank, world) -> list:
    """Steps ``first``..``last - 1`` on this rank's batch: each step's loss of this rank."""
    losses = []
    for step in range(first, last):
        loss = model(_batch(step, rank)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _state(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


# --- G: a parameter that never got a gradient ------------------------------------------------

class Unused(nn.Module):
    """A Linear the loss reads and one it never reads (no gradient, no optimizer state)."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def _unused_resume(rank, world, root):
    import autoshard as api

    def build():
        torch.manual_seed(0)
        model = autoshard(Unused())
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    model, opt = build()
    _steps(model, opt, 0, 2, rank, world)
    api.save(f"{root}/unused", model, opt)
    straight = _steps(model, opt, 2, 4, rank, world)
    out = {"straight": straight, "straight_state": _state(model)}
    out["same"] = outcome(lambda: api.load_checkpoint(f"{root}/unused", model, opt))
    fresh, fresh_opt = build()
    out["fresh"] = outcome(lambda: api.load_checkpoint(f"{root}/unused", fresh, fresh_opt))
    if out["fresh"] == "ok":
        out["resumed"] = _steps(fresh, fresh_opt, 2, 4, rank, world)
        out["resumed_state"] = _state(fresh)
        out["opt_keys"] = sorted(fresh_opt.state_dict()["state"])
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_an_unused_parameter_saves_and_resumes(tmp_path, world):
    eager = Unused()
    torch.manual_seed(0)
    eager = Unused()
    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-2)
    eager(torch.randn(2, 8)).sum().backward()
    eager_opt.step()
    for out in run_ranks(world, _unused_resume, str(tmp_path)):
        assert out["same"] == "ok", out["same"]
        assert out["fresh"] == "ok", out["fresh"]
        assert out["resumed"] == out["straight"]
        for k, v in out["straight_state"].items():
            torch.testing.assert_close(out["resumed_state"][k], v, rtol=0, atol=0, msg=k)
        # as eager: the unused parameters (indices 2, 3) hold no state
        assert out["opt_keys"] == sorted(eager_opt.state_dict()["state"]) == [0, 1]


# --- C: an infinity-norm clip where a rank's shard is empty ----------------------------------

class Tiny(nn.Module):
    """A Linear and a one-row parameter: at world size 2 rank 1's shard of it is empty."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.row = nn.Parameter(torch.randn(1, 8))

    def forward(self, x):
        return self.lin(x) * self.row


def _data(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, 8, generator=g),)


def _square(model, x):
    return model(x).square().mean()


def _built(cls):
    torch.manual_seed(0)
    return cls()


def _tiny():
    return _built(Tiny)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


TINY = Recipe(build=_tiny, data=_data, loss=_square, steps=3, optimizer=_sgd)


def _clipper(last: int, foreach, norms: list):
    def clip(step, i, model):
        if i == last:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05,
                                                  norm_type=float("inf"), foreach=foreach)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    return clip


def _clipped(rank, world, foreach):
    norms = []
    model, losses = train_sharded(TINY, autoshard, rank, world,
                                  after_backward=_clipper(0, foreach, norms))
    return {"losses": losses, "norms": norms, "state": _state(model)}


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("world", [1, 2])
def test_an_inf_norm_clip_skips_an_empty_shard(world, foreach):
    norms = []
    ref_losses, ref_state = reference(TINY, world,
                                      after_backward=_clipper(world - 1, foreach, norms))
    for out in run_ranks(world, _clipped, foreach):
        assert out["losses"] == pytest.approx(ref_losses, abs=TOL)
        assert out["norms"] == pytest.approx(norms, abs=TOL)
        assert max(norms) > 0.05  # the clip scaled the gradients
        for k, v in ref_state.items():
            torch.testing.assert_close(out["state"][k], v, rtol=0, atol=TOL, msg=k)


# --- B: explicit units and a submodule called directly --------------------------------------

class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _blocks():
    return _built(Blocks)


def _through_a_block(model, x):
    """The whole model and one block called directly (an entry of its own)."""
    return model(x).square().mean() + model.blocks[0](x).square().mean()


BLOCKS = Recipe(build=_blocks, data=_data, loss=_through_a_block, steps=3, optimizer=_sgd)
UNITS = [["blocks.0.weight", "blocks.0.bias"], ["blocks.1.weight", "blocks.1.bias"]]


def _with_units(rank, world, _):
    from autoshard import Config

    model, losses = train_sharded(BLOCKS, lambda m: autoshard(m, config=Config(units=UNITS)),
                                  rank, world)
    return {"losses": losses, "state": _state(model)}


@pytest.mark.parametrize("world", [1, 2])
def test_explicit_units_and_a_submodule_entry(world):
    ref_losses, ref_state = reference(BLOCKS, world)
    for out in run_ranks(world, _with_units, None):
        assert out["losses"] == pytest.approx(ref_losses, abs=TOL)
        for k, v in ref_state.items():
            torch.testing.assert_close(out["state"][k], v, rtol=0, atol=TOL, msg=k)


# --- (d): gradients never carry an autograd graph --------------------------------------------

class Pair(nn.Module):
    """Blocks whose hidden states are returned beside the output (in a dict or a tuple), so
    that a tensor the backward reads is also an output of the step."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        hs = []
        for b in self.blocks:
            x = torch.tanh(b(x))
            hs.append(x)
        out = self.head(x)
        return {"out": out, "aux": hs[0]} if x.shape[0] > 2 else (out, hs[0], hs[1])


def _graphless(rank, world, _):
    from autoshard import Config

    out = []
    for recompute in (True, False):
        torch.manual_seed(0)
        model = autoshard(Pair(), config=Config(recompute=recompute))
        for rows in (4, 2, 4):  # a dict, a tuple, a dict again (accumulated into .grad)
            got = model(_batch(0, rank, rows))
            outs = list(got.values()) if isinstance(got, dict) else list(got)
            sum(o.square().mean() for o in outs).backward()
            out.append({n: (p.grad.grad_fn is None, not p.grad.requires_grad,
                            p.grad.to_local().grad_fn is None,
                            not p.grad.to_local().requires_grad)
                        for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_tuple_and_dict_outputs_leave_gradients_without_a_graph(world):
    """A backward that recomputes forward ops runs in the forward's grad mode: a gradient
    computed from an output it saved must not keep that output's graph (and with it every
    activation) alive in ``.grad`` until ``zero_grad``."""
    for out in run_ranks(world, _graphless, None):
        for grads in out:
            for name, flags in grads.items():
                assert all(flags), (name, flags)


# --- (a): a forward returning a dataclass of tensors -----------------------------------------

@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "kept"


class Dataclassed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return Output(self.b(h), h)


def _dataclassed():
    return _built(Dataclassed)


def _both_fields(model, x):
    out = model(x)
    assert isinstance(out, Output) and out.note == "kept"
    return out.logits.square().mean() + out.hidden.mean()


DATACLASS = Recipe(build=_dataclassed, data=_data, loss=_both_fields, steps=3, optimizer=_sgd)


def _dataclass_outputs(rank, world, _):
    model, losses = train_sharded(DATACLASS, autoshard, rank, world)
    return {"losses": losses, "state": _state(model)}


@pytest.mark.parametrize("world", [1, 2])
def test_a_dataclass_output_trains_as_eager(world):
    ref_losses, ref_state = reference(DATACLASS, world)
    for out in run_ranks(world, _dataclass_outputs, None):
        assert out["losses"] == pytest.approx(ref_losses, abs=TOL)
        for k, v in ref_state.items():
            torch.testing.assert_close(out["state"][k], v, rtol=0, atol=TOL, msg=k)


# --- (b): a parameter read outside forward (CLIP's logit scale in the loss) ------------------

class Scaled(nn.Module):
    """CLIP's pattern: the loss multiplies the logits by ``logit_scale.exp()``."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.enc(x)

    def scaled_logits(self, x):
        return self(x) * self.logit_scale.exp()


def _scaled():
    return _built(Scaled)


def _scaled_loss(model, x):
    return model.scaled_logits(x).square().mean()


SCALED = Recipe(build=_scaled, data=_data, loss=_scaled_loss, steps=3, optimizer=_sgd)


def _registered(rank, world, _):
    def shard(model):
        model = autoshard(model)
        model.register_forward_method("scaled_logits")
        return model

    model, losses = train_sharded(SCALED, shard, rank, world)
    return {"losses": losses, "state": _state(model)}


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_read_outside_forward_trains_in_a_registered_method(world):
    """Read outside a captured step, the parameter is this rank's DTensor shard, whose
    gradient nothing would reduce over the ranks: the read belongs in forward or in a method
    registered with ``register_forward_method`` (docs/api.md), which trains as eager."""
    ref_losses, ref_state = reference(SCALED, world)
    for out in run_ranks(world, _registered, None):
        assert out["losses"] == pytest.approx(ref_losses, abs=TOL)
        for k, v in ref_state.items():
            torch.testing.assert_close(out["state"][k], v, rtol=0, atol=TOL, msg=k)


# --- (c): torch.save(sharded.state_dict()) holds this rank's rows ------------------------------

def _saved_on_rank_0(rank, world, root):
    from torch.distributed.tensor import DTensor

    model = autoshard(_blocks())
    path = f"{root}/rank{rank}.pt"
    torch.save(model.state_dict(), path)
    saved = torch.load(path, weights_only=False)
    full = model.full_state_dict()
    out = {"dtensors": all(isinstance(v, DTensor) for v in saved.values()),
           "rows": {k: v.to_local().shape[0] for k, v in saved.items()},
           "full": {k: v.clone() for k, v in full.items()}}
    unsharded = _blocks()
    out["into_unsharded"] = outcome(lambda: unsharded.load_state_dict(saved))
    torch.save(full, path)  # what to save for an unsharded copy
    unsharded.load_state_dict(torch.load(path))
    out["from_full"] = {k: v.clone() for k, v in unsharded.state_dict().items()}
    return out


def test_a_saved_state_dict_holds_this_ranks_rows_and_full_state_dict_the_whole(tmp_path):
    """``sharded.state_dict()`` holds DTensor shards (as FSDP2's): a ``torch.save`` of it on
    rank 0 keeps rank 0's rows, which an unsharded model refuses to load;
    ``full_state_dict()`` (or ``autoshard.save``) is how to save the whole (docs/api.md)."""
    eager = _blocks().state_dict()
    for rank, out in enumerate(run_ranks(2, _saved_on_rank_0, str(tmp_path))):
        assert out["dtensors"]
        assert out["rows"]["blocks.0.weight"] == 4  # 8 rows over 2 ranks
        assert out["into_unsharded"].startswith("escaped RuntimeError"), out["into_unsharded"]
        for k, v in eager.items():
            assert torch.equal(out["full"][k], v), k
            assert torch.equal(out["from_full"][k], v), k


# --- buffers each rank updates from its own batch, across a resume ---------------------------

class Normed(nn.Module):
    """BatchNorm without SyncBatchNorm: each rank's running statistics are its own."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.lin(x))


def _buffers(model) -> dict:
    return {k: v.clone() for k, v in model.named_buffers()}


def _bn_resume(rank, world, root):
    import autoshard as api

    def build():
        torch.manual_seed(0)
        model = autoshard(Normed())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    _steps(model, opt, 0, 2, rank, world)
    api.save(f"{root}/bn", model, opt)
    straight = _steps(model, opt, 2, 4, rank, world)
    out = {"straight": straight, "state": _state(model), "buffers": _buffers(model)}
    fresh, fresh_opt = build()
    api.load_checkpoint(f"{root}/bn", fresh, fresh_opt)
    out["resumed"] = _steps(fresh, fresh_opt, 2, 4, rank, world)
    out["resumed_state"], out["resumed_buffers"] = _state(fresh), _buffers(fresh)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_resume_restores_each_ranks_own_buffers(tmp_path, world):
    ranks = run_ranks(world, _bn_resume, str(tmp_path))
    if world > 1:  # each rank saw its own batches: the statistics differ
        assert not torch.equal(ranks[0]["buffers"]["bn.running_mean"],
                               ranks[1]["buffers"]["bn.running_mean"])
    for out in ranks:
        assert out["resumed"] == out["straight"]
        for k, v in out["buffers"].items():
            assert torch.equal(out["resumed_buffers"][k], v), k
        for k, v in out["state"].items():
            assert torch.equal(out["resumed_state"][k], v), k


def _bn_load_alone(rank, world, root):
    import warnings

    import autoshard as api

    torch.manual_seed(0)
    model = autoshard(Normed())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        api.load_checkpoint(f"{root}/bn", model, opt)
    return {"buffers": _buffers(model), "warned": [str(w.message) for w in caught]}


def _bn_save(rank, world, root):
    import autoshard as api

    torch.manual_seed(0)
    model = autoshard(Normed())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, 0, 2, rank, world)
    api.save(f"{root}/bn", model, opt)
    return _buffers(model)


def test_at_another_world_size_every_rank_loads_rank_0s_buffers_with_a_warning(tmp_path):
    saved = run_ranks(2, _bn_save, str(tmp_path))
    (alone,) = run_ranks(1, _bn_load_alone, str(tmp_path))
    for k, v in saved[0].items():
        assert torch.equal(alone["buffers"][k], v), k
    assert any("rank 0's copy" in w and "world size 2" in w for w in alone["warned"]), \
        alone["warned"]
