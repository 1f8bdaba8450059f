"""Two patterns users bring from single-device code, at world sizes 1 and 2:

- ``torch.save(sharded.state_dict())``: the dict holds this rank's DTensor shards, so pickling
  it warns (naming the world size and the fix) whenever a tensor is only partly on this rank,
  and says nothing when every tensor is whole (world size 1); the file is the plain
  OrderedDict it was before, which ``torch.load(weights_only=True)`` reads; reading the dict
  as a mapping (``load_state_dict``, DCP's ``get_model_state_dict``, copies) warns of nothing;
- a parameter read outside a captured step (CLIP's ``logit_scale.exp()`` in the loss) is this
  rank's DTensor, which torch refuses to mix with the step's outputs (docs/faults.md); read
  in forward (returned with the features, as open_clip does) or in a method registered with
  ``register_forward_method``, it trains as eager.
"""

import collections
import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from autoshard import autoshard
from harness import Recipe, outcome, reference, run_ranks, train_sharded

TOL = 1e-5


# --- torch.save(sharded.state_dict()) --------------------------------------------------------

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _two():
    torch.manual_seed(0)
    return Two()


def _recorded(fn) -> list:
    """The messages of the warnings ``fn()`` raises, each one recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


def _saves(rank, world, root):
    model = autoshard(_two())
    path = f"{root}/rank{rank}.pt"
    out = {"save": _recorded(lambda: torch.save(model.state_dict(), path))}
    loaded = torch.load(path, weights_only=True)
    out["loaded"] = (type(loaded) is collections.OrderedDict, hasattr(loaded, "_metadata"),
                     all(isinstance(v, DTensor) for v in loaded.values()))
    out["rows"] = {k: v.to_local().shape[0] for k, v in loaded.items()}
    # read as a mapping, copied, or gathered whole: no warning
    out["reads"] = _recorded(lambda: (
        model.load_state_dict(torch.load(path, weights_only=True)),
        model.load_state_dict(model.state_dict()),
        get_model_state_dict(model),
        copy.copy(model.state_dict()),
        copy.deepcopy(model.state_dict())))
    full = model.full_state_dict()
    out["full"] = _recorded(lambda: torch.save(full, f"{root}/full{rank}.pt"))
    plain = Two()
    plain.load_state_dict(torch.load(f"{root}/full{rank}.pt", weights_only=True))
    out["from_full"] = {k: v.clone() for k, v in plain.state_dict().items()}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_saving_state_dict_warns_when_it_holds_only_this_ranks_shards(tmp_path, world):
    eager = _two().state_dict()
    for rank, out in enumerate(run_ranks(world, _saves, str(tmp_path))):
        assert out["loaded"] == (True, True, True)
        assert out["rows"]["a.weight"] == 8 // world
        assert out["reads"] == [] and out["full"] == []
        for k, v in eager.items():
            assert torch.equal(out["from_full"][k], v), k
        if world == 1:  # every tensor whole: the save is complete
            assert out["save"] == []
            continue
        assert len(out["save"]) == 1, out["save"]
        msg = out["save"][0]
        assert f"rank {rank} of world size 2" in msg
        assert "4 of its 4 tensors" in msg and "'a.weight': [4, 8] of its [8, 8]" in msg
        for fix in ("sharded.full_state_dict(rank0_only=True)", "autoshard.save(",
                    "autoshard.load_checkpoint("):
            assert fix in msg, msg


# --- a parameter read outside forward (CLIP's logit scale) -----------------------------------

class Clip(nn.Module):
    """Two towers and a learned temperature, as CLIP."""

    def __init__(self):
        super().__init__()
        self.image = nn.Linear(8, 6)
        self.text = nn.Linear(5, 6)
        self.logit_scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, image, text):
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1)

    def scaled_logits(self, image, text):
        i, t = self(image, text)
        return self.logit_scale.exp() * i @ t.T


class OpenClip(Clip):
    """open_clip's spelling: forward returns the scale beside the features."""

    def forward(self, image, text):
        return (*super().forward(image, text), self.logit_scale.exp())


def _contrastive(logits):
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _read_in_the_loop(model, image, text):
    i, t = model(image, text)
    return _contrastive(model.logit_scale.exp() * i @ t.T)


def _registered_loss(model, image, text):
    return _contrastive(model.scaled_logits(image, text))


def _returned_loss(model, image, text):
    i, t, scale = model(image, text)
    return _contrastive(scale * i @ t.T)


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 5, generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _recipe(cls, loss):
    def build():
        torch.manual_seed(0)
        return cls()

    return Recipe(build=build, data=_data, loss=loss, steps=3, optimizer=_sgd)


RECIPES = {"registered": _recipe(Clip, _registered_loss),
           "returned": _recipe(OpenClip, _returned_loss)}


def _state(model) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _clip(rank, world, how):
    def shard(model):
        model = autoshard(model)
        if how == "registered":
            model.register_forward_method("scaled_logits")
        return model

    model, losses = train_sharded(RECIPES[how], shard, rank, world)
    return {"losses": losses, "state": _state(model)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how", sorted(RECIPES))
def test_clips_logit_scale_read_in_a_step_trains_as_eager(world, how):
    ref_losses, ref_state = reference(RECIPES[how], world)
    for out in run_ranks(world, _clip, how):
        assert out["losses"] == pytest.approx(ref_losses, abs=TOL)
        for k, v in ref_state.items():
            torch.testing.assert_close(out["state"][k], v, rtol=0, atol=TOL, msg=k)


def _scalar_read_in_the_loop(model, image, text):
    i, t = model(image, text)
    return (i @ t.T).mean() * model.logit_scale.exp()


def _read_outside(rank, world, _):
    model = autoshard(_recipe(Clip, None).build())
    image, text = (t.chunk(world)[rank] for t in _data(0))
    out = {how: outcome(lambda: loss(model, image, text).backward())
           for how, loss in (("logits", _read_in_the_loop), ("scalar", _scalar_read_in_the_loop))}
    out["no_grads"] = all(p.grad is None for p in model.parameters())
    model.register_forward_method("scaled_logits")  # the fix: the next step trains
    out["then"] = outcome(lambda: _registered_loss(model, image, text).backward())
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_clips_logit_scale_read_in_the_loop_fails_in_torch_as_documented(world):
    """What docs/faults.md says happens: torch's own error (from the multiplication, or with
    a scalar from ``backward()``), no gradient written, and the fix trains next."""
    for out in run_ranks(world, _read_outside, None):
        for how in ("logits", "scalar"):
            assert out[how].startswith("escaped RuntimeError"), out[how]
            assert "mixed torch.Tensor and DTensor" in out[how], out[how]
        assert out["no_grads"] and out["then"] == "ok"
