import pytest
import torch

from autoshard import meta
from autoshard.models import GPT
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
