"""Loops and models a differential fuzzer once crashed on, each trained sharded against eager
at world sizes 1 and 2 (gloo): losses, parameters and buffers within 1e-5 (the parity
suite's tolerance), or refused with an AutoshardError naming the cause.

- accumulation: a micro-batch without gradient sync, then a synchronised one that runs two
  forwards (or two ``retain_graph=True`` backwards) before its backward: the first backward
  took the pending gradients, the second found none (a KeyError).
- a prefetch byte bound below one unit's gathered bytes, verified: a gather left where it is
  read (a unit larger than the bound, gathered alone) failed the verifier's bound.
- ZeRO-2 with ``Module(classes=[...])``: the plan's schedule read a backward input saved from
  a forward all-gather's wait as a wait (an IndexError).
- ZeRO-1 and an evaluation under ``torch.inference_mode()`` after a step: the replicas it
  gathered were inference tensors, which the next training step could not save for backward.
- Linear -> transpose -> BatchNorm1d -> transpose -> Linear: torch's fake batch norm keeps the
  input's strides, its kernel returns a contiguous output, so a ``view`` traced on the fake
  strides failed when run.
- ``BatchNorm1d(momentum=None)``: torch's module reads ``float(num_batches_tracked)``, which
  capture refused as data-dependent.

The eager reference runs in the same process: each rank's share of the batch in turn, its
loss divided by the world size, so that the summed gradients are the ranks' mean.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from autoshard import Config, autoshard
from autoshard.core.options import Module, Prefetch
from harness import run_ranks

TOL = 1e-5
ROWS, DIM, STEPS, LR = 4, 6, 3, 0.1  # ROWS: rows of the batch per rank and micro-batch


def _linear():
    return nn.Linear(DIM, DIM)


def _two_forwards(model, x, sync):
    """A synchronised micro-batch's two forwards, backward once."""
    (model(x).pow(2).mean() + model(2 * x).mean()).backward()


def _two_backwards(model, x, sync):
    """A synchronised micro-batch's loss, backward twice (``retain_graph=True``)."""
    loss = model(x).pow(2).mean()
    loss.backward(retain_graph=True)
    loss.backward()


def _mlp():
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, DIM))


def _plain(model, x, sync):
    model(x).pow(2).mean().backward()


def _normed():
    return nn.Sequential(nn.Linear(DIM, 16), nn.RMSNorm(16), nn.Linear(16, DIM))


class _Channels(nn.Module):
    """Linear, then BatchNorm1d over the features as channels (transposed in and out),
    then Linear: the batch norm reads a transposed input."""

    def __init__(self, momentum=0.1):
        super().__init__()
        self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 3)
        self.bn = nn.BatchNorm1d(8, momentum=momentum)

    def forward(self, x):  # (rows, 6) -> (rows, 2, 3): BatchNorm1d's length is 2
        h = self.a(x.unflatten(-1, (2, 3))).transpose(1, 2)
        return self.b(self.bn(h).transpose(1, 2)).flatten(1)


def _cumulative():
    """BatchNorm1d with ``momentum=None``: its statistics are cumulative averages."""
    return nn.Sequential(nn.Linear(DIM, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(),
                         nn.Linear(8, DIM))


_BOUND = {"prefetch": Prefetch(bytes="1KB"), "verify": True}  # each unit > 1 KB

# name -> (build, Config kwargs, micro-batches per step, what the last one runs)
CASES = {
    "accumulate_two_forwards": (_linear, {}, 2, _two_forwards),
    "accumulate_two_backwards": (_linear, {}, 2, _two_backwards),
    "prefetch_bound_below_a_unit": (_mlp, _BOUND, 1, _plain),
    "prefetch_bound_below_a_unit_module": (
        _mlp, {**_BOUND, "policy": Module(classes=[nn.Linear])}, 1, _plain),
    "zero2_module_policy": (
        _normed, {"strategy": "zero2", "policy": Module(classes=[nn.RMSNorm])}, 1, _plain),
    "zero1_inference_eval": (_mlp, {"strategy": "zero1"}, 1, _plain),
    "batch_norm_of_transposed": (_Channels, {}, 1, _plain),
    "batch_norm_of_transposed_no_recompute": (_Channels, {"recompute": False}, 1, _plain),
    "batch_norm_cumulative": (_cumulative, {}, 1, _plain),
    "batch_norm_cumulative_transposed": (lambda: _Channels(momentum=None), {}, 1, _plain),
}
# cases that evaluate the model under torch.inference_mode() after each optimizer step
EVALUATED = {"zero1_inference_eval"}


def _loop(model, rank, world, case, *, eager):
    _, _, k, last = CASES[case]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    shares = range(world) if eager else [rank]
    # eager: each rank's buffers (BatchNorm's statistics) are its own, as on the ranks
    held = [{n: b.clone() for n, b in model.named_buffers()} for _ in shares]
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        data = torch.randn(k, world, ROWS, DIM, generator=gen)
        for micro in range(k):
            sync = micro == k - 1
            if not eager and k > 1:
                model.set_requires_gradient_sync(sync)
            run = last if sync else _plain
            for r in shares:
                if eager:  # each rank's loss divided by the world size
                    _swap(model, held[r])
                    with _scaled(model, 1.0 / world):
                        run(model, data[micro, r], sync)
                    _swap(model, held[r])
                else:
                    run(model, data[micro, r], sync)
        opt.step()
        opt.zero_grad()
        if case in EVALUATED:
            with torch.inference_mode():
                model(data[0, rank])
    if eager:
        _swap(model, held[rank])


def _swap(model, held: dict) -> None:
    """Exchange ``model``'s buffers' values with ``held``'s."""
    with torch.no_grad():
        for n, b in model.named_buffers():
            b_now = b.clone()
            b.copy_(held[n])
            held[n] = b_now


class _scaled:
    """Within it, every gradient ``model``'s output sends back is scaled by ``factor``."""

    def __init__(self, model, factor):
        self.model, self.factor = model, factor

    def __enter__(self):
        self.handle = self.model.register_forward_hook(
            lambda m, i, out: out * self.factor + out.detach() * (1 - self.factor))

    def __exit__(self, *exc):
        self.handle.remove()


def _state(model):
    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().clone()
    return out


def worker(rank, world, cases):
    results = {}
    for case in cases:
        build, config, _, _ = CASES[case]
        torch.manual_seed(0)
        ref = build()
        model = copy.deepcopy(ref)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # world size 1 says so
            sharded = autoshard(model, config=Config(**config))
        try:
            _loop(sharded, rank, world, case, eager=False)
        except Exception as e:  # noqa: BLE001 - the test names what escaped
            results[case] = f"{type(e).__name__}: {e}"
            continue
        _loop(ref, rank, world, case, eager=True)
        got, want = _state(sharded), _state(ref)
        results[case] = max((got[k].float() - want[k].float()).abs().max().item()
                            for k in want)
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request):
    return run_ranks(request.param, worker, list(CASES))


@pytest.mark.parametrize("case", list(CASES))
def test_trains_as_eager(results, case):
    for r in results:
        assert not isinstance(r[case], str), r[case]
        assert r[case] <= TOL, f"{case}: max |Δ| over parameters and buffers {r[case]:.3g}"
