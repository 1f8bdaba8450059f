"""A backward with ``create_graph=True`` through a sharded model, against eager data
parallelism (each rank's loss on its chunk of the batch, the gradients averaged): a gradient
penalty with respect to the inputs (WGAN-GP's), one on the parameters' gradients (through
``autograd.grad(loss, params, create_graph=True)``, which returns this rank's own gradients
as eager does), a Hessian-vector product, ``backward(create_graph=True)``; with dropout (the
backward replays the forward's masks) and batch norm (the buffers as the forward read them);
under every strategy, three optimizer steps each. Mixed precision and offload are refused
for such a backward, naming the reason, and the model trains on without it.

Tolerance: 1e-5 absolute (float32; the penalty's gradient runs eager's backward formulas on
the gathered parameters, summed over the ranks in another order than one process sums)."""

import warnings

import pytest
import torch
import torch.nn as nn

from torch.distributed.fsdp import MixedPrecisionPolicy

from autoshard import AutoshardError, Config, autoshard
from autoshard.core.options import Offload
from autoshard.runtime import double
from harness import run_ranks

ATOL = 1e-5
STEPS = 3


def _build(kind: str):
    torch.manual_seed(0)
    if kind == "bn":
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.25 if kind == "dropout"
                                                               else 0.0), nn.Linear(8, 3))


def _batch(world: int, step: int) -> torch.Tensor:
    return torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(10 + step))


def _input_penalty(model, x):
    x = x.clone().requires_grad_()
    out = model(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.square().mean() + (g.norm(dim=1) - 1).square().mean()


def _param_penalty(model, x):
    loss = model(x).square().mean()
    gs = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    return loss + sum(g.square().sum() for g in gs)


LOSSES = {"input": _input_penalty, "param": _param_penalty}


def _eager(world: int, kind: str, loss: str):
    """Per step, the parameters after SGD on the mean over the ranks of each rank's loss,
    each rank's drawn from its own random state."""
    model = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0
        for rank, x in enumerate(_batch(world, step).chunk(world)):
            torch.manual_seed(100 * step + rank)
            total = total + LOSSES[loss](model, x) / world
        total.backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _sharded(rank: int, world: int, case):
    kind, loss, strategy = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1, autograd.grad's form: said once
        model = autoshard(_build(kind), config=Config(strategy=strategy))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for step in range(STEPS):
            opt.zero_grad()
            torch.manual_seed(100 * step + rank)
            LOSSES[loss](model, _batch(world, step).chunk(world)[rank]).backward()
            opt.step()
            out.append([p.full_tensor().detach().clone() for p in model.parameters()])
    return out


def _compare(world: int, kind: str, loss: str, strategy: str = "zero3") -> None:
    ref = _eager(world, kind, loss)
    for got in run_ranks(world, _sharded, (kind, loss, strategy)):
        for step, (a, b) in enumerate(zip(got, ref)):
            for p, q in zip(a, b):
                torch.testing.assert_close(p, q, rtol=0, atol=ATOL,
                                           msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("loss", ["input", "param"])
def test_a_gradient_penalty_trains_as_eager(world, loss):
    _compare(world, "plain", loss)


@pytest.mark.parametrize("kind", ["dropout", "bn"])
def test_dropout_masks_and_batch_norm_buffers_are_the_forward_s(kind):
    _compare(2, kind, "input")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "zero1", "ddp"])
def test_every_strategy(strategy):
    _compare(2, "plain", "param", strategy)


@pytest.mark.slow
def test_four_ranks():
    _compare(4, "dropout", "param")


def _hvp(rank, world, _):
    double._SAID.clear()  # said once per process: this process may have said it before
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = autoshard(_build("plain"))
        x = _batch(world, 0).chunk(world)[rank]
        params = list(model.parameters())
        gs = torch.autograd.grad(model(x).square().mean(), params, create_graph=True)
        vs = [torch.ones_like(g) for g in gs]
        hv = torch.autograd.grad(gs, params, grad_outputs=vs)
        model(x).square().mean().backward(create_graph=True)
        kept = [(p.grad.requires_grad, p.grad.full_tensor()) for p in params]
    said = [str(w.message) for w in seen if "create_graph=True) with respect" in str(w.message)]
    return ([type(g).__name__ for g in gs], [g.detach() for g in gs],
            [h.full_tensor() for h in hv], kept, said)


@pytest.mark.parametrize("world", [1, 2])
def test_hessian_vector_products_and_backward_with_create_graph(world):
    model = _build("plain")
    params = list(model.parameters())
    xs = _batch(world, 0).chunk(world)
    own, hvs, grads = [], [], []
    for x in xs:
        gs = torch.autograd.grad(model(x).square().mean(), params, create_graph=True)
        own.append([g.detach() for g in gs])
        hvs.append(torch.autograd.grad(gs, params, [torch.ones_like(g) for g in gs]))
        grads.append(torch.autograd.grad(model(x).square().mean(), params))
    for rank, (types, gs, hv, kept, said) in enumerate(run_ranks(world, _hvp)):
        assert types == ["Tensor"] * 4  # this rank's own full gradients, as eager's
        for g, e in zip(gs, own[rank]):
            torch.testing.assert_close(g, e, rtol=0, atol=ATOL)
        for k, h in enumerate(hv):  # reduced as every parameter's gradient: the mean
            torch.testing.assert_close(h, sum(v[k] for v in hvs) / world, rtol=0, atol=ATOL)
        for k, (has_graph, g) in enumerate(kept):
            assert has_graph  # .grad keeps its graph, as eager's does
            torch.testing.assert_close(g, sum(v[k] for v in grads) / world, rtol=0, atol=ATOL)
        assert len(said) == (1 if world > 1 else 0)


def _refused(rank, world, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = autoshard(_build("plain"), config=config)
    x = _batch(world, 0).chunk(world)[rank]
    try:
        _input_penalty(model, x).backward()
    except AutoshardError as e:
        message = str(e)
    else:
        message = None
    model(x).sum().backward()  # and it trains on
    return message, all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("config, reason", [
    (dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)), "mixed precision"),
    (dict(offload_policy=Offload()), "offloaded"),
])
def test_what_it_cannot_match_is_refused_naming_the_reason(config, reason):
    for message, trained in run_ranks(2, _refused, Config(**config)):
        assert message is not None and "create_graph=True" in message and reason in message
        assert trained
