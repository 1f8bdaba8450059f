"""Parameters of dtypes other than float32 at 2 gloo ranks, trained against eager: complex64
filters (gloo has no complex collectives: complex tensors are gathered and reduced as their
real views; a complex vector is replicated, see ``spec.placements_for``) and float64 layers.
A collective that fails on its own (not for want of a peer) is reported with its own
message, naming the node, never as a lost peer."""

import pytest
import torch
import torch.nn as nn

from autoshard import Config, autoshard
from harness import run_ranks

WORLD, STEPS, BATCH, N = 2, 3, 4, 16


class FFTFilter(nn.Module):
    """x -> irfft(rfft(x) * w + rfft(x) @ mix), a learned complex64 filter ``w`` (a vector)
    and frequency mixing ``mix`` (a matrix, sharded unevenly: 9 rows over 2 ranks), between
    two linear layers."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(N, N)
        self.w = nn.Parameter(torch.randn(N // 2 + 1, dtype=torch.complex64))
        self.mix = nn.Parameter(0.1 * torch.randn(N // 2 + 1, N // 2 + 1,
                                                  dtype=torch.complex64))
        self.out = nn.Linear(N, 1)

    def forward(self, x):
        f = torch.fft.rfft(self.inp(x))
        h = torch.fft.irfft(f * self.w + f @ self.mix, n=N)
        return self.out(torch.tanh(h))


class Double(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(N, N, dtype=torch.float64)
        self.b = nn.Linear(N, 1, dtype=torch.float64)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.double()))).float()


MODELS = {"complex64": FFTFilter, "float64": Double}


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, N, generator=g), torch.randn(BATCH, 1, generator=g)


def _train(model, rank=0, world=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = (t.chunk(world)[rank] for t in _data(step))
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank, world, name):
    torch.manual_seed(0)
    sharded = autoshard(MODELS[name](), config=Config(policy="module"))
    _train(sharded, rank, world)
    return {k: v for k, v in sharded.full_state_dict().items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_parameters_of_other_dtypes_train_as_eager(name):
    torch.manual_seed(0)
    ref = MODELS[name]()
    _train(ref)
    got = run_ranks(WORLD, _worker, name)[0]
    for k, v in ref.state_dict().items():
        assert got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=k)


def _refused_worker(rank, world, _):
    import autoshard.passes.collectives as collectives

    real = collectives._real
    collectives._real = lambda t: t  # send complex tensors as they are: gloo refuses them
    torch.manual_seed(0)
    try:
        sharded = autoshard(FFTFilter(), config=Config(policy="module"))
        _train(sharded, rank, world)
    except Exception as e:  # noqa: BLE001 - its message is the result
        return f"{type(e).__name__}: {e}"
    finally:
        collectives._real = real  # the pooled process runs other tests after this one
    return "trained"


def test_a_collective_that_fails_on_its_own_is_not_reported_as_a_lost_peer():
    for msg in run_ranks(WORLD, _refused_worker):
        assert msg.startswith("AutoshardError"), msg
        assert "graph node" in msg and "Invalid scalar type" in msg, msg
        assert "no answer" not in msg and "peer" not in msg, msg
