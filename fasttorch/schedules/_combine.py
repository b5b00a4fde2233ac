"""Schedules built from schedules: a warm-up before one, one after another, per epoch."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from fasttorch.schedules._base import F64, Schedule, count, number, steps

__all__ = ["Warmup", "warmup"]


@attrs.frozen
class Warmup:
    """The schedule built by :func:`warmup`.

    Example:
        >>> from fasttorch.schedules import Constant
        >>> Warmup(2, Constant(1.0))(torch.tensor(1))
        tensor(0.5000, dtype=torch.float64)
    """

    warmup_steps: int = attrs.field(validator=count("warmup_steps"))
    then: Schedule = attrs.field(validator=attrs.validators.is_callable())
    init: float = attrs.field(default=0.0, validator=number("init", low=0.0))

    def __call__(self, step: Tensor) -> Tensor:
        start = self.then(torch.zeros_like(step)).to(F64)
        frac = steps(step).clamp(0.0, self.warmup_steps) / self.warmup_steps
        warm = self.init + (start - self.init) * frac
        # clamp: `then` is evaluated on every step (no branching), keep its input valid.
        after = self.then((step - self.warmup_steps).clamp(min=0)).to(F64)
        return torch.where(step < self.warmup_steps, warm, after)


def warmup(warmup_steps: int, then: Schedule, *, init: float = 0.0) -> Warmup:
    """Linear warm-up from ``init`` to ``then(0)``, followed by ``then`` shifted.

    ``lr(k) = init + (then(0) - init) * k / warmup_steps`` for ``k < warmup_steps``,
    else ``then(k - warmup_steps)``; matches ``SequentialLR(opt, [LinearLR(opt,
    start_factor, total_iters=warmup_steps), <then's scheduler>],
    milestones=[warmup_steps])``. With the default ``init=0`` the first update does not
    move the parameters; nanoGPT's ramp ``peak * (k + 1) / (warmup_steps + 1)`` is
    ``init=then(0) / (warmup_steps + 1)`` exactly.

    Args:
        warmup_steps: length of the warm-up, an int >= 1.
        then: the schedule that follows, started at its own step 0.
        init: the rate at step 0.

    Returns:
        A :class:`Warmup` schedule.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> s = schedules.warmup(2, schedules.cosine(1.0, 2))
        >>> [round(float(s(torch.tensor(k))), 3) for k in range(6)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    return Warmup(warmup_steps, then, init)
