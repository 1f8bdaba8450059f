"""Graph ops autoshard adds to torch: ``autoshard::free``, ``autoshard::pack``,
``autoshard::chunk`` and ``autoshard::grouped_mm``.

``free`` releases the storage of its tensors at once (``untyped_storage().resize_(0)``), the
way FSDP frees unsharded parameters, so memory savings never wait on reference counts. It is
a registered op (not a Python callable) so graphs holding it stay serialisable and passes see
it as side-effecting.

``grouped_mm`` is ``aten._grouped_mm`` with a fake kernel for every floating dtype (see its
section below). Loading a graph that holds these ops needs this module imported first.
"""

from __future__ import annotations

import torch

from autoshard.core._compat import group_rank, torch_check

_lib = torch.library.Library("autoshard", "DEF")
_lib.define("free(Tensor(a!)[] tensors) -> ()")


def _free_impl(tensors):
    for t in tensors:
        t.untyped_storage().resize_(0)


def _free_fake(tensors):
    return None


_lib.impl("free", _free_impl, "CompositeExplicitAutograd")
torch.library.register_fake("autoshard::free", _free_fake, lib=_lib)

free_op = torch.ops.autoshard.free.default


# --- autoshard::pack ----------------------------------------------------------------------
#
# ``torch.cat``, as one opaque call. Compiled graphs (``Config(compile=True)``)
# concatenate a unit's gradients for its reduce-scatter with it: inductor lowers ``aten.cat``
# on CPU by allocating the output first and making each input's producer write into its slice,
# so the whole flat buffer would be held from the first gradient of the backward to the last;
# as this op it is allocated when the gradients are all there, as in the fx graphs.

_lib.define("pack(Tensor[] tensors, int dim=0) -> Tensor")


def _pack_impl(tensors, dim=0):
    return torch.cat(tensors, dim)


_lib.impl("pack", _pack_impl, "CompositeExplicitAutograd")
torch.library.register_fake("autoshard::pack", _pack_impl, lib=_lib)

pack_op = torch.ops.autoshard.pack.default


# --- autoshard::chunk ----------------------------------------------------------------------
#
# hpZ (``Config.reshard_after_forward=k``): this rank's 1/k of a unit's gathered buffer, the
# chunk of its position in its group of k ranks, copied out so the buffer can be freed after
# the forward; the backward all-gathers the chunks within the group. The position is the
# rank's in the process group named ``group``, looked up when the op runs, so the graph is
# the same on every rank.

_lib.define("chunk(Tensor buf, int k, str group) -> Tensor")


def _chunk_impl(buf, k, group):
    return buf.view(k, -1)[group_rank(group)].clone()


def _chunk_fake(buf, k, group):
    return buf.new_empty((buf.numel() // k,))


_lib.impl("chunk", _chunk_impl, "CompositeExplicitAutograd")
torch.library.register_fake("autoshard::chunk", _chunk_fake, lib=_lib)

chunk_op = torch.ops.autoshard.chunk.default


# --- autoshard::grouped_mm -----------------------------------------------------------------
#
# ``aten._grouped_mm`` (the grouped GEMM of mixture-of-experts layers) runs in fp32, fp16 and
# bf16 in eager, but its fake (meta) kernel accepts bf16 only, so a model that calls it cannot
# be traced over fake tensors in fp32. Capture maps it to this op (see
# ``capture_decompositions`` below): the same schema and the same real kernel, with
# a fake kernel that infers the output for any floating dtype. Only the traced graph holds it,
# below autograd (autograd's formula for ``_grouped_mm`` calls ``_grouped_mm`` again, and that
# call is mapped too), so it needs no autograd formula of its own.

_lib.define(
    "grouped_mm(Tensor self, Tensor mat2, Tensor? offs=None, Tensor? bias=None, "
    "ScalarType? out_dtype=None) -> Tensor"
)


def _grouped_mm_impl(self, mat2, offs=None, bias=None, out_dtype=None):
    return torch.ops.aten._grouped_mm.default(self, mat2, offs, bias, out_dtype)


def _check_grouped_strides(name: str, t: torch.Tensor) -> None:
    """The layout the eager kernels require: one of the last two dimensions contiguous and
    the other's stride a multiple of 16 bytes."""
    align = 16 // t.element_size()
    s0, s1 = t.stride()[-2:]
    n0, n1 = t.shape[-2:]
    if s0 == 1 and s1 >= max(1, n0):
        ok = s1 % align == 0
    elif s1 == 1 and s0 >= max(1, n1):
        ok = s0 % align == 0
    else:
        ok = False
    torch_check(ok, lambda: f"grouped_mm: {name} needs one of its last two dimensions "
                f"contiguous and the other's stride a multiple of 16 bytes; got strides "
                f"{tuple(t.stride())} for sizes {tuple(t.shape)}")


def _grouped_mm_fake(self, mat2, offs=None, bias=None, out_dtype=None):
    a, b = self, mat2
    torch_check(a.dtype == b.dtype and a.is_floating_point(),
                lambda: f"grouped_mm: operands must share a floating dtype, got {a.dtype} "
                f"and {b.dtype}")
    torch_check(a.dim() in (2, 3) and b.dim() in (2, 3),
                lambda: f"grouped_mm: operands must be 2-D or 3-D, got {a.dim()}-D and "
                f"{b.dim()}-D")
    torch_check(bias is None, lambda: "grouped_mm: bias is not supported")
    torch_check(a.shape[-1] == b.shape[-2] if (a.dim(), b.dim()) != (2, 2)
                else a.shape[1] == b.shape[0],
                lambda: "grouped_mm: contraction dimensions of the operands differ")
    _check_grouped_strides("self", a)
    _check_grouped_strides("mat2", b)
    if a.dim() == 3 and b.dim() == 3:
        torch_check(offs is None, lambda: "grouped_mm: 3-D x 3-D takes no offsets")
        torch_check(a.shape[0] == b.shape[0], lambda: "grouped_mm: batch sizes differ")
        shape = (a.shape[0], a.shape[1], b.shape[2])
    else:
        torch_check(offs is not None and offs.dim() == 1 and offs.dtype == torch.int32,
                    lambda: "grouped_mm: 2-D operands need 1-D int32 offsets")
        if a.dim() == 2 and b.dim() == 2:
            shape = (offs.shape[0], a.shape[0], b.shape[1])
        elif a.dim() == 2:
            torch_check(offs.shape[0] == b.shape[0], lambda: "grouped_mm: group counts differ")
            shape = (a.shape[0], b.shape[2])
        else:
            torch_check(offs.shape[0] == a.shape[0], lambda: "grouped_mm: group counts differ")
            shape = (a.shape[1], b.shape[1])
    dtype = out_dtype or a.dtype
    if torch.version.hip:
        return a.new_empty(shape, dtype=dtype)
    # the kernels (CPU included) pad each output row to 16 bytes
    align = 16 // dtype.itemsize
    row = (shape[-1] + align - 1) // align * align
    stride = (row, 1) if len(shape) == 2 else (shape[1] * row, row, 1)
    return a.new_empty_strided(shape, stride, dtype=dtype)


_lib.impl("grouped_mm", _grouped_mm_impl, "CompositeExplicitAutograd")
torch.library.register_fake("autoshard::grouped_mm", _grouped_mm_fake, lib=_lib)

grouped_mm_op = torch.ops.autoshard.grouped_mm.default


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of a grouped GEMM whose groups cover every row (an upper bound when the offsets
    leave rows out), so the cost model sees expert matmuls as compute."""
    out = 1
    for s in out_shape:
        out *= s
    k = a_shape[-1]
    if len(a_shape) == 2 and len(b_shape) == 2:  # groups split the contraction
        return 2 * (out // out_shape[0]) * k
    return 2 * out * k


def _register_flops() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    packet = torch.ops.autoshard.grouped_mm
    if packet not in flop_registry:
        register_flop_formula(packet)(_grouped_mm_flops)


_register_flops()


def capture_decompositions() -> dict:
    """Ops capture rewrites while tracing (make_fx ``decomposition_table``).

    ``aten._grouped_mm`` (mixture-of-experts grouped GEMM) becomes ``autoshard::grouped_mm``:
    the same kernel in eager, but with a fake kernel for every floating dtype (torch's meta
    kernel accepts bf16 only). The table is consulted below autograd, so the ``_grouped_mm``
    calls of its backward formula are rewritten as well."""
    table = {}
    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    if grouped is not None and "default" in grouped.overloads():
        table[grouped.default] = grouped_mm_op
    return table
