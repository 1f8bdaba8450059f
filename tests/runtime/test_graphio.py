"""Graph files (``runtime/graphio.py``): a traced function and autoshard's own graphs survive
JSON and ``torch.load(weights_only=True)`` with names, targets, arguments, tags and fake
values intact, and run to bitwise-equal results."""

import io
import json
import math
import operator
import re
import shutil
import warnings

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import models
import autoshard
from autoshard.compiler import compile_step
from autoshard.core.config import Config
from autoshard.core.errors import AutoshardError
from autoshard.core.graph import aliased_arg
from autoshard.core.models import GPT
from autoshard.runtime import commit
from autoshard.runtime import export as export_mod
from autoshard.runtime import graphio


def roundtrip(gm, **kw):
    """``gm`` through a JSON string and a ``torch.save`` file, then loaded."""
    doc, constants = graphio.dump_graph(gm)
    buf = io.BytesIO()
    torch.save(constants, buf)
    buf.seek(0)
    return graphio.load_graph(json.loads(json.dumps(doc)),
                              torch.load(buf, weights_only=True), **kw)


def names(args):
    return fx.node.map_arg(args, lambda n: n.name)


def c10d_group_index(n):
    if getattr(n.target, "namespace", None) != "_c10d_functional":
        return None
    schema = [a.name for a in n.target._schema.arguments]
    return schema.index("group_name") if "group_name" in schema else None


def assert_same_structure(a, b, group=None):
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    assert [n.name for n in na] == [n.name for n in nb]
    for x, y in zip(na, nb):
        assert (x.op, x.target) == (y.op, y.target), x.name
        xa, xk = names(x.args), names(x.kwargs)
        if group is not None and c10d_group_index(x) is not None:
            i = c10d_group_index(x)
            assert y.args[i] == group and xa[i] != group
            xa = xa[:i] + (group,) + xa[i + 1:]
        assert (xa, xk) == (names(y.args), names(y.kwargs)), x.name
        assert (json.loads(json.dumps(x.meta.get("autoshard")))
                == y.meta.get("autoshard")), x.name


def storage_classes(gm):
    """Each node with a tensor value -> the first node whose value shares its storage."""
    first, out = {}, {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out[n.name] = first.setdefault(v.untyped_storage()._cdata, n.name)
    return out


def assert_same_vals(a, b):
    for x, y in zip(a.graph.nodes, b.graph.nodes):
        if "val" not in x.meta:
            continue
        vx, vy = x.meta["val"], y.meta["val"]
        if isinstance(vx, torch.Tensor):
            assert (vx.shape, vx.dtype, vx.stride()) == (vy.shape, vy.dtype, vy.stride()), x.name
        elif isinstance(vx, (list, tuple)):
            assert len(vx) == len(vy), x.name
            for p, q in zip(vx, vy):
                assert (getattr(p, "shape", p), getattr(p, "dtype", None)) == (
                    getattr(q, "shape", q), getattr(q, "dtype", None)), x.name
        else:
            assert vx == vy, x.name
    # placeholders share storages as recorded; every aten view shares its base's (the
    # original's values can be stale there: a pass that rewires a view keeps its old value;
    # the c10d ops' fake kernels return fresh tensors, in both)
    phs = {n.name for n in a.graph.nodes if n.op == "placeholder"}
    sa, sb = storage_classes(a), storage_classes(b)
    assert {k: v for k, v in sa.items() if k in phs} == {k: v for k, v in sb.items() if k in phs}
    views = 0
    for n in b.graph.nodes:
        base = aliased_arg(n) if getattr(n.target, "namespace", None) == "aten" else None
        if n.name in sb and base is not None and base.name in sb:
            assert sb[n.name] == sb[base.name], n.name
            views += 1
    assert views


def real_inputs(gm):
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta["val"]
        if v.dtype.is_floating_point:
            out.append(torch.randn(v.shape, generator=gen).to(v.dtype))
        elif v.dtype == torch.bool:
            out.append(torch.randint(0, 2, v.shape, generator=gen).bool())
        else:
            out.append(torch.randint(0, 16, v.shape, generator=gen).to(v.dtype))
    return out


def assert_bitwise(a, b):
    """Equal bit for bit (NaNs and signed zeros included)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride())
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        else:
            assert x == y


# --- a traced function -----------------------------------------------------------------------


def fn(x, m):
    t = x.view(2, 3, 2, 2).transpose(1, 2)
    v, i = torch.max(x, 1)
    c = torch.tensor([1.5, -2.0, 3.25])
    z = torch.zeros(3, dtype=torch.float64, device=x.device, layout=torch.strided)
    y = x.reshape(1, 2, 3, 4).contiguous(memory_format=torch.channels_last)
    w = x.masked_fill(m, float("-inf"))
    return t.sum(), v + c[:1], i, z + 1, y, w.softmax(-1), x[:, 1:3] * 2


def traced():
    x, m = torch.randn(6, 4), torch.rand(6, 4) > 0.5
    return make_fx(fn, tracing_mode="fake")(x, m), (x, m)


def test_traced_function_round_trips_and_runs_bitwise_equal():
    gm, inputs = traced()
    doc, constants = graphio.dump_graph(gm)
    text = json.dumps(doc, allow_nan=False)  # standard JSON: no bare Infinity or NaN
    assert list(constants) == ["_tensor_constant0"]
    assert {"float": "-inf"} in json.loads(text)["nodes"][
        [n.name for n in gm.graph.nodes].index("masked_fill")]["args"]
    loaded = roundtrip(gm)
    assert_same_structure(gm, loaded)
    assert_same_vals(gm, loaded)
    targets = {n.target for n in loaded.graph.nodes}
    assert operator.getitem in targets and torch.ops.aten.max.dim in targets
    zeros = next(n for n in loaded.graph.nodes if n.name == "zeros")
    assert zeros.kwargs["dtype"] is torch.float64 and zeros.kwargs["layout"] is torch.strided
    assert zeros.kwargs["device"] == torch.device("cpu")
    clone = next(n for n in loaded.graph.nodes if n.target is torch.ops.aten.clone.default)
    assert clone.kwargs["memory_format"] is torch.channels_last
    assert_bitwise(gm(*inputs), loaded(*inputs))


def test_values_of_every_kind_round_trip():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 5)
    k = g.placeholder("k")
    k.meta["val"] = 3
    odd = (slice(None, 2), Ellipsis, None)
    y = g.call_function(operator.getitem, (x, odd))
    y.meta["autoshard"] = {"unit": 1, "path": ("a", 2), "w": 0.5, "on": True, "d": {"e": [1]}}
    vals = [float("inf"), float("-inf"), float("nan"), 1.0, -0.0, 2 ** 62, "s", None]
    z = g.call_function(operator.add, (y, k))
    g.output(({"y": y, "z": z}, [z], vals, torch.int64, torch.sparse_coo,
              torch.preserve_format, torch.device("cpu")))
    gm = fx.GraphModule({}, g)
    loaded = roundtrip(gm)
    out = loaded.graph.output_node().args[0]
    assert names(out[:2]) == ({"y": "getitem", "z": "add"}, ["add"])
    assert [type(v) for v in out[2]] == [type(v) for v in vals]
    assert out[2][:2] == vals[:2] and math.isnan(out[2][2]) and out[2][3:] == vals[3:]
    assert math.copysign(1, out[2][4]) == -1
    assert out[3:] == (torch.int64, torch.sparse_coo, torch.preserve_format,
                       torch.device("cpu"))
    get = next(n for n in loaded.graph.nodes if n.name == "getitem")
    assert get.args[1] == odd
    assert get.meta["autoshard"] == {"unit": 1, "path": ["a", 2], "w": 0.5, "on": True,
                                     "d": {"e": [1]}}
    assert get.meta["val"].shape == (2, 5, 1)
    assert next(iter(loaded.graph.nodes)).next.meta["val"] == 3
    t = torch.randn(4, 5)
    assert torch.equal(loaded(t, 3)[0]["z"], gm(t, 3)[0]["z"])


def test_placeholders_keep_strides_offsets_shared_storages_and_requires_grad():
    base = torch.empty(6, 4)
    vals = {"a": base[1:].t(), "b": base[:2], "c": torch.empty(3, requires_grad=True)}
    g = fx.Graph()
    phs = {k: g.placeholder(k) for k in vals}
    for k, v in vals.items():
        phs[k].meta["val"] = v
    g.output(tuple(phs.values()))
    loaded = {n.name: n.meta["val"] for n in roundtrip(fx.GraphModule({}, g)).graph.nodes
              if n.op == "placeholder"}
    for k, v in vals.items():
        w = loaded[k]
        assert (w.shape, w.stride(), w.storage_offset(), w.requires_grad) == (
            v.shape, v.stride(), v.storage_offset(), v.requires_grad)
    storage = {k: v.untyped_storage()._cdata for k, v in loaded.items()}
    assert storage["a"] == storage["b"] != storage["c"]


# --- autoshard's own graphs ------------------------------------------------------------------


@pytest.fixture(scope="module", params=["gpt", "hf_mixtral", "hf_llama"])
def compiled(request):
    name = request.param
    model = models.build(name)
    x, _ = models.CASES[name][1](torch.Generator().manual_seed(0), 2)
    inputs = models.CASES[name][2](x)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    cap, ctx, _ = compile_step(model, type(model).forward, args, kwargs, world_size=2,
                               group_name="plan", device=torch.device("cpu"), config=Config())
    return name, cap, ctx


def test_joint_graph_round_trips_and_runs_bitwise_equal(compiled):
    _, cap, _ = compiled
    loaded = roundtrip(cap.pristine)
    assert_same_structure(cap.pristine, loaded)
    assert_same_vals(cap.pristine, loaded)
    inputs = real_inputs(cap.pristine)
    torch.manual_seed(0)
    expect = cap.pristine(*inputs)
    torch.manual_seed(0)
    assert_bitwise(expect, loaded(*inputs))


def test_sharded_graphs_round_trip_onto_another_group(compiled):
    name, _, ctx = compiled
    seen = set()
    for gm in (ctx.split.fwd, ctx.split.bwd):
        loaded = roundtrip(gm, group_name="other")
        assert_same_structure(gm, loaded, group="other")
        assert_same_vals(gm, loaded)
        seen |= {str(n.target) for n in loaded.graph.nodes if n.op == "call_function"}
    assert {"_c10d_functional.all_gather_into_tensor_out.default",
            "_c10d_functional.reduce_scatter_tensor.default",
            "autoshard.free.default"} <= seen
    if name == "hf_mixtral":
        assert "autoshard.grouped_mm.default" in seen


# --- errors and devices ----------------------------------------------------------------------


def plain_function(x):
    return x + 1


def placeholder(g, name, val):
    n = g.placeholder(name)
    n.meta["val"] = val
    return n


def test_python_functions_and_tensor_arguments_cannot_be_dumped():
    g = fx.Graph()
    g.output(g.call_function(plain_function, (placeholder(g, "x", torch.ones(1)),)))
    with pytest.raises(ValueError, match="node plain_function.*cannot be exported"):
        graphio.dump_graph(fx.GraphModule({}, g))
    g = fx.Graph()
    g.output(g.call_function(torch.ops.aten.add.Tensor,
                             (placeholder(g, "x", torch.ones(1)), torch.ones(1))))
    with pytest.raises(ValueError, match="node add_tensor: .*type Tensor cannot be exported"):
        graphio.dump_graph(fx.GraphModule({}, g))
    g = fx.Graph()
    g.output(g.placeholder("x"))
    with pytest.raises(ValueError, match=r"node x: a placeholder without meta\['val'\]"):
        graphio.dump_graph(fx.GraphModule({}, g))


def test_wrong_version_and_unknown_ops_are_refused():
    gm, _ = traced()
    doc, constants = graphio.dump_graph(gm)
    with pytest.raises(AutoshardError, match="version 99.*reads version 1"):
        graphio.load_graph({**doc, "version": 99}, constants)
    doc = json.loads(json.dumps(doc))
    next(d for d in doc["nodes"] if d["op"] == "call_function")["target"] = "aten::nosuch.default"
    with pytest.raises(AutoshardError, match="aten::nosuch.default is not registered"):
        graphio.load_graph(doc, constants)
    for target in ("builtins.eval", "operator.attrgetter", "operator.call", "aten::mm.__call__"):
        next(d for d in doc["nodes"] if d["op"] == "call_function")["target"] = target
        with pytest.raises(AutoshardError, match=re.escape(target)):
            graphio.load_graph(doc, constants)


def test_device_mapping():
    gm, _ = traced()
    loaded = roundtrip(gm, device=torch.device("meta"))
    zeros = next(n for n in loaded.graph.nodes if n.name == "zeros")
    assert zeros.kwargs["device"] == torch.device("meta")
    assert zeros.meta["val"].device == torch.device("meta")
    for n in loaded.graph.nodes:
        if n.op == "placeholder":
            assert n.meta["val"].device == torch.device("meta")
    assert loaded._tensor_constant0.device == torch.device("meta")


# --- what a graph file may hold -------------------------------------------------------------


def neg_chain(n):
    """A graph document of one placeholder and ``n`` aten::neg nodes, each of the one before."""
    g = fx.Graph()
    x = placeholder(g, "x", torch.empty(3))
    for _ in range(n):
        x = g.call_function(torch.ops.aten.neg.default, (x,))
    g.output(x)
    return json.loads(json.dumps(graphio.dump_graph(fx.GraphModule({}, g))[0]))


def with_node(doc, node):
    """``doc`` with ``node`` added before its output."""
    doc = json.loads(json.dumps(doc))
    doc["nodes"].insert(len(doc["nodes"]) - 1, {"kwargs": {}, "meta": {}, **node})
    return doc


@pytest.mark.parametrize("target, why", [
    ("aten::from_file.default", "it reads or writes files"),
    ("aten::save.default", "it takes a string and no tensor"),
    ("aten::manual_seed.default", "it reads or sets the random generators' state"),
    ("aten::seed.default", "it reads or sets the random generators' state"),
    ("aten::set_.source_Storage", "its argument source is a Storage"),
    ("aten::set.source_Storage_storage_offset", "its argument source is a Storage"),
    ("aten::record_stream.default", "its argument s is a Stream"),
    ("aten::set_grad_enabled.default", "it returns nothing and writes no tensor"),
    ("aten::_cufft_set_plan_cache_max_size.default", "it returns nothing and writes no tensor"),
])
def test_ops_that_reach_outside_the_graph_are_refused_naming_node_and_op(target, why, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    doc = with_node(neg_chain(1), {"name": "evil", "op": "call_function", "target": target,
                                   "args": [str(victim)], "kwargs": {"shared": True, "size": 8}})
    with pytest.raises(AutoshardError, match=rf"^node evil: op {re.escape(target)} is "
                       rf"refused: {re.escape(why)}.*export again"):
        graphio.load_graph(doc, {})
    assert victim.read_bytes() == b"precious"


def test_compute_checks_and_prints_are_admitted():
    aten = torch.ops.aten
    for op in (aten._local_scalar_dense.default, aten._assert_async.msg, aten._print.default,
               aten._assert_scalar.default, aten.sym_constrain_range.default,
               aten.bernoulli_.float, aten.native_dropout.default, aten.copy_.default,
               aten.set_.source_Tensor, aten.rand.generator, aten.embedding.default,
               torch.ops.autoshard.free.default, torch.ops.autoshard.chunk.default,
               torch.ops._c10d_functional.all_gather_into_tensor_out.default):
        assert graphio._refusal(op) is None, op


def test_a_placeholder_without_its_val_is_refused():
    doc = neg_chain(2)
    del doc["nodes"][0]["val"]
    with pytest.raises(AutoshardError, match=r"^node x: placeholder without a 'val'"):
        graphio.load_graph(doc, {})
    doc = neg_chain(2)
    doc["nodes"][0]["val"]["shape"] = [-1]
    with pytest.raises(AutoshardError, match=r"node x: its 'val' has no shape"):
        graphio.load_graph(doc, {})


@torch.library.custom_op("graphio_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


twice.register_fake(lambda x: torch.empty_like(x))


def test_an_op_of_another_namespace_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(graphio, "ALLOWED_NAMESPACES", set())
    g = fx.Graph()
    g.output(g.call_function(torch.ops.graphio_test.twice.default,
                             (placeholder(g, "x", torch.empty(3)),)))
    doc, constants = graphio.dump_graph(fx.GraphModule({}, g))
    with pytest.raises(AutoshardError, match=r"node twice_default: op graphio_test::twice\."
                       r"default is refused: .*custom ops run any code.*allow_namespace\("
                       r"'graphio_test'\)"):
        graphio.load_graph(doc, constants)
    graphio.allow_namespace("graphio_test")
    assert torch.equal(graphio.load_graph(doc, constants)(torch.ones(3)), torch.full((3,), 2.0))


def test_a_graph_of_more_nodes_than_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(graphio, "MAX_NODES", 50)
    x = torch.randn(3)
    assert torch.equal(graphio.load_graph(neg_chain(48), {})(x), x)
    with pytest.raises(AutoshardError, match=r"^g\.json: the graph holds 52 nodes, more than "
                       r"graphio\.MAX_NODES \(50\).*raise autoshard\.runtime\.graphio\.MAX_NODES"):
        graphio.load_graph(neg_chain(50), {}, source="g.json")


def nested(depth, leaf):
    for _ in range(depth):
        leaf = {"tuple": [leaf]}
    return leaf


def test_a_value_nested_5000_deep_is_refused_without_recursing():
    doc = with_node(neg_chain(1), {"name": "deep", "op": "call_function",
                                   "target": "operator.getitem",
                                   "args": [nested(5000, 0), 0]})
    with pytest.raises(AutoshardError, match=r"^node deep: a value nests deeper than "
                       r"graphio\.MAX_DEPTH \(64\).*raise autoshard\.runtime\.graphio\.MAX_DEPTH"):
        graphio.load_graph(doc, {})
    doc = neg_chain(1)
    doc["nodes"][1]["meta"]["autoshard"] = {"a": nested(5000, 0)}
    with pytest.raises(AutoshardError, match=r"node neg_default: a value nests deeper"):
        graphio.load_graph(doc, {})
    ok = with_node(neg_chain(1), {"name": "shallow", "op": "call_function",
                                  "target": "operator.getitem", "args": [nested(60, 7), 0]})
    shallow = next(n for n in graphio.load_graph(ok, {}).graph.nodes if n.name == "shallow")
    assert shallow.args[0] == nested_tuple(60, 7) and shallow.meta["val"] == nested_tuple(59, 7)


def nested_tuple(depth, leaf):
    for _ in range(depth):
        leaf = (leaf,)
    return leaf


def test_names_fx_writes_into_python_source_are_refused_unless_identifiers(tmp_path):
    """fx generates Python source from a graph and runs it: a placeholder's target, a
    get_attr's target and a keyword's name are written into it as they are."""
    marker = tmp_path / "ran"
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    doc = neg_chain(1)
    doc["nodes"][0]["target"] = f"x={code}"
    with pytest.raises(AutoshardError, match=r"node x: placeholder target .* is not a Python "
                       "identifier"):
        graphio.load_graph(doc, {})
    doc = neg_chain(1)
    doc["nodes"][1]["kwargs"] = {f"y={code}, z": 1}
    with pytest.raises(AutoshardError, match=r"node neg_default: a keyword argument's name"):
        graphio.load_graph(doc, {})
    doc = with_node(neg_chain(1), {"name": "c", "op": "get_attr", "args": [],
                                   "target": f'c") or {code} or getattr(self, "c'})
    with pytest.raises(AutoshardError, match=r"node c: get_attr target .* is not a Python "
                       "identifier"):
        graphio.load_graph(doc, {f'c") or {code} or getattr(self, "c': torch.ones(1)})
    assert not marker.exists()


# --- an export whose graph file was changed --------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A one-layer GPT exported at world size 1 (this process's one-rank group), and a batch."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        model = autoshard.autoshard(GPT(vocab=96, layers=1))
    x = torch.randint(0, 96, (2, 16))
    model(x)
    path = tmp_path_factory.mktemp("export") / "gpt"
    model.export(path, inference=False)
    return path, x


def tampered(src, dst, edit, text=lambda t: t, graph="forward"):
    """A copy of the export ``src`` at ``dst`` whose first program's ``graph`` ``edit`` changed
    (then ``text`` its JSON text), the manifest's SHA-256s and hash recomputed to match, as
    whoever changed it can."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    rel = f"{manifest['programs'][0]['dir']}/{graph}.json"
    doc = json.loads((dst / rel).read_text())
    edit(doc)
    (dst / rel).write_text(text(json.dumps(doc)))
    manifest["files"][rel] = commit.entries(str(dst), [rel])[rel]
    manifest["hash"] = export_mod._content_hash(manifest["files"])
    (dst / "manifest.json").write_text(json.dumps(manifest))
    export_mod.read_manifest(dst)  # whole and unchanged, as far as the manifest can tell
    return dst


def test_the_export_loads_and_runs(exported):
    path, x = exported
    assert autoshard.load(path)(x).shape == (2, 16, 96)


@pytest.mark.parametrize("strip_vals", [True, False], ids=["without vals", "with vals"])
def test_a_changed_export_that_would_write_a_file_is_refused(exported, tmp_path, strip_vals):
    """The graph maps a file outside the export and fills it: refused at the first call,
    which loads the program, and the file is untouched."""
    src, x = exported
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")

    def edit(doc):
        for d in doc["nodes"] if strip_vals else ():
            d.pop("val", None)  # skips the fake values' propagation on today's loader
        doc["nodes"][-1:-1] = [
            {"name": "evil", "op": "call_function", "target": "aten::from_file.default",
             "args": [str(victim)], "kwargs": {"shared": True, "size": 8,
                                               "dtype": {"dtype": "uint8"}}, "meta": {}},
            {"name": "fill", "op": "call_function", "target": "aten::fill_.Scalar",
             "args": [{"node": "evil"}, 65], "kwargs": {}, "meta": {}}]

    path = tampered(src, tmp_path / "export", edit)
    model = autoshard.load(path)
    why = (r"node arg0_1: placeholder without a 'val'" if strip_vals
           else r"node evil: op aten::from_file\.default is refused: it reads or writes files")
    with pytest.raises(AutoshardError, match=rf"forward\.json: {why}"):
        model(x)
    assert victim.read_bytes() == b"precious"


def test_a_changed_export_nesting_values_5000_deep_is_refused(exported, tmp_path):
    src, x = exported

    def edit(doc):
        doc["nodes"][-1:-1] = [{"name": "deep", "op": "call_function",
                                "target": "operator.getitem", "args": ["DEEP", 0],
                                "kwargs": {}, "meta": {}}]

    path = tampered(src, tmp_path / "export", edit, lambda t: t.replace(
        '"DEEP"', '{"tuple":[' * 5000 + "0" + "]}" * 5000))
    with pytest.raises(AutoshardError, match=r"forward\.json nests values too deeply"):
        autoshard.load(path)(x)


def test_a_changed_export_whose_joint_graph_misreads_a_parameter_is_refused(exported, tmp_path):
    """The fake values every node's are computed from are those of the model's parameters."""
    src, x = exported

    def edit(doc):  # arg1_1, the positions' embedding wpe.weight: float32[16, 32]
        assert doc["nodes"][1]["meta"]["autoshard"]["fqn"] == "wpe.weight"
        doc["nodes"][1]["val"]["shape"] = [17, 32]  # its 16 rows read as before

    path = tampered(src, tmp_path / "export", edit, graph="joint")
    with pytest.raises(AutoshardError, match=r"joint\.json: node arg1_1 reads the parameter "
                       r"wpe\.weight as float32\[17, 32\], but the model has float32\[16, 32\]"):
        autoshard.load(path)(x)
