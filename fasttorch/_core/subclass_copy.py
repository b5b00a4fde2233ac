"""The copy of a donated state's tensor subclasses: one ``copy_`` each.

torchao's quantized optimizer states (``fasttorch.optim.from_torchao``) implement
``copy_`` (their codes, scales and map copied) but not ``_foreach_copy_``, with which a
donated step writes its new values into the old state's tensors (``state.commit``).
"""

from __future__ import annotations

import torch

__all__ = ["copy_subclasses"]


def copy_subclasses(
    dst: list[torch.Tensor], src: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy the pairs whose destination is a tensor subclass over inner tensors, one by
    one, and return the other pairs, for ``_foreach_copy_``."""
    subclass = [_is_state_subclass(d) for d in dst]
    if not any(subclass):
        return dst, src
    for d, s, sub in zip(dst, src, subclass):
        if sub:
            d.copy_(s)
    plain = [(d, s) for d, s, sub in zip(dst, src, subclass) if not sub]
    return [d for d, _ in plain], [s for _, s in plain]


def _is_state_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass over inner tensors (not a ``DTensor``: it has ``_foreach_copy_``)."""
    cls = type(t)
    return hasattr(cls, "__tensor_flatten__") and cls.__name__ != "DTensor"
