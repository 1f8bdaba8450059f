"""Version shims: every use of a private or moving torch API goes through here."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import operator
import warnings

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as ckpt
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch._ops import OpOverload  # noqa: F401
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (meta-device init)

# pytree: flattening the calls' inputs and outputs (torch's own, private, module)
import torch.utils._pytree as pytree  # noqa: F401
from torch.utils._pytree import (  # noqa: F401
    keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_map, tree_map_only,
    tree_unflatten,
)

# a check inside a custom op's meta function, traced as a guard (``torch._check``)
torch_check = torch._check


# --- DTensor internals ----------------------------------------------------------------------


# C getters (mapped over a step's parameters): a DTensor's local shard itself (``to_local()``
# without autograd's view: the tensor the parameter holds, so that writes to it reach the
# parameter), and its layout (``DTensorSpec``: mesh, placements, global shape)
local_tensor = operator.attrgetter("_local_tensor")
dtensor_spec = operator.attrgetter("_spec")


def dtensor_like(dt, local: torch.Tensor):
    """A DTensor of ``local`` laid out as ``dt``, no autograd history (a gradient shard)."""
    return new_dtensor(local, dt._spec)


def new_dtensor(local: torch.Tensor, spec):
    """``DTensor(local, spec, requires_grad=False)`` without its ``__init__``, which does
    nothing but costs two wrappers' calls (half of the gradient hand-off's host time: a step
    makes one per parameter)."""
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def dtensor_here(local: torch.Tensor, mesh, placements, shape, stride):
    """A DTensor of ``local`` on ``mesh`` where ``local`` is: ``DTensor.from_local`` moves
    its tensor to the mesh's device type, so a shard kept in host memory (CPU offload) on a
    GPU mesh would land on the GPU again. FSDP2 builds its host shards this way too."""
    spec = DTensorSpec(mesh, tuple(placements),
                       TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return new_dtensor(local, spec)


def dtensor_op_handlers():
    """DTensor's table of op handlers (op -> ``handler(op, args, kwargs)``, called instead of
    its own rules; torch 2.11's C++ dispatch reads it too), or None where there is none."""
    table = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    return table if isinstance(table, dict) else None


# --- inductor, imported on first use (Config.compile) ----------------------------------------

_INDUCTOR = {"inductor_config": ("torch._inductor.config", None),
             "compile_fx": ("torch._inductor.compile_fx", "compile_fx"),
             "GraphLowering": ("torch._inductor.graph", "GraphLowering"),
             "StridedShard": ("torch.distributed.tensor.placement_types", "_StridedShard")}


def __getattr__(name: str):
    """``from autoshard.core._compat import compile_fx`` (and ``inductor_config``,
    ``GraphLowering``) imports inductor only then: it takes seconds to import."""
    if name not in _INDUCTOR:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _INDUCTOR[name]
    found = importlib.import_module(module)
    return found if attr is None else getattr(found, attr)


def current_trace_graph():
    """The fx graph make_fx is recording into right now."""
    return get_proxy_mode().tracer.graph


def preserve_node_meta():
    return fx_traceback.preserve_node_meta()


def current_meta() -> dict:
    return fx_traceback.current_meta


def link_backward_to_forward(roots) -> None:
    """Make backward nodes recorded by make_fx carry the seq_nr of the forward op they
    differentiate (as AOTAutograd does), by hooking the autograd graph under ``roots``."""
    try:
        from torch._functorch._aot_autograd.logging_utils import (
            setup_stacktrace_preservation_hooks,
        )
    except ImportError:  # pragma: no cover - older/newer torch: no mapping, capture still works
        return
    setup_stacktrace_preservation_hooks([r for r in roots if r is not None])


# ``torch.utils.checkpoint``'s implementations, which ``checkpoint()`` looks up in its module
# at call time: the reentrant autograd.Function, and the non-reentrant generator. 2.11-2.13
# call ``_checkpoint_without_reentrant_generator``; 2.14 calls
# ``_checkpoint_without_reentrant_generator_impl`` (args and kwargs as a tuple and a dict) and
# keeps the older name as a shim over it. Every name present is replaced, so either way a
# region runs as a plain call.
CHECKPOINT_REENTRANT = "CheckpointFunction"
CHECKPOINT_GENERATORS = ("_checkpoint_without_reentrant_generator_impl",
                         "_checkpoint_without_reentrant_generator")


def checkpoint_implementations() -> list:
    """The names in ``torch.utils.checkpoint`` that ``transparent_checkpoint`` replaces on
    this torch (the reentrant Function first, then each non-reentrant generator)."""
    return [n for n in (CHECKPOINT_REENTRANT, *CHECKPOINT_GENERATORS) if hasattr(ckpt, n)]


@contextlib.contextmanager
def transparent_checkpoint(enter, leave):
    """Run ``torch.utils.checkpoint`` regions (reentrant or not) as plain calls while this is
    active, calling ``enter()`` before and ``leave()`` after each region's forward.

    Capture traces a checkpointed region once; whether its values are recomputed in backward
    is then the recompute pass's decision (which the verifier checks), with the region as a
    hint. ``checkpoint()`` looks its implementations up in its module at call time, so this
    also covers partials of it (Hugging Face's gradient checkpointing) and
    ``checkpoint_wrapper``. On a torch that names no known implementation it warns: a model
    without checkpointing still captures, a checkpointed region would run torch's own."""
    names = checkpoint_implementations()
    if CHECKPOINT_REENTRANT not in names or len(names) < 2:
        warnings.warn(
            f"autoshard does not know torch {torch.__version__}'s torch.utils.checkpoint "
            f"(it has {names or 'none'} of {[CHECKPOINT_REENTRANT, *CHECKPOINT_GENERATORS]}): "
            "a checkpointed region would run torch's checkpoint inside the capture and fail. "
            "autoshard.core._compat.transparent_checkpoint needs this version's names.",
            RuntimeWarning, stacklevel=3)

    class _Region:
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            enter()
            try:
                return function(*args)
            finally:
                leave()

    def _region_generator(*args, **kwargs):
        # ``checkpoint()`` calls ``next()`` before the region's forward and again after it
        # (expecting StopIteration), and ``throw()`` if the forward raises.
        enter()
        try:
            yield
        finally:
            leave()

    replacement = {n: (_Region if n == CHECKPOINT_REENTRANT else _region_generator)
                   for n in names}
    saved = {n: getattr(ckpt, n) for n in names}
    for n, f in replacement.items():
        setattr(ckpt, n, f)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(ckpt, n, f)


def backward_keeps_graph() -> bool:
    """Inside an autograd.Function's backward: whether this backward call retains the graph
    (``retain_graph=True``), so saved tensors must survive it."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def engine_accumulates(node):
    """In a backward, whether the engine runs a leaf's AccumulateGrad ``node``: True, False
    (not asked for), None (autograd.grad asks for the leaf, and runs no AccumulateGrad)."""
    try:
        return None if node is None else torch._C._will_engine_execute_node(node)
    except RuntimeError:  # "... we are currently running autograd.grad()"
        return None


def functorch_active() -> bool:
    """Whether a torch.func transform (grad, vjp, jvp, vmap) runs around this call."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def autocast_state(device_type: str) -> tuple:
    """What ``torch.autocast`` does now to ops on ``device_type`` (the mesh's device) and on
    the CPU: capture records its casts, so a program is valid only under the state it was
    traced in. Named by role ("device", "host"), not by device type, so that a program
    exported on one device type is found again when loaded on another."""
    def one(t):
        on = torch.is_autocast_enabled(t)
        return on, torch.get_autocast_dtype(t) if on else None

    return ("device", *one(device_type)), ("host", *one("cpu"))


def legacy_autocast_states(state: tuple) -> list:
    """The forms ``autocast_state`` had before 0.3, for ``state`` (an export written
    then keyed its programs by them): by device type, ``(("cpu", on, dtype),)`` on a CPU and
    ``(("cuda", on, dtype), ("cpu", on, dtype))`` on a GPU."""
    (_, on, dtype), (_, host_on, host_dtype) = state
    return [(("cpu", host_on, host_dtype),),
            *[((t, on, dtype), ("cpu", host_on, host_dtype)) for t in ("cuda", "xpu")]]


def is_fake(x) -> bool:
    """Whether ``x`` (a tensor or a list of them) is a fake tensor being traced."""
    from torch._subclasses.fake_tensor import FakeTensor

    x = x[0] if isinstance(x, (list, tuple)) and x else x
    return isinstance(x, FakeTensor)


def register_dataclasses(tree) -> None:
    """Register the type of every dataclass in ``tree`` (through tuples, lists, dicts and
    fields) as a pytree node of its fields, as ``torch.export.register_dataclass`` does (in
    torch's process-wide table), unless registered already (transformers' ``ModelOutput``)."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        if type(tree) not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(type(tree))
        tree = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for x in tree:
            register_dataclasses(x)


def dcp_set_element(root: dict, path, value) -> None:
    """DCP's setter of a value at a flattened key's path in a nested state dict (what its
    default load planner uses for a value read as bytes)."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def python_vals(result, val):
    """``val`` (FakeTensorProp's ``meta["val"]`` of a node that returned ``result``) with the
    plain ints, floats and bools of ``result`` in it: torch before 2.13 records None for
    them, 2.13 the value."""
    got, spec = pytree.tree_flatten(result)
    had, had_spec = pytree.tree_flatten(val)
    if spec != had_spec:
        return val
    return pytree.tree_unflatten(
        [g if h is None and isinstance(g, (int, float, bool)) else h for g, h in zip(got, had)],
        spec)


def all_gather_tensor(out, inp, group=None) -> None:
    """``torch.distributed``'s all-gather into one tensor, under its current name
    (``all_gather_single``; ``all_gather_into_tensor`` before it, deprecated since)."""
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, inp, group=group)


def group_timeout_s(group, device_type: str):
    """How long a collective of ``group`` on ``device_type`` waits before it fails, in
    seconds: the timeout the group was created with, which its backend's options hold
    (private); None where torch does not say."""
    try:
        return group._get_backend(torch.device(device_type)).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def reparametrize(module, params_and_buffers):
    """Put ``params_and_buffers`` (canonical name -> tensor) in place of the module's tensors,
    under every name a tied tensor or a shared submodule has, and put the very same objects
    back afterwards. (torch's ``_reparametrize_module`` leaves the swapped tensors in a
    submodule reachable under two paths: it records the second path's "original" after the
    first path swapped it.) Names missing from the dict keep their tensors."""
    named = [*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False)]
    canonical = {}
    for name, t in named:
        canonical.setdefault(id(t), name)
    saved = [(m, dict(m._parameters), dict(m._buffers))
             for m in {id(m): m for m in module.modules()}.values()]
    try:
        for name, t in named:
            new = params_and_buffers.get(canonical[id(t)])
            if new is None:
                continue
            path, _, attr = name.rpartition(".")
            owner = module.get_submodule(path)
            slots = owner._parameters if attr in owner._parameters else owner._buffers
            slots[attr] = new
        yield
    finally:
        for m, params, buffers in saved:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)


def boxed(gm):
    """Make ``gm`` take one list argument that it clears, so each input is released right
    after its last use (AOTAutograd's boxed calling convention)."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


def allocation_events(prof) -> list:
    """(time ns, bytes) of every allocation (+) and release (-) a torch.profiler run with
    ``profile_memory=True`` saw, in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            out.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    return sorted(out)


# --- lazily compiled graph modules ------------------------------------------------------------


def graph_module(root, graph):
    """``fx.GraphModule(root, graph)`` that writes its Python code only when first called.
    Passes rewrite graphs of tens of thousands of nodes many times, and a plan never runs
    them: generating the code after each rewrite cost a third of planning a 96-layer model."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # older torch: code is generated on every recompile
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def capture_fake_mode():
    """The fake mode a step is traced in. It holds a ``ShapeEnv`` that lets a value read
    (``.item()``) stand as an unbacked symbol, so that a check on a tensor's value
    (``torch._check(t.item())``, ``torch._check_tensor_all(t)``, as transformers asserts an
    image-token count) traces as a runtime assert rather than failing; shapes stay static and
    ops whose output shape depends on values are still refused. What the trace does with such
    a symbol is reviewed after it (``value_reads``)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv(allow_scalar_outputs=True, allow_dynamic_output_shape_ops=False)
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=env, static_shapes=True)


@contextlib.contextmanager
def recording_value_checks(fake_mode, where):
    """Inside, every assert deferred to run time on a value read under ``fake_mode`` is
    appended to the yielded list as ``(expression, where())``: ``where`` names the model's
    source line that made it. Only this mode's ``ShapeEnv`` object is touched, and restored."""
    env, found = fake_mode.shape_env, []
    defer = env.guard_or_defer_runtime_assert

    def recording(orig_expr, msg, fx_node=None):
        found.append((orig_expr, where()))
        return defer(orig_expr, msg, fx_node=fx_node)

    env.guard_or_defer_runtime_assert = recording
    try:
        yield found
    finally:
        del env.guard_or_defer_runtime_assert


def value_read(v):
    """``(symbol, expression)`` of a traced value read (``.item()`` under
    ``capture_fake_mode``): the unbacked symbol it introduced and the expression the value
    is (a boolean read is ``Eq(u0, 1)`` of an integer ``u0``); None when ``v`` is not one."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not isinstance(v, (torch.SymBool, torch.SymInt, torch.SymFloat)):
        return None
    # the expression as made: ``node.expr`` is it with what the ShapeEnv learnt since
    # substituted (``True`` once asserted)
    expr = getattr(v.node, "_expr", v.node.expr)
    symbols = free_unbacked_symbols(expr)
    return (next(iter(symbols)), expr) if len(symbols) == 1 else None


def asserts_true(expr, read) -> bool:
    """Whether the deferred assert ``expr`` says exactly that the boolean value read
    ``read`` (``value_read``) holds."""
    import sympy

    symbol, value = read
    return expr in (value, symbol) or (isinstance(expr, sympy.Eq)
                                       and set(expr.args) == {symbol, sympy.Integer(1)})


def fake_like(v):
    """A new fake tensor with ``v``'s shape, strides, dtype, device and requires_grad (see
    ``fake_empty``)."""
    out = fake_empty(v.fake_mode, v.shape, v.dtype, v.device, v.stride())
    return out.requires_grad_(v.requires_grad) if v.requires_grad else out


def fake_empty(fake_mode, shape, dtype, device, stride=None):
    """A new fake tensor of ``fake_mode`` (contiguous unless ``stride`` is given), built
    directly: seven times faster than ``torch.empty_strided`` under the fake mode."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    if stride is None:
        stride = torch.empty(shape, device="meta").stride()
    try:
        return FakeTensor(fake_mode, torch.empty_strided(shape, stride, dtype=dtype,
                                                         device="meta"), device)
    except TypeError:  # pragma: no cover - another torch's constructor
        with fake_mode:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def fake_run(fake_mode, func, args, kwargs):
    """``func(*args, **kwargs)`` on fake tensors of ``fake_mode``, run by the op's meta kernel
    directly and its tensors made fake on their arguments' device, as the fake mode does for
    an op with no rule of its own: a fifth of the cost for the view and copy ops that pack and
    unpack collective buffers, most of it the fake mode's caching and argument checks. Returns
    None (the caller dispatches as usual) when unsure: an argument that is not a fake tensor
    of this mode, tensors on several devices or none, a device given, a symbolic size, an op
    the fake mode has a rule for (constructors, data-dependent outputs; its rules for views
    serve symbolic sizes), or an error."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

        ruled = _has_fake_rule(func)
    except (ImportError, AttributeError):  # pragma: no cover - another torch's internals
        return None
    if ruled or "device" in kwargs:  # the fake mode moves it
        return None
    leaves = tree_leaves((args, kwargs))
    tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
    if (not tensors or len({t.fake_device for t in tensors if isinstance(t, FakeTensor)}) != 1
            or any(not isinstance(t, FakeTensor) or t.fake_mode is not fake_mode
                   or t._has_symbolic_sizes_strides for t in tensors)
            or any(isinstance(a, torch.SymInt) for a in leaves)):
        return None
    try:
        with in_kernel_invocation_manager(fake_mode):
            out = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the fake mode's own dispatch decides
        return None
    device = tensors[0].fake_device
    return tree_map(lambda o: FakeTensor(fake_mode, o, device)
                    if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) else o, out)


def _has_fake_rule(func) -> bool:
    """Whether the fake mode computes ``func`` its own way, or it returns something other
    than tensors (``prim.device`` in a kernel would say meta)."""
    import torch
    from torch._subclasses import fake_impls

    if func not in _FAKE_RULES:
        tensors = (torch._C.TensorType.get(), torch._C.ListType.ofTensors())
        _FAKE_RULES[func] = (
            not func._schema.returns
            or any(r.type not in tensors for r in func._schema.returns)
            or str(func) not in _STATIC_VIEWS and any(
                check(func) for check, _ in fake_impls.op_implementations_checks))
    return _FAKE_RULES[func]


_FAKE_RULES: dict = {}
_STATIC_VIEWS = {f"aten.{n}" for n in ("view.default", "_unsafe_view.default", "slice.Tensor",
                                       "select.int")}


def node_copy(graph, node, arg_transform, meta=None):
    """``graph.node_copy(node, arg_transform)``, its ``meta`` set to ``meta`` (default: a
    shallow copy of ``node.meta``), at a third of the cost. torch 2.13 walks every argument
    with pytree on each node created (looking for raw symbolic values: autoshard's graphs
    hold static shapes), and every attribute set on a node re-files it in the graph's lookup
    table by (op, target), which neither arguments nor meta change: the planner spent half
    its time at GPT-175B in these. So the node is created bare and given its arguments and
    meta directly."""
    from torch.fx.node import map_arg

    args = map_arg(node.args, arg_transform)
    kwargs = map_arg(node.kwargs, arg_transform)
    new = graph.create_node(node.op, node.target, (), {}, node.name, node.type)
    if args or kwargs:
        new._update_args_kwargs(args, kwargs)
    object.__setattr__(new, "meta", copy.copy(node.meta) if meta is None else meta)
    return new


def new_node(graph, target, args, kwargs, name=None):
    """``graph.call_function(target, args, kwargs)`` without the per-node argument scan (see
    ``node_copy``)."""
    new = graph.create_node("call_function", target, (), {}, name)
    if args or kwargs:
        new._update_args_kwargs(args, kwargs)
    return new


def set_versions(tensors, versions) -> None:
    """Set the tensors' version counters (``t._version``): a meta-device model's counters say
    how often its constructor wrote each tensor, and materialising it writes through them."""
    torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


def meta_skipping_inits() -> list:
    """The ``torch.nn.init`` functions that return without writing on the meta device (torch
    2.13: trunc_normal_, orthogonal_, dirac_, sparse_), as (module, attribute to wrap, public
    name, whether it draws random numbers). ``deferred_init()`` records each call whole, since
    the ops it runs on a device are never dispatched on the meta device (trunc_normal_'s
    rejection loop also depends on the values it draws). trunc_normal_ is reached through its
    private body, so a function imported with ``from torch.nn.init import trunc_normal_``
    is recorded too; where that body is gone the public function is wrapped instead."""
    import torch.nn.init as init

    body = "_no_grad_trunc_normal_" if callable(getattr(init, "_no_grad_trunc_normal_", None)) \
        else "trunc_normal_"
    table = ((body, "trunc_normal_", True), ("orthogonal_", "orthogonal_", True),
             ("dirac_", "dirac_", False), ("sparse_", "sparse_", True))
    return [(init, attr, f"torch.nn.init.{public}", random) for attr, public, random in table
            if callable(getattr(init, attr, None))]


def group_alive(group) -> bool:
    """Whether ``group`` is a process group not destroyed yet."""
    from torch.distributed import distributed_c10d

    return group in distributed_c10d._world.pg_map


def group_rank(name: str) -> int:
    """This rank's position in the process group named ``name`` (the names the c10d
    functional collectives take)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(name).rank()


def drop_destroyed_groups(mesh) -> None:
    """Let a DeviceMesh drop its references to the process groups destroyed since it was made
    (it keeps each of its groups for torch.compile, in ``_pg_registry``), so that a destroyed
    group is freed, and its worker threads joined, while the mesh lives on."""
    for m in (mesh, getattr(mesh, "_root_mesh", None)):  # a submesh's groups: in its root's
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            for name, group in list(registry.items()):
                if not group_alive(group):
                    del registry[name]


def forget_dtensor_meshes() -> None:
    """Empty the caches in which DTensor keeps what it derived from a mesh: its sharding
    propagation's (Python's and the C++ fast path's) and its redistribution planners. They
    compare meshes by value (ranks, shape, dimension names; not their process groups), so
    once the default group was destroyed and initialised again, an entry made before hands
    a new mesh's tensors the earlier mesh, equal to it, whose groups are gone: a collective
    on them fails ("Could not resolve the process group registered under the name ...")."""
    from torch.distributed.tensor import _redistribute

    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # pragma: no cover - another torch: the Python cache alone
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    else:
        _clear_sharding_prop_cache()
    planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if planners is not None:
        planners()
    transforms = getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear",
                         None)
    if transforms is not None:
        transforms()


def collectives_in_flight() -> int:
    """How many functional collectives (the compiled steps' all-gathers and reduce-scatters)
    were issued and not waited for yet: a step an error interrupted leaves its own."""
    from torch._C import _distributed_c10d

    size = getattr(_distributed_c10d, "_get_work_registry_size", None)
    return size() if size is not None else 0
