"""The module's buffers as a window began, for updates that may be skipped.

The forward updates buffers (BatchNorm's running statistics) in place before the update
phase learns whether to skip; a skipped update puts back what they held when the window
began. :func:`keep_buffers` adds the sub-state that keeps them (a transform that marks
skips asks for it), :func:`restore_buffers` is the update phase's side.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch

from fasttorch.state import TrainState

__all__ = ["BUFFERS_KEY", "keep_buffers", "restore_buffers"]

Tensors: TypeAlias = dict[str, torch.Tensor]


BUFFERS_KEY = "skip_buffers"
"""The sub-state key of the module's buffers as they were when the window began."""


def keep_buffers(inits: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """``inits`` plus the buffer snapshot a transform that marks skips needs (once).

    The forward updates buffers (BatchNorm's running statistics) in place before the
    update phase learns whether to skip; a skipped update puts back the values they had
    when the window began, which this sub-state keeps: a copy of the module's buffers
    (not of frozen parameters), refreshed by every update.
    """
    if any(k == BUFFERS_KEY for k, _ in inits):
        return inits
    return (*inits, (BUFFERS_KEY, _snapshot_buffers))


def _snapshot_buffers(state: TrainState) -> Tensors:
    names = {n for n, _ in state.module.named_buffers()}
    return {k: b.clone() for k, b in state.buffers.items() if k in names}


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
    return buffers, {**state.substates, BUFFERS_KEY: snapshot}
