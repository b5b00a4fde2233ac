"""One fp16 loss scale for every member of a several-model step (``share_loss_scale``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fasttorch.models import Member
from fasttorch.phases import Metrics
from fasttorch.state import TrainState
from fasttorch.transforms.with_amp import KEY as AMP_KEY


class SharedScale:
    """One fp16 loss scale for every member, as one ``GradScaler`` for both optimizers.

    Every member's step runs with the scale as it was before the call (a copy each: a
    donating step adjusts its own in place). Once every member updated, the scale is
    adjusted once from all of them, ``GradScaler.update()`` after both ``step``s: each
    member's adjusted copy is the rule applied to the same scale with its own overflow
    flag, so the result is the copy of any member that overflowed, else any copy
    (``torch.where``, no host read).
    """

    def __init__(self) -> None:
        self.before: Any = None
        self.adjusted: dict[str, Any] = {}
        self.skipped: dict[str, torch.Tensor | None] = {}

    def give(self, owner: str, name: str, own: TrainState) -> TrainState:
        amp = own.substates.get(AMP_KEY)
        if amp is None:
            raise ValueError(
                f"{owner}: share_loss_scale=True, but member {name!r}'s step keeps no "
                "loss scale; wrap every member's step in fasttorch.with_amp(step, 'fp16')"
            )
        if self.before is None:  # the first member's scale is the shared one
            self.before = pytree.tree_map(torch.clone, amp)
            return own
        mine = pytree.tree_map(torch.clone, self.before)
        return own.with_substate(AMP_KEY, mine)

    def took(self, name: str, new: TrainState, metrics: Metrics) -> None:
        self.adjusted[name] = new.substates[AMP_KEY]
        self.skipped[name] = metrics.get("skipped")

    def combine(self, owner: str, members: dict[str, Member]) -> dict[str, Member]:
        updated = [n for n, f in self.skipped.items() if f is not None]
        if not updated:  # a microbatch inside the window: no member touched its scale
            return members
        if len(updated) != len(self.skipped):
            raise ValueError(
                f"{owner}: share_loss_scale=True, but only {updated} of the members "
                f"{list(self.skipped)} updated on this call; a shared loss scale needs "
                "every member to update on the same calls (the same grad_accumulate n)"
            )
        names = list(self.adjusted)
        out = self.adjusted[names[-1]]
        for n in names[:-1]:
            flag = self.skipped[n]
            out = pytree.tree_map(lambda a, b, f=flag: torch.where(f, a, b), self.adjusted[n], out)
        result = dict(members)
        for n in names:
            m = result[n]
            assert isinstance(m, TrainState)
            result[n] = m.with_substate(AMP_KEY, out)
        return result
