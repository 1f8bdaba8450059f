"""The plan as people read it: tables in 100 columns naming modules, the trace, the plot."""

import json
import re

import pytest
import torch

import autoshard
from autoshard.core.models import GPT, tiny_hf
from autoshard.core.plans import WIDTH, _fit, _shorten

# fx node names (view_25, clone_2093, native_layer_norm_backward), numbered units (group12)
NODE_NAME = re.compile(r"\b(view|clone|mm|addmm|add|mul|getitem|t|cat|embedding|arange|"
                       r"native_layer_norm(_backward)?|group|size|unit)_?\d+\b")
TOKENS = torch.randint(0, 96, (2, 16))


@pytest.fixture(scope="module")
def plans():
    """A small GPT in blocks, a deeper one in several "auto" units, a tiny Llama."""
    with torch.device("meta"):
        gpt = autoshard.plan(GPT(), (TOKENS,), world_size=2,
                             config=autoshard.Config(policy="module"))
        deep = autoshard.plan(GPT(layers=12), (TOKENS,), world_size=2,
                              config=autoshard.Config(memory_budget="2200KiB"))
    llama = autoshard.plan(tiny_hf("llama"), (TOKENS,), world_size=2,
                           config=autoshard.Config(memory_budget="1300KiB"))
    return {"gpt": gpt, "deep": deep, "llama": llama}


def _tables(plan):
    return {"plan": str(plan), "frees": plan.schedule_table(frees=True),
            "candidates": plan.candidates_table(), "summary": plan.summary_table()}


@pytest.mark.parametrize("name", ["gpt", "deep", "llama"])
def test_every_table_fits_100_columns_and_names_no_graph_node(plans, name):
    plan = plans[name]
    assert len(plan.units) > 1
    for kind, text in _tables(plan).items():
        for line in text.splitlines():
            assert len(line) <= WIDTH, (kind, line)
            assert not NODE_NAME.search(line), (kind, line)


def test_the_pattern_catches_what_the_tables_showed():
    for old in ("view_25", "bwd:clone_2093", "group12", "native_layer_norm_backward_1"):
        assert NODE_NAME.search(old)
    assert not NODE_NAME.search("blocks.1.out (backward)  model.layers.0-3")


def test_the_schedule_names_modules_and_folds_free_rows(plans):
    plan = plans["gpt"]
    text = plan.schedule_table()
    frees = sum(e.op == "free" for e in plan.schedule)
    assert frees and f"({frees} free rows not shown" in text
    rows = [line.split() for line in text.splitlines()[2:-1]]
    assert "free" not in {r[3] for r in rows}
    assert " free " in plan.schedule_table(frees=True)
    assert len(plan.schedule_table(frees=True).splitlines()) == len(plan.schedule) + 2
    # the backward's first all-gather: of the last block, for its last layer's backward
    first = next(r for r in rows if r[1] == "bwd" and r[3] == "all_gather")
    assert first[2] == "2:blocks.1" and first[-1] == "blocks.1.out"
    # a reduce-scatter serves the op that made the last gradient it reduces
    rs = [r for r in rows if r[3] == "reduce_scatter"]
    assert [r[2] for r in rs] == ["2:blocks.1", "1:blocks.0", "0:root"]
    assert rs[0][-1] == "blocks.1.ln1" and rs[-1][-1] == "head"


def test_the_embedding_backward_is_named_by_the_embedding(plans):
    plan = plans["llama"]
    last = [e for e in plan.schedule if e.region == "bwd"][-1]
    assert last.module == "model.embed_tokens"  # not model.rotary_emb, run after it
    assert not any("rotary" in e.module for e in plan.schedule if e.region == "bwd")


def test_the_peak_is_named_by_module(plans):
    for plan in plans.values():
        at = plan.predicted["peak_at"]
        assert not NODE_NAME.search(at) and ":" not in at
        assert f"{autoshard.core.plans.fmt_bytes(plan.predicted['peak_bytes'])} at {at}" in \
            plan.summary_table().replace("\n", " ").replace("  ", "")


def test_the_trace_names_each_collectives_unit_and_bytes(plans, tmp_path):
    plan = plans["deep"]
    plan.to_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    comm = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    issues = [e for e in plan.schedule if e.op in ("all_gather", "reduce_scatter")]
    assert len(comm) == len(issues)
    names = {u.index: u.name for u in plan.units}
    for ev, entry in zip(comm, issues):
        assert ev["args"]["bytes"] == entry.bytes and ev["args"]["unit"] == entry.unit
        assert ev["name"] == (f"{entry.op} {names[entry.unit]} "
                              f"({autoshard.core.plans.fmt_bytes(entry.bytes)})")
    compute = {e["name"] for e in events if e["ph"] == "X" and e["tid"] == 0}
    assert "blocks.3.fc (backward)" in compute and "blocks.3.fc" in compute
    assert not any(NODE_NAME.search(n) for n in compute)


def _figure(plan):
    import matplotlib.pyplot as plt

    fig = plan.memory_figure()
    ax = fig.axes[0]
    out = {"ylabel": ax.get_ylabel(), "title": ax.get_title(),
           "lines": [line.get_label() for line in ax.get_lines()],
           "notes": [t.get_text() for t in ax.texts], "ylim": ax.get_ylim()}
    plt.close(fig)
    return out


def test_the_memory_plot_scales_labels_the_budget_and_marks_the_peak(plans):
    plan = plans["llama"]  # a budget near the peak: drawn on the scale
    fig = _figure(plan)
    assert fig["ylabel"] == "MiB per rank"
    peak = plan.predicted["peak_bytes"]
    fmt = autoshard.core.plans.fmt_bytes
    assert f"memory budget {fmt(plan.memory_budget)}" in fig["lines"]
    assert f"peak {fmt(peak)} at {plan.predicted['peak_at']}" in fig["notes"]
    assert fig["title"].endswith(f"world size 2, {len(plan.units)} units")
    assert fig["ylim"][1] >= plan.memory_budget / 2**20


def test_a_far_budget_does_not_flatten_the_curve(plans):
    plan = plans["gpt"]  # the CPU profile's 24 GiB against a peak under 1 MiB
    fig = _figure(plan)
    assert fig["ylabel"] == "KiB per rank"
    assert f"memory budget {autoshard.core.plans.fmt_bytes(plan.memory_budget)} (above the plot)" \
        in fig["lines"]
    assert fig["ylim"][1] < 2 * plan.predicted["peak_bytes"] / 2**10


def test_one_unit_is_one_unit():
    with torch.device("meta"):
        plan = autoshard.plan(GPT(), (TOKENS,), world_size=2,
                              config=autoshard.Config(policy="whole-model"))
    assert _figure(plan)["title"].endswith("world size 2, 1 unit")


def test_shorten_keeps_the_end_of_a_path_its_unit_index_and_backward():
    assert _shorten("model.layers.0.self_attn.q_proj (backward)", 30) == \
        "...self_attn.q_proj (backward)"
    assert _shorten("3:model.layers.0.mlp.up_proj", 16) == "3:...mlp.up_proj"
    assert _shorten("wte..blocks.0.fc", 12) == "wte.."
    assert _shorten("short", 5) == "short"


def test_fit_narrows_the_widest_column_first_and_wraps_text():
    rows = [["a" * 60, "b.c." * 20, "word " * 20]]
    text = _fit(rows, ["x", "path", "note"], shorten={1}, wrap={2}, width=100)
    assert max(map(len, text.splitlines())) <= 100
    assert "a" * 60 in text and "...c.b.c" in text and text.count("word") == 20
