"""Graph ops autoshard adds to torch: ``autoshard::free``.

``free`` releases the storage of its tensors at once (``untyped_storage().resize_(0)``), the
way FSDP frees unsharded parameters, so memory savings never wait on reference counts. It is
a registered op (not a Python callable) so graphs holding it stay serialisable and passes see
it as side-effecting.
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("autoshard", "DEF")
_lib.define("free(Tensor(a!)[] tensors) -> ()")


def _free_impl(tensors):
    for t in tensors:
        t.untyped_storage().resize_(0)


def _free_fake(tensors):
    return None


_lib.impl("free", _free_impl, "CompositeExplicitAutograd")
_lib.impl("free", _free_fake, "Meta")
torch.library.register_fake("autoshard::free", _free_fake, lib=_lib)

free_op = torch.ops.autoshard.free.default
