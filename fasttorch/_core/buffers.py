"""The module's buffers as a window began, for updates that may be skipped.

The forward updates buffers (BatchNorm's running statistics) in place before the update
phase learns whether to skip; a skipped update puts back what they held when the window
began. :data:`SKIP_BUFFERS` declares the sub-state that keeps them (a transform that
marks skips declares it), :func:`restore_buffers` is the update phase's side.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch

from fasttorch._core.state import TrainState
from fasttorch.substates import SubState

__all__ = ["BUFFERS_KEY", "SKIP_BUFFERS", "restore_buffers"]

Tensors: TypeAlias = dict[str, torch.Tensor]


BUFFERS_KEY = "skip_buffers"
"""The sub-state key of the module's buffers as they were when the window began."""


def _snapshot_buffers(state: TrainState) -> Tensors:
    names = {n for n, _ in state.module.named_buffers()}
    return {k: b.clone() for k, b in state.buffers.items() if k in names}


SKIP_BUFFERS = SubState(BUFFERS_KEY, dict, _snapshot_buffers)
"""The buffer snapshot a transform that marks skips declares (``substate=``; kept once).

The forward updates buffers (BatchNorm's running statistics) in place before the
update phase learns whether to skip; a skipped update puts back the values they had
when the window began, which this sub-state keeps: a copy of the module's buffers
(not of frozen parameters), refreshed by every update. A plain dict of tensors, so
replicated in a checkpoint (``substates/skip_buffers/<name>``).
"""


def restore_buffers(state: TrainState, skip: torch.Tensor) -> tuple[Tensors, dict[str, Any]]:
    """Buffers as they were when the window began where ``skip``, and the next snapshot."""
    kept: Tensors | None = state.substates.get(BUFFERS_KEY)
    if not kept:
        return state.buffers, state.substates
    buffers = dict(state.buffers)
    for k, old in kept.items():
        buffers[k] = torch.where(skip, old, buffers[k])
    # A copy, not the buffer itself: the next forward may update the buffer in place.
    snapshot = {k: buffers[k].clone() for k in kept}
    return buffers, state.with_substate(BUFFERS_KEY, snapshot).substates
