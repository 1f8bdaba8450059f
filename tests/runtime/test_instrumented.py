"""The executor's instrumented entry (what ``autoshard.check`` drives): one more run of a
program, node by node, that computes what the step computed and changes nothing."""

import pytest
import torch

from autoshard import autoshard
from autoshard.core.models import GPT

pytestmark = pytest.mark.filterwarnings("ignore:autoshard. no process group")


def _stepped():
    torch.manual_seed(0)
    sharded = autoshard(GPT())
    x = torch.randint(0, 96, (2, 16))
    out = sharded(x)
    tangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(tangent)
    return sharded, x, out.detach(), {0: tangent}


def test_the_compiled_graphs_rerun_node_by_node_give_the_steps_values():
    sharded, x, out, tangents = _stepped()
    grads = {f: p.grad.to_local().clone() for f, p in sharded.named_parameters()}
    params = {f: p.to_local().clone() for f, p in sharded.named_parameters()}
    seen = []
    traced = sharded._autoshard.run_instrumented(
        (x,), {}, tangents, lambda graph, node, value: seen.append((graph, node.op)))
    graphs = [g for g, _ in seen]
    assert graphs == sorted(graphs, key=["fwd", "bwd"].index) and {"fwd", "bwd"} <= set(graphs)
    assert all(op not in ("placeholder", "output") for _, op in seen)
    assert len(traced.outputs) == 1 and torch.equal(traced.outputs[0][1], out)
    assert set(traced.grads) == set(grads)
    for f, (_, g) in traced.grads.items():
        assert torch.equal(g, grads[f]), f
    # nothing written: no gradient accumulated again, no parameter changed
    for f, p in sharded.named_parameters():
        assert torch.equal(p.grad.to_local(), grads[f]) and torch.equal(p.to_local(), params[f])


def test_the_joint_graph_as_captured_gives_the_same_gradients():
    """On the parameters gathered whole (by default), or on the values given."""
    sharded, x, out, tangents = _stepped()
    nodes = []
    traced = sharded._autoshard.run_instrumented(
        (x,), {}, tangents, lambda graph, node, value: nodes.append(graph), graphs="joint")
    assert set(nodes) == {"joint"}
    torch.testing.assert_close(traced.outputs[0][1], out)
    for f, p in sharded.named_parameters():
        torch.testing.assert_close(traced.grads[f][1], p.grad.full_tensor(), msg=f)
    zero = {"wte.weight": torch.zeros(sharded.wte.weight.shape)}
    other = sharded._autoshard.run_instrumented((x,), {}, tangents, lambda *a: None,
                                                graphs="joint", params=zero)
    assert not torch.allclose(other.outputs[0][1], out)  # it read the value given


def test_an_unknown_graph_name_is_refused():
    sharded, x, _, tangents = _stepped()
    with pytest.raises(ValueError, match="'compiled' or 'joint'"):
        sharded._autoshard.run_instrumented((x,), {}, tangents, lambda *a: None,
                                            graphs="backward")
