import pytest
import torch
import torch.nn as nn

from autoshard.core import meta
from autoshard.core.models import GPT
from graphs import captured
from models import CNN


def _phs(gm, role):
    return [n for n in gm.graph.nodes if n.op == "placeholder" and meta.role(n) == role]


def test_every_placeholder_and_output_has_a_role():
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)))
    fqns = [meta.tag(n, meta.FQN) for n in _phs(gm, meta.ROLE_PARAM)]
    assert fqns == [f for f, _ in GPT().named_parameters()]  # tied head: one placeholder
    assert [meta.tag(n, meta.INDEX) for n in _phs(gm, meta.ROLE_INPUT)] == [0]
    assert [meta.tag(n, meta.INDEX) for n in _phs(gm, meta.ROLE_TANGENT)] == [0]
    roles = meta.output_roles(gm)
    assert roles[0] == {meta.ROLE: meta.OUT_FWD, meta.INDEX: 0}
    assert [r[meta.FQN] for r in roles[1:]] == fqns  # one gradient per parameter


def test_mutated_buffers_are_outputs_and_inputs_stay_untouched():
    gm, _ = captured(CNN(), torch.randn(2, 3, 8, 8))
    roles = [r for r in meta.output_roles(gm) if r[meta.ROLE] == meta.OUT_BUFFER]
    assert {r[meta.FQN] for r in roles} == {
        f"features.{i}.{b}" for i in (1, 4) for b in ("running_mean", "running_var",
                                                     "num_batches_tracked")
    }


def test_forward_nodes_carry_module_paths_and_backward_nodes_their_forward_node():
    gm, _ = captured(GPT(), torch.randint(0, 96, (2, 16)))
    nodes = {n.name: n for n in gm.graph.nodes}
    fwd_mm = [n for n in gm.graph.nodes if meta.is_forward(n)
              and n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)]
    assert {meta.tag(n, meta.MODULE) for n in fwd_mm} >= {"blocks.0.qkv", "blocks.1.fc", "head"}
    bwd = [n for n in gm.graph.nodes if meta.is_backward(n) and n.op == "call_function"]
    linked = [n for n in bwd if meta.tag(n, meta.FWD_NODE)]
    assert len(linked) >= 0.8 * len(bwd)
    for n in linked:
        src = nodes[meta.tag(n, meta.FWD_NODE)]
        assert meta.is_forward(src) and meta.tag(n, meta.MODULE) == meta.tag(src, meta.MODULE)


class _Outputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=2.0):
        y = self.lin(x) * scale
        return {"y": y, "parts": (y.sum(), x.shape[0]), "name": "ok", "none": None}


def test_structured_outputs_and_constants_pass_through():
    from autoshard import autoshard

    model = autoshard(_Outputs())
    x = torch.randn(3, 4)
    out = model(x, scale=3.0)
    assert set(out) == {"y", "parts", "name", "none"}
    assert out["name"] == "ok" and out["none"] is None and out["parts"][1] == 3
    ref = _Outputs()
    ref.load_state_dict(model.full_state_dict())
    torch.testing.assert_close(out["y"], ref(x, 3.0)["y"])
    out["parts"][0].backward()


def test_hf_model_output_round_trips():
    from autoshard import autoshard
    from models import build

    model = autoshard(build("hf_llama"))
    out = model(input_ids=torch.randint(0, 96, (2, 16)))
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.logits.shape == (2, 16, 96)


def test_each_new_input_signature_compiles_once():
    from autoshard import autoshard

    torch.manual_seed(0)
    model = autoshard(GPT())
    progs = model._autoshard.programs
    model(torch.randint(0, 96, (2, 16)))
    model(torch.randint(0, 96, (2, 16)))
    assert len(progs) == 1
    model(torch.randint(0, 96, (2, 8)))  # new shape
    assert len(progs) == 2
    with torch.no_grad():  # no backward: its own program
        model(torch.randint(0, 96, (2, 8)))
    assert len(progs) == 3 and model.plan.schedule[-1].region == "fwd"
    model.eval()
    model(torch.randint(0, 96, (2, 8)))
    assert len(progs) == 4


class _SharedSubmodule(nn.Module):
    """One Linear reachable as ``a`` and as ``b``, applied twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_a_shared_submodule_gets_its_parameters_back_after_capture():
    from autoshard import autoshard

    torch.manual_seed(0)
    ref = _SharedSubmodule()
    model = autoshard(_SharedSubmodule())
    model.load_state_dict(ref.state_dict())
    held = dict(model.named_parameters(remove_duplicate=False))
    x = torch.randn(3, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    after = dict(model.named_parameters(remove_duplicate=False))
    assert list(after) == ["a.weight", "a.bias", "b.weight", "b.bias"]
    assert all(after[k] is held[k] for k in held)  # the very DTensors, not capture's fakes
    assert model.b is model.a
    assert torch.allclose(model.a.weight.grad.full_tensor(), ref.a.weight.grad)


class Checked(nn.Module):
    """Checks a value of its input, as transformers' LLaVA checks its image-token count."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, marks):
        torch._check_tensor_all_with(ValueError, (marks == 7).sum() == 2,
                                     lambda: "marks must hold two sevens")
        return self.lin(x).sum()


def test_a_check_on_a_value_is_captured_as_a_runtime_assert():
    gm, _ = captured(Checked(), torch.randn(2, 4), torch.tensor([7, 7, 1]), world_size=1)
    (check,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_scalar.default]
    assert check.args[0].target is torch.ops.aten._local_scalar_dense.default
    assert "marks must hold two sevens" in check.args[1]  # the check's source line
    assert "test_capture.py" in check.args[1]


def test_a_violated_check_on_a_value_raises_in_the_captured_step():
    import warnings

    from autoshard import autoshard

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        sharded = autoshard(Checked())
    x = torch.randn(2, 4)
    sharded(x, torch.tensor([7, 7, 1])).backward()
    with pytest.raises(RuntimeError, match="marks must hold two sevens"):
        sharded(x, torch.tensor([7, 1, 1]))
