"""``TrainState``: everything a training step reads and writes, as one immutable pytree.

And its life: creation from a module, the check that its tensors fit that module, and
donation (a step's results written into the input state's tensors, which then die).
Defined in the step runtime (``fasttorch/_core/state.py``, with the module's training
modes and FSDP2 shards, the call scope and the state's RNG); this is its public face.
"""

from __future__ import annotations

from fasttorch._core.state import (
    DonatedStateError,
    TrainState,
    check_alive,
    check_template,
    commit,
    default_seed,
    draw_,
    evaluating,
    failure_summary,
    is_sharded,
    kept_leaves,
    local_tensor,
    mark_donated,
    mark_failed,
    reshard,
    training_modes,
)

__all__ = [
    "DonatedStateError",
    "TrainState",
    "check_alive",
    "check_template",
    "commit",
    "default_seed",
    "draw_",
    "evaluating",
    "failure_summary",
    "is_sharded",
    "kept_leaves",
    "local_tensor",
    "mark_donated",
    "mark_failed",
    "reshard",
    "training_modes",
]
