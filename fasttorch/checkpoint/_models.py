"""Checkpoints of a :class:`fasttorch.Models` state: what its save and its load share.

Each trained member is saved by ``save_models`` (``_save``) into
``directory/<member>/<name>``, under the same name, so every member's checkpoint is as
crash-safe as a one-model one. A crash between two members' saves leaves the newest
name in some members only: ``latest_models`` (``_load``) returns the newest name that
every member has. ``Frozen`` members (a teacher, a target network) are saved with the
first trained member, as its sub-state :data:`FROZEN_KEY`: a target network that the
step updates resumes where it was, and a teacher is restored with the weights it was
saved with. Here: that sub-state's record and the members' sorting, below both.
"""

from __future__ import annotations

import torch

from fasttorch import struct
from fasttorch.checkpoint._errors import CheckpointError
from fasttorch.models import Frozen, Models
from fasttorch.state import TrainState

__all__ = ["FROZEN_KEY", "FrozenTensors"]

FROZEN_KEY = "several.frozen"
"""The sub-state of the first trained member's checkpoint that holds the Frozen members."""


class FrozenTensors(struct.Record):
    """The tensors of a state's ``Frozen`` members, by member, saved with a trained one."""

    members: dict[str, dict[str, torch.Tensor]]


def _trained(state: Models, api: str) -> dict[str, TrainState]:
    if not isinstance(state, Models):
        raise TypeError(f"{api} expects a fasttorch.Models state, got {type(state).__name__}")
    members = state.members  # raises DonatedStateError for a donated state
    for n, m in members.items():
        if not isinstance(m, (TrainState, Frozen)):
            raise CheckpointError(
                f"{api}: member {n!r} is a {type(m).__name__}, which a checkpoint cannot "
                "hold; a member is a fasttorch.TrainState or a fasttorch.Frozen"
            )
    return {n: m for n, m in members.items() if isinstance(m, TrainState)}


def _frozen(state: Models) -> dict[str, Frozen]:
    return {n: m for n, m in state.members.items() if isinstance(m, Frozen)}


def _carrying(members: dict[str, TrainState], frozen: dict[str, Frozen]) -> dict[str, TrainState]:
    """``members`` with the first one carrying the Frozen members' tensors (if any)."""
    if not frozen:
        return members
    first = next(iter(members))
    carried = FrozenTensors(members={n: dict(f.tensors) for n, f in frozen.items()})
    return {**members, first: members[first].with_substate(FROZEN_KEY, carried)}
