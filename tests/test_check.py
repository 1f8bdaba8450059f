"""autoshard.check: eager against compiled for one step, and where they first differ.

Good models pass; broken compilations (a wrong op in the backward, an unsafe recomputation,
a capture that differs from eager, a runtime that mis-accumulates) are caught, the right
parameter is named worst, and the right node (or stage) is named."""

import copy
import operator
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard import Config
from autoshard.core.models import GPT
from harness import run_ranks
from models import MLP, Odd

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAST = Config(policy="module")


class Router(nn.Module):
    """Top-2 routing whose weights are renormalised in place (as Mixtral-style routers do)."""

    def __init__(self, d=8, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        v, i = torch.topk(torch.softmax(self.gate(x), -1), 2)
        v /= v.sum(-1, keepdim=True)
        outs = torch.stack([e(x) for e in self.experts], -2)
        sel = torch.gather(outs, -2, i.unsqueeze(-1).expand(*i.shape, outs.shape[-1]))
        return (sel * v.unsqueeze(-1)).sum(-2)


def _mlp():
    torch.manual_seed(0)
    return MLP(), (torch.randn(4, 16),)


def _break_backward(patch):
    """Make the compiled backward compute the first layer's tanh gradient with the wrong op
    (``mul`` instead of ``tanh_backward``), after every pass ran. ``patch(obj, name, value)``
    installs the wrapper; returns the list the corrupted node names are appended to."""
    import sys

    from autoshard.passes.split import split_pass as split

    corrupted = []

    def broken_split(gm, ctx, *, options):
        gm, decided = split(gm, ctx, options=options)
        bwd = decided["split"].bwd
        last = [n for n in bwd.graph.nodes if n.target is torch.ops.aten.tanh_backward.default][-1]
        last.target = torch.ops.aten.mul.Tensor  # the gradient of layers.0's tanh, now wrong
        bwd.recompile()
        corrupted.append(last.name)
        return gm, decided

    # every module of the passes and the planner that holds the split pass by name runs the
    # broken one
    for name, module in list(sys.modules.items()):
        if name.startswith(("autoshard.passes", "autoshard.planner")) and getattr(
                module, "split_pass", None) is split:
            patch(module, "split_pass", broken_split)
    return corrupted


# --- passing ----------------------------------------------------------------------------------


def test_gpt_passes_and_the_graphs_agree_node_by_node():
    torch.manual_seed(0)
    model = GPT()
    x = torch.randint(0, 96, (2, 16))
    report = autoshard.check(model, (x,), config=FAST, localise=True)
    assert report.ok, str(report)
    assert [r.fqn for r in report.params] == [f for f, _ in model.named_parameters()]
    assert all(r.status == "ok" and r.max_grad > 0 for r in report.params)
    assert report.first_difference is None
    assert report.nodes_compared > 300  # the node-level search ran and found nothing
    text = str(report)
    assert "OK" in text and "blocks.1.fc.weight" in text and "atol 1e-05, rtol 0.0001" in text


def test_mixed_precision_is_compared_with_eager_under_the_same_policy():
    """The reference is the model with its parameters in param_dtype, outputs cast to
    output_dtype and gradients reduced in reduce_dtype, as FSDP2 computes: the GPT matches it
    exactly, node by node, and each gradient is judged at bf16's tolerance."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              output_dtype=torch.float32)
    torch.manual_seed(0)
    report = autoshard.check(GPT(), (torch.randint(0, 96, (2, 16)),), localise=True,
                             config=Config(policy="module", mp_policy=mp))
    assert report.ok and report.first_difference is None, str(report)
    assert all(r.dtype == "bfloat16" and r.max_delta == 0 for r in report.params)
    assert "bfloat16: atol 0.001, rtol 0.02" in str(report)


def test_mlp_passes_with_the_default_config_and_a_user_loss():
    model, inputs = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = autoshard.check(model, inputs, loss_fn=lambda out: out.softmax(-1)[:, 0].sum())
    assert report.ok and report.worst is not None and report.outputs_delta <= 1e-5, str(report)
    assert "loss_fn(outputs)" in str(report)
    # the user's model is untouched
    assert type(model) is MLP and not hasattr(model, "_autoshard")
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_outputs_and_parameters_without_gradients():
    class Partial(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.unused, self.frozen = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return {"y": self.frozen(self.a(x)), "n": x.sum(-1).long()}

    torch.manual_seed(0)
    report = autoshard.check(Partial(), (torch.randn(3, 4),), config=FAST)
    assert report.ok, str(report)
    status = {r.fqn: r.status for r in report.params}
    assert status == {"a.weight": "ok", "a.bias": "ok", "unused.weight": "no grad",
                      "unused.bias": "no grad"}  # frozen parameters are not rows
    assert [o.path for o in report.outputs] == ["['y']", "['n']"]


# --- caught and localised ---------------------------------------------------------------------


def test_a_wrong_op_in_the_backward_is_named(monkeypatch):
    corrupted = _break_backward(monkeypatch.setattr)
    model, inputs = _mlp()
    report = autoshard.check(model, inputs, config=FAST)
    assert not report.ok
    bad = {r.fqn for r in report.params if not r.ok}
    assert bad == {"layers.0.weight", "layers.0.bias"}, str(report)
    assert report.worst[0] in bad and report.worst[1] > 1e-3
    diff = report.first_difference
    assert diff is not None and diff.stage == "graph", str(report)
    assert diff.node == corrupted[-1] and diff.graph == "bwd" and diff.op == "aten.mul.Tensor"
    assert "aten.tanh_backward.default" in diff.description  # the captured graph's op
    text = str(report)
    assert "DIFFERS" in text and f"first difference: node {diff.node}" in text


def _unsafe_recomputable(n, mutated, region):
    """Recompute any cheap op, even one that reads a tensor written in place later."""
    from autoshard.core.graph import aliased_arg, written_inputs
    from autoshard.passes import remat

    t = n.target
    if n.op != "call_function" or written_inputs(n):
        return False
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in t.tags:
        return False
    return t in remat._CHEAP or torch.Tag.pointwise in t.tags or aliased_arg(n) is not None


def test_an_unsafe_recomputation_is_named(monkeypatch):
    """``v /= v.sum()`` after topk: recomputing the sum in backward reads the divided v."""
    from autoshard.passes import remat

    monkeypatch.setattr(remat, "_recomputable", _unsafe_recomputable)
    monkeypatch.setenv("AUTOSHARD_VERIFY", "0")  # the verifier would refuse this graph
    torch.manual_seed(0)
    report = autoshard.check(Router(), (torch.randn(6, 8),), config=FAST)
    assert not report.ok
    assert report.worst[0] == "gate.weight", str(report)
    assert all(r.ok for r in report.params if r.fqn.startswith("experts."))
    assert all(o.ok for o in report.outputs)  # the forward is right; the backward is not
    diff = report.first_difference
    assert diff.stage == "graph" and diff.graph == "bwd", str(report)
    assert diff.op == "aten.sum.dim_IntList" and diff.recomputed_from.startswith("sum")
    assert f"recomputes forward node {diff.recomputed_from}" in str(report)


def test_a_capture_that_differs_from_eager_is_blamed_on_capture(monkeypatch):
    from autoshard.compiler import capture as capture_mod

    real = capture_mod.capture

    def wrong_capture(*args, **kwargs):
        cap = real(*args, **kwargs)
        for n in cap.gm.graph.nodes:  # the forward's first tanh becomes a sigmoid
            if n.target is torch.ops.aten.tanh.default:
                n.target = torch.ops.aten.sigmoid.default
                break
        cap.gm.recompile()
        return cap

    monkeypatch.setattr(capture_mod, "capture", wrong_capture)  # the compile step's capture
    model, inputs = _mlp()
    report = autoshard.check(model, inputs, config=FAST)
    assert not report.ok and not report.outputs[0].ok
    diff = report.first_difference
    assert diff.stage == "capture" and "before any pass" in str(diff), str(report)


def test_a_runtime_difference_is_placed_outside_the_graphs(monkeypatch):
    from autoshard.runtime import executor

    real = executor._accumulate
    monkeypatch.setattr(executor, "_accumulate", lambda p, g: real(p, g * 1.01))
    model, inputs = _mlp()
    report = autoshard.check(model, inputs, config=FAST)
    assert not report.ok and all(not r.ok for r in report.params)
    assert report.first_difference.stage == "runtime", str(report)


# --- bad input --------------------------------------------------------------------------------


def test_bad_input_is_explained():
    model, inputs = _mlp()
    with pytest.raises(ValueError, match="example_inputs"):
        autoshard.check(model, None)
    sharded = autoshard.autoshard(copy.deepcopy(model), config=FAST, example_inputs=inputs)
    with pytest.raises(ValueError, match="unsharded model"):
        autoshard.check(sharded, inputs)
    with torch.device("meta"):
        meta_model = MLP()
    with pytest.raises(ValueError, match="meta device"):
        autoshard.check(meta_model, inputs)


# --- two ranks --------------------------------------------------------------------------------


def _world2_worker(rank, world, payload):
    # dim-0 sizes 7, 1 and 5 (padded shards), a frozen parameter and a replicated scalar
    torch.manual_seed(0)
    odd = Odd()
    torch.manual_seed(10 + rank)  # each rank its own batch
    good = autoshard.check(odd, (torch.randn(4, 6),), config=FAST, localise=True)

    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    corrupted = _break_backward(patch)
    try:
        model, _ = _mlp()
        torch.manual_seed(10 + rank)
        bad = autoshard.check(model, (torch.randn(4, 16),), config=FAST)
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
    return {"good": (good.ok, good.first_difference, good.nodes_compared, str(good)),
            "bad": (bad.ok, bad.worst, bad.first_difference, corrupted[-1],
                    [r.fqn for r in bad.params if not r.ok])}


def test_two_ranks_compare_with_eager_averaged_over_ranks():
    results = run_ranks(2, _world2_worker)
    for rank, res in enumerate(results):
        ok, first, compared, text = res["good"]
        assert ok and first is None and compared > 20, text
        assert "averaged over 2 ranks" in text
        ok, worst, first, corrupted, bad = res["bad"]
        assert not ok and set(bad) == {"layers.0.weight", "layers.0.bias"}
        assert worst[0] in bad
        assert first.stage == "graph" and first.node == corrupted and first.rank == rank
    assert results[0]["bad"][1] == results[1]["bad"][1]  # the same worst on every rank


# --- the command line -------------------------------------------------------------------------


TINY_LM = """
import torch.nn as nn


def tiny_lm():
    return nn.Sequential(nn.Embedding(32, 8), nn.LayerNorm(8), nn.Linear(8, 32))
"""


def test_cli_prints_the_report_and_exits_zero(tmp_path):
    """A factory without example_inputs gets integer tokens (batch, seq)."""
    (tmp_path / "ck_tiny.py").write_text(TINY_LM)
    cmd = [sys.executable, "-m", "autoshard", "check", "ck_tiny:tiny_lm", "--batch", "2",
           "--seq", "8", "--policy", "module"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "autoshard check: OK" in out.stdout and "0.weight" in out.stdout
    assert "2x8x32" in out.stdout  # the output of tokens (2, 8)


def test_cli_exits_one_when_the_step_differs(monkeypatch, tmp_path, capsys):
    (tmp_path / "ck_factory.py").write_text(
        "import torch\nfrom models import MLP\n\n"
        "def mlp():\n    return MLP()\n\n"
        "mlp.example_inputs = lambda b, s: (torch.randn(b, 16),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _break_backward(monkeypatch.setattr)
    from autoshard.__main__ import main

    assert main(["check", "ck_factory:mlp", "--policy", "module"]) == 1
    out = capsys.readouterr().out
    assert "autoshard check: DIFFERS" in out and "first difference: node" in out
