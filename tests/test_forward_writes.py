"""What a forward writes to the Python world (``autoshard.core.writes``): after every call the
attributes it set hold what eager leaves there, real tensors with their autograd graph where
eager has one; a container it changes in place is refused at the first call, naming the
attribute and the line, and nothing of the user's is changed by capture."""

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

from autoshard import AutoshardError, autoshard
from harness import Recipe, eager_and_sharded, reference, run_ranks, train_sharded

TOL = dict(rtol=1e-5, atol=1e-5)


class WarmUp(nn.Module):
    """A warm-up that ends: a Python counter the forward reads and writes."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.relu(self.a(x))
        if self.calls > 2:  # past the warm-up: a different step
            h = h * 2
        return self.b(h)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        self.aux_loss = y.pow(2).mean()  # a load-balancing / regulariser loss the loop reads
        self.last_hidden = y.detach()  # kept for inspection
        return y


class AuxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.block(x)))


@dataclasses.dataclass
class Settings:
    seen: int = 0
    mode: str = "fresh"


class Configured(nn.Module):
    """Writes a plain value and a field of a config object it holds."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.cfg = Settings()

    def forward(self, x):
        self.cfg.seen = self.cfg.seen + 1
        self.mode = "trained"
        return self.lin(x)


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _mse(model, x, y):
    return (model(x) - y).square().mean()


def _with_aux(model, x, y):
    return (model(x) - y).square().mean() + 0.5 * model.block.aux_loss


def _recipe(build, loss, steps=3):
    def seeded():
        torch.manual_seed(0)
        return build()
    return Recipe(seeded, _data, loss, steps, lambda p: torch.optim.SGD(p, lr=0.1))


RECIPES = {"aux": (AuxNet, _with_aux)}


def _sharded(rank, world, name):
    build, loss = RECIPES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, losses = train_sharded(_recipe(build, loss), autoshard, rank, world)
    return losses, {k: v.detach().clone() for k, v in model.full_state_dict().items()}


@pytest.mark.parametrize("world", [1, 2])
def test_an_auxiliary_loss_set_in_forward_trains_as_in_eager(world):
    ref_losses, ref_state = reference(_recipe(AuxNet, _with_aux), world)
    for losses, state in run_ranks(world, _sharded, "aux"):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, **TOL, msg=k)


def test_a_counter_read_and_written_in_forward_follows_eager():
    ref_losses, ref_state = reference(_recipe(WarmUp, _mse, steps=4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, losses = train_sharded(_recipe(WarmUp, _mse, steps=4), autoshard, 0, 1)
    assert model.calls == 4
    assert losses == pytest.approx(ref_losses, rel=1e-5)  # the branch flips at the 3rd call
    for k, v in model.full_state_dict().items():
        torch.testing.assert_close(v, ref_state[k], **TOL, msg=k)


def test_tensors_set_in_forward_are_real_and_the_step_s_own():
    ref, sharded = eager_and_sharded(AuxNet)
    for step in range(2):
        x, _ = _data(step)
        out, want = sharded(x), ref(x)
        got = sharded.block.last_hidden
        assert type(got) is torch.Tensor and not got.requires_grad  # real, as h.detach()
        torch.testing.assert_close(got, ref.block.last_hidden, **TOL)
        aux = sharded.block.aux_loss
        assert type(aux) is torch.Tensor and aux.grad_fn is not None
        torch.testing.assert_close(aux, ref.block.aux_loss, **TOL)
        torch.testing.assert_close(out, want, **TOL)
        (out.sum() + aux).backward()


def test_plain_values_and_config_fields_are_written_on_every_call():
    ref, sharded = eager_and_sharded(Configured)
    x, _ = _data(0)
    for _ in range(3):
        sharded.mode = ref.mode = "reset by the loop"
        sharded(x), ref(x)
        assert sharded.mode == ref.mode == "trained"
    assert sharded.cfg.seen == ref.cfg.seen == 3


class Logging(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.stats = []

    def forward(self, x):
        h = self.lin(x)
        self.stats.append(h.detach().mean())
        return h


def test_a_container_changed_in_place_is_refused_at_the_first_call_naming_it():
    _, sharded = eager_and_sharded(Logging)
    with pytest.raises(AutoshardError) as info:
        sharded(_data(0)[0])
    msg = str(info.value)
    assert "'stats'" in msg and "test_forward_writes.py" in msg and "register_forward_hook" in msg
    assert sharded.stats == []  # nothing fake, nothing lost


def test_capture_alone_changes_nothing():
    _, sharded = eager_and_sharded(AuxNet)
    before = dict(vars(sharded.block))
    sharded.precompile(_data(0)[0])
    assert dict(vars(sharded.block)).keys() == before.keys()
    assert not hasattr(sharded.block, "aux_loss")
    _, counted = eager_and_sharded(WarmUp)
    counted.precompile(_data(0)[0])
    assert counted.calls == 0
