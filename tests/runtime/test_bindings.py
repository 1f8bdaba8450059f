"""The graphs run with torch's public bindings in place of ATen overloads
(``autoshard.runtime.bindings``): the same values bit for bit, the same views, and the
passes' own graphs untouched."""

import pytest
import torch
import torch.fx as fx

from autoshard.runtime import bindings
from harness import eager_and_sharded

_A = torch.ops.aten


def _samples():
    """(overload, args, kwargs) for every entry of the two tables."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    a, b, c = r(4, 8), r(8, 6), r(6)
    return [
        (_A.view.default, (a, [-1]), {}),
        (_A.t.default, (a,), {}),
        (_A.detach.default, (a,), {}),
        (_A.transpose.int, (r(2, 3, 4), 0, 2), {}),
        (_A.permute.default, (r(2, 3, 4), [2, 0, 1]), {}),
        (_A.expand.default, (r(1, 6), [5, 6]), {}),
        (_A.unsqueeze.default, (a, 1), {}),
        (_A.squeeze.dim, (r(4, 1, 3), 1), {}),
        (_A.select.int, (a, 1, 2), {}),
        (_A.split_with_sizes.default, (a, [3, 5]), {"dim": 1}),
        (_A.mm.default, (a, b), {}),
        (_A.bmm.default, (r(2, 4, 8), r(2, 8, 3)), {}),
        (_A.addmm.default, (c, a, b), {"beta": 0.5, "alpha": 2.0}),
        (_A.relu.default, (a,), {}),
        (_A.sum.dim_IntList, (a, [0], True), {}),
        (_A.sum.dim_IntList, (a, [1]), {"dtype": torch.float64}),
        (_A.cat.default, ([a, a],), {"dim": 1}),
        (_A.mul.Tensor, (a, 3), {}),
        (_A.add.Tensor, (a, r(4, 8)), {"alpha": 2}),
        (_A.sub.Tensor, (a, 1.5), {"alpha": 3}),
        (_A.div.Tensor, (a, r(8)), {}),
        (_A.neg.default, (a,), {}),
        (_A.clone.default, (a.t(),), {"memory_format": torch.contiguous_format}),
        (_A.pow.Tensor_Scalar, (a, 2), {}),
        (_A.mean.dim, (a, [-1], True), {}),
        (_A.rsqrt.default, (a.abs() + 1,), {}),
        (_A.where.self, (a > 0, a, r(8)), {}),
        (_A.cos.default, (a,), {}),
        (_A.sin.default, (a,), {}),
        (_A.embedding.default, (r(10, 4), torch.tensor([[1, 3], [9, 0]])), {}),
    ]


def _leaves(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def test_the_tables_hold_every_sample_and_every_sample_is_in_the_tables():
    seen = {op for op, _, _ in _samples()}
    assert seen == set(bindings.METHODS) | set(bindings.FUNCTIONS)


@pytest.mark.parametrize("op,args,kwargs", _samples(), ids=lambda v: str(v)[:30])
def test_a_binding_computes_what_its_overload_does_bit_for_bit(op, args, kwargs):
    want = op(*args, **kwargs)
    if op in bindings.METHODS:
        got = getattr(args[0], bindings.METHODS[op][0])(*args[1:], **kwargs)
    else:
        got = bindings.FUNCTIONS[op][0](*args, **kwargs)
    for w, h in zip(_leaves(want), _leaves(got), strict=True):
        assert h.dtype == w.dtype and h.shape == w.shape and h.stride() == w.stride()
        assert torch.equal(h, w)
        # a view stays a view of the same storage, a new tensor stays new
        assert (h.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()) == (
            w.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()) \
            if isinstance(args[0], torch.Tensor) else True


def test_a_node_with_a_keyword_the_binding_does_not_take_keeps_its_overload():
    g = fx.Graph()
    x = g.placeholder("x")
    e = g.call_function(_A.expand.default, (x, [3, 4]), {"implicit": True})
    v = g.call_function(_A.view.default, (g.call_function(_A.clone.default, (e,)), [-1]))
    g.output(v)
    gm = fx.GraphModule(torch.nn.Module(), g)
    run = bindings.runnable(gm)
    ops = {n.name: (n.op, n.target) for n in run.graph.nodes}
    assert ops[e.name] == ("call_function", _A.expand.default)
    assert ops[v.name] == ("call_method", "view")
    assert (e.op, v.op) == ("call_function", "call_function")  # the passes' graph is kept
    x0 = torch.randn(1, 4)
    assert torch.equal(run(x0), gm(x0))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x))).t().t() * 0.5


def _mlp():
    return torch.nn.Sequential(*[_Block() for _ in range(3)], torch.nn.Linear(8, 4))


def _train(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                    for p in model.parameters()]


def test_a_step_through_the_bindings_is_the_step_through_the_overloads(monkeypatch):
    """Three AdamW steps of a small MLP at world size 1, with the runnable graphs and with
    the passes' graphs as they are: equal losses and parameters, bit for bit."""
    _, through = eager_and_sharded(_mlp)
    got = _train(through)
    prog = through._autoshard.last
    for runnable, written in ((prog.fwd, prog.split.fwd), (prog.bwd, prog.split.bwd)):
        calls = [n for n in runnable.graph.nodes if n.op == "call_method"]
        assert calls, "no node calls a binding"
        assert [n.name for n in runnable.graph.nodes] == [n.name for n in written.graph.nodes]
        assert not any(n.op == "call_method" for n in written.graph.nodes)

    monkeypatch.setattr(bindings, "runnable", lambda gm: gm)
    _, plain = eager_and_sharded(_mlp)
    want = _train(plain)
    assert not any(n.op == "call_method" for n in plain._autoshard.last.fwd.graph.nodes)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
