"""torch.distributed: reading DCP's metadata safely, and FSDP2's reshard setting."""

from __future__ import annotations

import importlib
import pickle
from typing import Any

import torch

__all__ = [
    "DcpMetadataUnpickler",
    "fsdp_keeps_params_after_forward",
]


# --------------------------------------------------------------------------- DCP

_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_MD, n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name
    ("collections", "OrderedDict"),
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "WindowsPath")),
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PurePosixPath", "PureWindowsPath")),
}


class DcpMetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata only: every other global a pickle names is refused, so a
    crafted file cannot call a function (a pickle runs code only through globals).

    Why: torch reads DCP's ``.metadata`` with a plain ``pickle.load``
    (``FileSystemReader.read_metadata``; pytorch/pytorch#189308, open), and those
    records include private classes (``_StorageInfo``, ``_MEM_FORMAT_ENCODING``,
    ``torch.serialization._get_layout``), named here and nowhere else.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"it names {module}.{name}")


# --------------------------------------------------------------------------- FSDP2


def fsdp_keeps_params_after_forward(module: Any) -> bool | None:
    """Whether FSDP2 keeps ``module``'s own parameters unsharded from forward to backward.

    Why: a sharded window keeps a unit's parameters gathered from one microbatch to the
    next (``set_reshard_after_backward(False)``, public) only where that costs no memory
    the user did not already give: where the unit was sharded with
    ``reshard_after_forward=False``, or is the root, which FSDP2 never reshards after
    forward. FSDP2 has no public getter for it: ``fully_shard`` keeps it as the
    parameter groups' ``post_forward_mesh_info`` (``None``: kept), on the module's
    ``FSDPState`` (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``,
    ``_reshard_after_forward``; the root's is cleared in ``_fsdp_state.py``
    ``_lazy_init``). ``_fsdp_param_groups`` is a list from 2.12 (per-parameter
    meshes), one ``_fsdp_param_group`` before. ``None`` where none of this is found:
    the caller then reshards, as FSDP2 does by default.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    try:
        state = get_state()
    except AssertionError:  # not initialized by fully_shard
        return None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    if not groups or not all(hasattr(g, "post_forward_mesh_info") for g in groups):
        return None
    return all(g.post_forward_mesh_info is None for g in groups)
