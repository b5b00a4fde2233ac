"""When a built-in optimizer runs torch's fused kernel, and the host values it needs.

A donated eager step on a GPU updates every parameter of one dtype in one launch of
torch's fused kernel (``torch.optim.AdamW(fused=True)``'s), which also takes
``GradScaler``'s scale and inf flag. Elsewhere (a CPU, a graph, a state that is not
donated) the update runs as ``_foreach_*`` calls, written so that each takes CUDA's
multi-tensor path (docs/optimizers.md, "Kernels").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fasttorch import _compat

__all__ = [
    "FUSED_DEVICES",
    "by_dtype",
    "factor_dtype",
    "float_flag",
    "host_float",
    "kernel",
    "remember",
]

FUSED_DEVICES = frozenset({"cuda"})
"""Device types whose donated eager steps use the fused kernels.

Not the CPU: there a step's eager and compiled forms run the same arithmetic and give
the same bits (the tests hold them to it), and torch's fused CPU kernel rounds
differently. The tests run the fused path on CPU by adding "cpu" here."""

_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def kernel(name: str, lists: Sequence[Sequence[Tensor]]) -> Callable[..., Any] | None:
    """torch's fused kernel ``name`` when it can update ``lists`` (params first), else None.

    It can in an eager call (not traced), on a device in :data:`FUSED_DEVICES`, for
    float dtypes, when every group of one dtype meets the kernel's layout rule
    (CUDA's multi-tensor rule: one device, dense tensors, the same shape and strides
    across the lists); and only where this torch has the kernel.
    """
    if torch.compiler.is_compiling() or not lists or not lists[0]:
        return None
    if _compat.in_functorch_transform():  # vmap: the kernel's host hyperparameters
        return None
    first = lists[0][0]
    if first.device.type not in FUSED_DEVICES:
        return None
    fused = _compat.fused_optimizer_kernel(name)
    if fused is None:
        return None
    for group in by_dtype(lists):
        if group[0][0].dtype not in _DTYPES or not _same_layout(group):
            return None
    return fused


def factor_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a 0-d factor that scales a ``dtype`` list in a ``_foreach_*`` call.

    The list's own for float32 and float64: CUDA's multi-tensor path needs a scalar
    tensor of the list's dtype, and casting a float64 factor to float32 first is the
    cast the op itself makes (the same bits). float32 for bfloat16 and float16 lists,
    the precision the op computes in (a factor rounded to 8 bits would change the
    results; such lists take the per-tensor path in ``_foreach_*`` and the fused
    kernel in a donated eager step).
    """
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def by_dtype(lists: Sequence[Sequence[Tensor]]) -> Iterator[list[list[Tensor]]]:
    """``lists`` split by the dtype of the first list's tensors (one kernel per dtype)."""
    order: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(lists[0]):
        order.setdefault(t.dtype, []).append(i)
    for indices in order.values():
        yield [[ts[i] for i in indices] for ts in lists]


def _same_layout(lists: Sequence[Sequence[Tensor]]) -> bool:
    first = lists[0][0]
    for ts in lists:
        for t, p in zip(ts, lists[0], strict=True):
            if t.dtype != first.dtype or t.device != first.device or t.layout != torch.strided:
                return False
            if t.shape != p.shape or t.stride() != p.stride():
                return False
            if not (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)):
                return False
    return True


# id(tensor) -> (weak reference, version when read, value as a Python float)
_HOST: dict[int, tuple[weakref.ref[Tensor], int, float]] = {}


def remember(hyper: Mapping[str, Tensor], values: Mapping[str, float]) -> None:
    """Record the host values of hyperparameter tensors ``init`` just made from ``values``.

    Each as its tensor holds it (rounded to the tensor's dtype, on the host), so that a
    step on a GPU never reads them back.
    """
    for name, v in values.items():
        t = hyper[name]
        _store(t, float(torch.tensor(float(v), dtype=t.dtype)))


def host_float(t: Tensor) -> float:
    """The value of the 0-d tensor ``t`` as a Python float, read once per change.

    A tensor recorded by :func:`remember` and unchanged since is not read again. One
    changed in place (:func:`~fasttorch.optim.set_hyperparams`), or new (a loaded
    checkpoint), is read once: on a GPU one copy to the host, at the first eager
    step after the change.
    """
    entry = _HOST.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == _compat.tensor_version(t):
        return entry[2]
    value = float(t)
    _store(t, value)
    return value


def _store(t: Tensor, value: float) -> None:
    key = id(t)
    _HOST[key] = (weakref.ref(t, lambda _: _HOST.pop(key, None)), _compat.tensor_version(t), value)


# The last flag converted: (weak reference to the bool tensor, its version, float copy).
_FLAG: list[tuple[weakref.ref[Tensor], int, Tensor]] = []


def float_flag(flag: Tensor) -> Tensor:
    """``flag.float()`` (a bool 0-d tensor as float32), converted once per step.

    The fused kernels and ``with_amp``'s loss-scale kernel take GradScaler's
    ``found_inf`` as float32; the same step converts the same flag for both.
    """
    if _FLAG:
        ref, version, value = _FLAG[0]
        if ref() is flag and version == _compat.tensor_version(flag):
            return value
    value = flag.float()
    _FLAG[:] = [(weakref.ref(flag), _compat.tensor_version(flag), value)]
    return value
