"""splice records the collectives' packing with a dispatch mode (``autoshard.core.graph.record``)
instead of make_fx; the programs must be the same node for node."""

import types

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from autoshard.compiler import depth
from autoshard.core import graph
from autoshard.core._compat import make_fx
from autoshard.compiler import compile_step
from autoshard.core.config import Config
from autoshard.core.models import GPT, tiny_hf

CONFIGS = {
    "gpt_ws4": (lambda: GPT(layers=2), 4, Config(policy="module")),
    "gpt_ws3_per_parameter": (lambda: GPT(layers=1), 3, Config(policy="per-parameter")),
    "gpt_bf16_offload": (lambda: GPT(layers=2), 4, Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(), device_profile="h100")),
    "hf_llama_ws1": (lambda: tiny_hf("llama", layers=2), 1, Config()),
}


def _program(make, world, cfg):
    model = make()
    x = torch.zeros(2, 16, dtype=torch.long)
    args, kwargs = ((x,), {}) if isinstance(model, GPT) else ((), {"input_ids": x})
    graph._TRACES.clear()
    _, ctx, _ = compile_step(model, type(model).forward, args, kwargs, world_size=world,
                             group_name="g", device=torch.device("cpu"), config=cfg)
    return ctx.split


def _as_captured(gm):
    fields = ("buffer_fqns", "mutated_buffers", "grad_tangents", "diff_outputs",
              "input_grads", "in_consts", "out_consts", "has_backward")
    return types.SimpleNamespace(gm=gm, **{f: None for f in fields})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recorded_packing_is_make_fx_packing(name, monkeypatch):
    recorded = _program(*CONFIGS[name])
    monkeypatch.setattr(graph, "record",
                        lambda fn, vals: make_fx(fn, tracing_mode="fake")(*vals))
    traced = _program(*CONFIGS[name])
    for a, b in ((recorded.fwd, traced.fwd), (recorded.bwd, traced.bwd)):
        assert depth.difference(_as_captured(a), _as_captured(b)) == ""


def _packing(buf, grad, host):  # the ops the collectives pass packs and unpacks with
    cols = buf.view(4, -1)
    a = cols[:, 0:6].reshape(8, 3)[:7]
    b = cols[:, 6:10].reshape(-1)
    g = torch.nn.functional.pad(grad.t().to(torch.float32), [0, 0, 0, 1])
    moved = torch.ops.aten._to_copy.default(host, device=buf.device, non_blocking=True)
    moved = moved.reshape(-1).to(torch.bfloat16)
    flat = torch.cat([moved, b.to(torch.bfloat16)])
    out = torch.empty((4 * flat.numel(),), dtype=flat.dtype, device=flat.device)
    return a, b, g.reshape(4, -1), flat, out, buf[4:16].view(3, 4).expand(2, 3, 4)


def _described(gm):
    out = []
    for n in gm.graph.nodes:
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (list, tuple)) else [vals]
        out.append((n.op, str(n.target), str(n.args), str(n.kwargs), [
            (type(v).__name__, tuple(v.shape), v.stride(), v.storage_offset(), v.dtype,
             v.device) for v in vals if isinstance(v, torch.Tensor)]))
    return out


def test_values_from_meta_kernels_are_the_fake_modes(monkeypatch):
    """record computes most fake values with the op's meta kernel (``_compat.fake_run``);
    every value equals the fake mode's own (shape, strides, offset, dtype, device), and the
    ops it leaves to the fake mode (a copy given a device, a constructor) are recorded the
    same."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoshard.core import _compat

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    cpu = torch.device("cpu")
    vals = [_compat.fake_empty(mode, (40,), torch.float32, cpu),
            _compat.fake_empty(mode, (3, 7), torch.bfloat16, cpu),
            _compat.fake_empty(mode, (2, 5), torch.float32, cpu)]
    ran = []
    fake_run = _compat.fake_run

    def counted(*args):
        out = fake_run(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(_compat, "fake_run", counted)
    fast = _described(graph.record(_packing, vals))
    assert sum(ran) >= 10 and not all(ran)  # most ops, not the copy across devices
    monkeypatch.setattr(_compat, "fake_run", lambda *args: None)
    assert fast == _described(graph.record(_packing, vals))


def test_a_value_given_twice_is_traced_as_two_arguments():
    """Nodes spliced from one cached trace share their fake values; a function traced on two
    of them must read each of its arguments where it reads it (not the last one twice), and
    the trace, cached by metadata, must stay right for later nodes too."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoshard.core import _compat

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    v = _compat.fake_empty(mode, (4,), torch.float32, torch.device("cpu"))
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    a.meta["val"] = b.meta["val"] = v  # as two outputs of one cached trace
    g.output([a, b])
    gm = fx.GraphModule(torch.nn.Module(), g)
    out = next(n for n in g.nodes if n.op == "output")
    key = ("test_a_value_given_twice", 1)
    graph._TRACES.pop((key, (graph._val_key(v),) * 2), None)
    for _ in range(2):  # traced, then from the cache
        (s,), new = graph.splice(gm, lambda x, y: [torch.cat([x, 2 * y])], [a, b], out, {},
                                 key=key)
        x, y = torch.arange(4.0), torch.full((4,), 10.0)
        env = {a: x, b: y}
        for n in new:
            env[n] = n.target(*fx.node.map_arg(n.args, env.__getitem__),
                              **fx.node.map_arg(n.kwargs, env.__getitem__))
        assert torch.equal(env[s], torch.cat([x, 2 * y]))
