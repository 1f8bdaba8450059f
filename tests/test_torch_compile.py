"""``torch.compile(sharded)``, as torchtitan and nanoGPT loops write it, trains as eager: the
sharded step is opaque to TorchDynamo (one graph break at the call). ``sharded.compile``
is ``torch.nn.Module.compile``; capturing now is ``sharded.precompile(*inputs)``."""

import time
import warnings

import pytest
import torch
import torch.nn as nn

from autoshard import AutoshardError, Config, autoshard
from harness import eager_and_sharded, run_ranks

STEPS, BATCH = 3, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _train(call, params, rank=0, world=1):
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = (t.chunk(world)[rank] for t in _data(step))
        loss = (call(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _same(ref, sharded):
    for (k, p), q in zip(ref.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_compiled_sharded_model_trains_as_eager_at_once(how):
    torch._dynamo.reset()
    ref, sharded = eager_and_sharded(Net)
    start = time.monotonic()
    if how == "torch.compile":
        call = torch.compile(sharded)
    else:
        assert sharded.compile() is None  # torch.nn.Module.compile's meaning
        call = sharded
    got = _train(call, list(sharded.parameters()))
    assert time.monotonic() - start < 60
    assert got == _train(ref, list(ref.parameters()))
    _same(ref, sharded)


def _worker(rank, world, _):
    torch._dynamo.reset()
    torch.manual_seed(0)
    sharded = autoshard(Net(), config=Config(policy="module"))
    losses = _train(torch.compile(sharded), list(sharded.parameters()), rank, world)
    return losses, sharded.full_state_dict()


def test_compiled_sharded_model_trains_as_eager_at_world_size_2():
    torch.manual_seed(0)
    ref = Net()
    _train(ref, list(ref.parameters()))
    _, params = run_ranks(2, _worker)[0]
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(params[k], v, rtol=1e-6, atol=1e-6, msg=k)


def test_precompile_captures_now_and_compile_is_torchs():
    x = torch.randn(BATCH, 8)
    _, sharded = eager_and_sharded(Net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sharded.precompile(x) is sharded
    assert len(sharded._autoshard.programs) == 1
    assert sharded._compiled_call_impl is None  # not torch.compile'd


def test_compile_with_example_inputs_is_refused_naming_precompile():
    """0.3's spelling, ``sharded.compile(x)``, warned until 0.5 and is refused since, naming
    ``precompile``; nothing is captured. With torch.compile's keyword arguments alone it is
    ``torch.nn.Module.compile``."""
    x = torch.randn(BATCH, 8)
    _, sharded = eager_and_sharded(Net)
    with pytest.raises(AutoshardError, match=r"sharded.precompile\(\*example_inputs\)"):
        sharded.compile(x)
    with pytest.raises(AutoshardError, match="keyword arguments"):
        sharded.compile(fullgraf=True)
    assert not sharded._autoshard.programs and sharded._compiled_call_impl is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sharded.compile(backend="eager")  # torch's meaning: no warning
    assert sharded._compiled_call_impl is not None
