"""The module's buffers as a window began, for updates that may be skipped.

The forward updates buffers (BatchNorm's running statistics) in place before the update
phase learns whether to skip; a skipped update puts back what they held when the window
began. A transform that marks skips declares the sub-state that keeps them
(``skip_nonfinite``'s ``SKIP_BUFFERS``, a ``SkipBuffers`` record whose class declares
``restores_buffers``); :func:`restore_buffers` is the update phase's side, and knows
the record only by what it declares (:class:`KeptBuffers`).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

import torch

from fasttorch._core.state import TrainState

__all__ = ["KeptBuffers", "restore_buffers"]

Tensors: TypeAlias = dict[str, torch.Tensor]


class KeptBuffers(Protocol):
    """A sub-state that keeps buffers to put back where an update is skipped.

    Its class declares ``restores_buffers = True`` (:mod:`fasttorch.substates`).
    """

    def restore(self, buffers: Tensors, skip: torch.Tensor) -> tuple[Tensors, Any]:
        """``buffers`` with the kept ones put back where ``skip``, and the next record."""
        ...


def restore_buffers(state: TrainState, skip: torch.Tensor) -> tuple[Tensors, dict[str, Any]]:
    """Buffers as they were when the window began where ``skip``, and the next snapshot."""
    buffers, substates = state.buffers, state.substates
    for key, kept in state.substates.items():
        if getattr(type(kept), "restores_buffers", False):
            buffers, after = kept.restore(buffers, skip)
            substates = {**substates, key: after}
    return buffers, substates
