import pytest
import torch

from autoshard import Size
from autoshard.core import meta
from autoshard.core.models import GPT
from autoshard.passes import assign_units_pass
from graphs import captured, run
from models import CNN, MLP


def _units(ctx):
    return [(u.name, u.fqns) for u in ctx.units]


def test_module_policy_makes_each_repeated_block_a_unit_and_the_rest_root():
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)))
    gm, ctx = run(gm, ctx, assign_units_pass, policy="module")
    names = [u.name for u in ctx.units]
    assert names == ["root", "blocks.0", "blocks.1"]  # numbered by first use
    root = ctx.units[0].fqns
    assert "wte.weight" in root and "head.weight" not in root  # tied: one canonical name
    assert all(f.startswith("blocks.0.") for f in ctx.units[1].fqns)
    every = [f for u in ctx.units for f in u.fqns]
    assert sorted(every) == sorted(f for f, _ in GPT().named_parameters())


def test_sequential_of_mixed_layers_is_not_split():
    gm, ctx = captured(CNN(), torch.randn(2, 3, 8, 8))
    gm, ctx = run(gm, ctx, assign_units_pass, policy="module")
    assert [u.name for u in ctx.units] == ["root"]


def test_units_follow_first_use_and_tag_placeholders():
    gm, ctx = captured(MLP(), torch.randn(2, 16))
    gm, ctx = run(gm, ctx, assign_units_pass, policy="module")
    assert [u.name for u in ctx.units] == ["layers.0", "layers.1", "layers.2", "root"]
    for n in gm.graph.nodes:
        if meta.is_param(n):
            unit = ctx.units[meta.tag(n, meta.UNIT)]
            assert meta.tag(n, meta.FQN) in unit.fqns


def test_explicit_units_accept_tied_aliases_and_put_the_rest_in_root():
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)))
    gm, ctx = run(gm, ctx, assign_units_pass, units=[["head.weight", "wpe.weight"]])
    assert ctx.units[0].fqns == ["wte.weight", "wpe.weight"]
    assert ctx.units[1].name == "root"


@pytest.mark.parametrize("units, message", [
    ([["nope.weight"]], "'nope.weight', which is not a parameter"),
    ([["wte.weight"], ["head.weight"]], "each parameter belongs to one unit"),
])
def test_bad_explicit_units_are_named(units, message):
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)))
    with pytest.raises(ValueError, match=message):
        gm, ctx = run(gm, ctx, assign_units_pass, units=units)


ORDER = (["wte.weight", "wpe.weight"]
         + [f"blocks.{i}.{m}.{w}" for i in range(3) for m in ("ln1", "fc")
            for w in ("weight", "bias")]
         + ["ln_f.weight", "ln_f.bias"])


@pytest.mark.parametrize("fqns, name", [
    (ORDER, "root"),  # the whole model
    (["ln_f.bias", "ln_f.weight"], "ln_f"),  # a module, given in any order
    ([f for f in ORDER if f.startswith("blocks.")], "blocks"),
    ([f for f in ORDER if f.startswith(("blocks.1.", "blocks.2."))], "blocks.1-2"),
    (["blocks.0.fc.weight"], "blocks.0.fc.weight"),  # part of a module: the parameter
    (ORDER[:6], "wte..blocks.0"),
    (ORDER[4:9], "blocks.0.fc..blocks.1.fc.weight"),
    (["blocks.0.ln1.weight", "blocks.2.ln1.weight"], "blocks.0.ln1.weight..blocks.2.ln1.weight"),
])
def test_a_unit_is_named_by_the_module_paths_covering_its_parameters(fqns, name):
    from autoshard.passes.groupings import span_names

    assert span_names([fqns], ORDER) == [name]


@pytest.mark.parametrize("policy", ["auto", "size", "whole-model"])
def test_units_of_every_policy_are_named_by_module_paths(policy):
    import autoshard

    with torch.device("meta"):
        model = GPT(layers=12)
    budget = "2200KiB" if policy == "auto" else None  # several units, the rest of the model
    plan = autoshard.plan(model, (torch.randint(0, 96, (2, 16)),), world_size=2,
                          config=autoshard.Config(policy=Size(min_numel=60000) if policy ==
                                                  "size" else policy, memory_budget=budget))
    names = [u.name for u in plan.units]
    assert len(set(names)) == len(names) and (len(names) > 1) == (policy != "whole-model")
    for u in plan.units:
        first, last = _ends(u.name)
        assert first == "root" or u.fqns[0].startswith(first), (u.name, u.fqns)
        assert last == "root" or u.fqns[-1].startswith(last), (u.name, u.fqns)


def _ends(name):
    """The paths a unit's name says its first and last parameters are under."""
    if ".." in name:
        return tuple(name.split(".."))
    head, _, tail = name.rpartition(".")
    if "-" in tail:  # a range of numbered blocks
        lo, hi = tail.split("-")
        return f"{head}.{lo}", f"{head}.{hi}"
    return name, name
