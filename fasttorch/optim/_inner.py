"""Tensor subclasses among an optimizer's state: an operation applied to their inner tensors.

torchao's quantized optimizer states (``OptimState8bit``, ``OptimState4bit``,
``OptimStateFp8``) implement the few operations torchao's kernel needs (``copy_``,
``lerp``, ``_to_copy``), not ``clone`` or ``where``. What fasttorch does to a state
around an update (a copy for a step that does not donate, the old value kept where a
step is skipped) is done to each inner tensor (codes, block scales, map) instead, and
the state rebuilt by its class's own ``__tensor_unflatten__``: exact, as selecting or
copying codes selects or copies the values they stand for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_layout", "clone", "map_inner", "where"]

# Each torchao state's __tensor_flatten__ context, read from its attributes (torchao
# 0.18; check_layout verifies it when an optimizer is built): dynamo does not trace
# __tensor_flatten__ (it returns names, not tensors).
_CONTEXT: dict[str, Callable[[Any], list[Any]]] = {
    "OptimState8bit": lambda t: [t.signed, t.dtype],
    "OptimState4bit": lambda t: [t.signed, t._shape, t.dtype],
    "OptimStateFp8": lambda t: [t.dtype],
}


def map_inner(fn: Callable[..., Tensor], *ts: Tensor) -> Tensor:
    """``fn(*ts)``; for torchao's states (all of one class and layout), ``fn`` of their
    inner tensors, name by name, rebuilt into that class. Other tensors, subclasses
    with operations of their own (``DTensor``) included, go to ``fn`` as they are."""
    cls = type(ts[0])
    read = _CONTEXT.get(cls.__name__)
    if read is None or not hasattr(cls, "__tensor_flatten__"):
        return fn(*ts)
    names, ctx = cls.tensor_attrs, read(ts[0])  # type: ignore[attr-defined]
    inner = {k: map_inner(fn, *(getattr(t, k) for t in ts)) for k in names}
    return cls.__tensor_unflatten__(inner, ctx, ts[0].shape, ts[0].stride())  # type: ignore[attr-defined, no-any-return]


def clone(t: Tensor) -> Tensor:
    """A copy of ``t`` (of a subclass: over copies of its inner tensors)."""
    return map_inner(torch.clone, t)


def where(flag: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``torch.where(flag, a, b)`` (of subclasses: of their inner tensors)."""
    return map_inner(lambda x, y: torch.where(flag, x, y), a, b)


def check_layout(owner: str, state: Tensor) -> None:
    """Raise unless ``_CONTEXT`` reads ``state``'s flatten context as its class gives it."""
    cls = type(state)
    read = _CONTEXT.get(cls.__name__)
    names, ctx = state.__tensor_flatten__()  # type: ignore[attr-defined]
    fields = list(getattr(cls, "tensor_attrs", ()))
    if read is None or list(names) != fields or read(state) != list(ctx):
        raise TypeError(
            f"{owner}: this torchao release keeps its state as {cls.__name__} with fields "
            f"{names} and context {ctx}, which fasttorch does not know (written for "
            "torchao 0.18). Use the torchao release fasttorch supports "
            "(pip install 'fasttorch[ao]')."
        )
