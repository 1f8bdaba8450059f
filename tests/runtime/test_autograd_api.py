"""The autograd API beyond ``loss.backward()`` through a sharded model, against eager:
``backward(inputs=...)`` fills exactly the gradients named, reduced as ``.grad`` always is;
``torch.autograd.grad`` with respect to the parameters returns the sharded gradients
``.grad`` would hold (reduced over the ranks, said once by a warning) and touches no
``.grad``, with respect to inputs it touches no parameter's ``.grad`` either, as in eager;
torch.func transforms are refused at the call, naming them, and the model trains on
afterwards (``create_graph=True``: tests/runtime/test_double_backward.py). Tolerance: 1e-6
absolute (float32, the same graph)."""

import warnings

import pytest
import torch
import torch.nn as nn

from autoshard import AutoshardError, autoshard
from autoshard.runtime import executor
from harness import run_ranks

ATOL = 1e-6


def _build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(world):
    return torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(1))


def _eager(world):
    """Per case, eager's gradients of the ranks' mean loss (what data parallelism reduces)."""
    model, x = _build(), _batch(world)
    loss = lambda: sum(model(s).square().sum() for s in x.chunk(world)) / world  # noqa: E731
    first = list(model[0].parameters())
    loss().backward(inputs=first)
    out = {"inputs": [p.grad.clone() for p in first],
           "untouched": [p.grad for p in model[2].parameters()]}
    model.zero_grad(set_to_none=True)
    out["grad"] = torch.autograd.grad(loss(), list(model.parameters()))
    xs = x.clone().requires_grad_()
    out["input"] = torch.autograd.grad(sum(model(s).sum() for s in xs.chunk(world)), xs)[0]
    loss().backward()
    out["after"] = [p.grad.clone() for p in model.parameters()]
    return out


def _sharded(rank, world, _):
    executor._WARNED_REDUCED.clear()  # said once per process: it may have said it before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        model = autoshard(_build())
    x = _batch(world).chunk(world)[rank]
    full = lambda g: None if g is None else g.full_tensor()  # noqa: E731
    first = list(model[0].parameters())
    model(x).square().sum().backward(inputs=first)
    out = {"inputs": [full(p.grad) for p in first],
           "untouched": [p.grad for p in model[2].parameters()]}
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        grads = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    out["grad"] = [full(g) for g in grads]
    out["grad_types"] = [type(g).__name__ for g in grads]
    out["warned"] = [str(w.message) for w in seen if "reduced over" in str(w.message)]
    out["grad_left"] = [p.grad for p in model.parameters()]
    xs = x.clone().requires_grad_()
    out["input"] = torch.autograd.grad(model(xs).sum(), xs)[0]
    out["input_left"] = [p.grad for p in model.parameters()]
    refused = []
    for transform in (lambda: torch.func.vmap(lambda r: model(r[None]).sum())(x),
                      lambda: torch.func.jvp(model, (x,), (torch.ones_like(x),)),
                      lambda: torch.func.vjp(model, x)):
        try:
            transform()
        except AutoshardError as e:
            refused.append(str(e))
    out["refused"] = refused
    model(x).square().sum().backward()  # and it trains on as before
    out["after"] = [full(p.grad) for p in model.parameters()]
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_the_autograd_api_through_a_sharded_model(world):
    ref = _eager(world)
    for rank, got in enumerate(run_ranks(world, _sharded)):
        for a, b in zip(got["inputs"], ref["inputs"]):
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
        assert got["untouched"] == [None, None] == ref["untouched"]
        assert got["grad_types"] == ["DTensor"] * 4
        for a, b in zip(got["grad"], ref["grad"]):
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
        assert len(got["warned"]) == (1 if world > 1 else 0)
        assert got["grad_left"] == [None] * 4  # autograd.grad accumulates nothing
        torch.testing.assert_close(got["input"], ref["input"].chunk(world)[rank], rtol=0,
                                   atol=ATOL)
        assert got["input_left"] == [None] * 4  # as eager: no parameter's .grad
        assert len(got["refused"]) == 3
        assert all("torch.func" in m for m in got["refused"])
        for a, b in zip(got["after"], ref["after"]):
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_post_accumulate_grad_hooks_run_once_per_backward():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = autoshard(_build())
    calls = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, n=name: calls.append((n, t.grad is None)))
    x = _batch(1)
    model(x).sum().backward()
    assert sorted(calls) == sorted((n, False) for n, _ in model.named_parameters())
    calls.clear()
    model(x).sum().backward(inputs=list(model[2].parameters()))
    assert sorted(n for n, _ in calls) == ["2.bias", "2.weight"]


def test_without_gradient_sync_an_input_s_gradient_keeps_no_parameter_s():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, ref = autoshard(_build()), _build()
    x = _batch(1)
    with model.no_sync():
        xs = x.clone().requires_grad_()
        torch.autograd.grad(model(xs).sum(), xs)
        assert not model._autoshard.pending  # autograd.grad: nothing kept, as eager
        model(x).sum().backward()
    model(x).sum().backward()  # the synced backward adds what the plain one kept
    for _ in range(2):
        ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=ATOL)


def test_without_gradient_sync_backward_inputs_keeps_only_those_named():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, ref = autoshard(_build()), _build()
    x = _batch(1)
    with model.no_sync():
        model(x).sum().backward(inputs=list(model[2].parameters()))
        assert sorted(model._autoshard.pending) == ["2.bias", "2.weight"]
        with pytest.raises(AutoshardError, match="gradient sync is off"):
            torch.autograd.grad(model(x).sum(), list(model.parameters()))
    model(x).sum().backward()
    ref(x).sum().backward(inputs=list(ref[2].parameters()))
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=ATOL)


def test_under_detect_anomaly_the_step_captures_and_a_nan_gradient_raises_naming_it():
    """Anomaly detection's checks read values, which capture cannot: the step is traced with
    it off and trains as eager under it; a NaN the backward graph computes raises, naming the
    gradient, as autograd raises for a function returning one. Its NaN check cannot read the
    DTensor gradients autograd.grad of parameters returns: refused, naming check_nan=False,
    which works."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1; "Anomaly Detection has been enabled"
        model, ref = autoshard(_build()), _build()
        x = _batch(1)
        with torch.autograd.detect_anomaly():
            model(x).square().sum().backward()
            ref(x).square().sum().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=ATOL)
            model.zero_grad(set_to_none=True)
            with pytest.raises(RuntimeError, match="nan values in the gradient of 0.weight"):
                model(torch.full_like(x, float("nan"))).sum().backward()
            # its check cannot read the DTensor gradients autograd.grad of parameters returns
            with pytest.raises(AutoshardError, match="check_nan=False"):
                torch.autograd.grad(model(x).sum(), list(model.parameters()))
        with torch.autograd.detect_anomaly(check_nan=False):
            grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    expected = torch.autograd.grad(ref(x).sum(), list(ref.parameters()))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g.full_tensor(), e, rtol=0, atol=ATOL)
