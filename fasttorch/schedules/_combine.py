"""Schedules built from schedules: a warm-up before one, one after another, per epoch."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import attrs
import torch
from torch import Tensor

from fasttorch import _checks
from fasttorch.schedules._base import F64, Schedule, count, number, steps

__all__ = ["PerEpoch", "Sequential", "Warmup", "per_epoch", "sequential", "warmup"]


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
    timm's ``CosineLRScheduler`` is this with ``warmup_prefix=True`` only; by default it
    runs its warm-up under the unshifted cosine (``schedules.timm_cosine``).

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


@attrs.frozen
class PerEpoch:
    """The schedule built by :func:`per_epoch`.

    Example:
        >>> from fasttorch.schedules import StepDecay
        >>> PerEpoch(StepDecay(1.0, 1, gamma=0.5), 3)(torch.tensor(7))
        tensor(0.2500, dtype=torch.float64)
    """

    schedule: Schedule = attrs.field(validator=attrs.validators.is_callable())
    steps_per_epoch: int = attrs.field(validator=count("steps_per_epoch"))

    def __call__(self, step: Tensor) -> Tensor:
        epoch = torch.div(step, self.steps_per_epoch, rounding_mode="floor")
        return self.schedule(epoch).to(F64)


def per_epoch(schedule: Schedule, steps_per_epoch: int) -> PerEpoch:
    """``schedule`` counted in epochs: its value for epoch ``e`` for every step of it.

    ``lr(k) = schedule(k // steps_per_epoch)``: a schedule whose lengths are in epochs,
    as a ``torch.optim.lr_scheduler`` stepped once per epoch (or timm's scheduler with
    ``t_in_epochs=True``) gives it, constant within an epoch. ``steps_per_epoch`` is the
    number of optimizer updates per epoch (``len(loader)`` divided by the accumulation
    count, rounded up, when the last batch is kept).

    Equivalent to::

        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        for epoch in range(epochs):
            for batch in loader:              # steps_per_epoch updates, one rate
                loss_fn(model, batch).backward()
                opt.step(); opt.zero_grad()
            sched.step()

    Args:
        schedule: any schedule, read at the epoch's index.
        steps_per_epoch: optimizer updates per epoch, an int >= 1.

    Returns:
        A :class:`PerEpoch` schedule.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> s = schedules.per_epoch(schedules.cosine(1.0, 2), steps_per_epoch=3)
        >>> [float(s(torch.tensor(k))) for k in range(7)]
        [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.0]
    """
    return PerEpoch(schedule, steps_per_epoch)


def _schedules(value: Iterable[Schedule]) -> tuple[Schedule, ...]:
    if callable(value) or not isinstance(value, Iterable):
        raise _checks.ArgumentTypeError(
            f"Sequential: schedules must be a list of schedules, got {value!r}."
        )
    out = tuple(value)
    if not out:
        raise ValueError("Sequential: schedules must hold at least one schedule, got none.")
    bad = [i for i, s in enumerate(out) if not callable(s)]
    if bad:
        raise _checks.ArgumentTypeError(
            f"Sequential: schedules[{bad[0]}] is {out[bad[0]]!r}, not a schedule; each one "
            "must be a callable step -> rate (fasttorch.schedules)."
        )
    return out


def _milestones(value: Iterable[int]) -> tuple[int, ...]:
    if not isinstance(value, Iterable):
        raise _checks.ArgumentTypeError(
            f"Sequential: milestones must be a list of ints, got {value!r}."
        )
    return tuple(value)


@attrs.frozen
class Sequential:
    """The schedule built by :func:`sequential`.

    Example:
        >>> from fasttorch.schedules import Constant, LinearWarmup
        >>> s = Sequential((LinearWarmup(1.0, 2), Constant(0.5)), (2,))
        >>> [float(s(torch.tensor(k))) for k in range(4)]
        [0.0, 0.5, 0.5, 0.5]
    """

    schedules: tuple[Schedule, ...] = attrs.field(converter=_schedules)
    milestones: tuple[int, ...] = attrs.field(converter=_milestones)

    @milestones.validator
    def _check(self, attr: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]) -> None:
        if len(value) != len(self.schedules) - 1:
            raise ValueError(
                f"Sequential: {len(self.schedules)} schedules need {len(self.schedules) - 1} "
                f"milestones (the step each one after the first starts at), got {list(value)}."
            )
        for i, m in enumerate(value):
            _checks.count("Sequential", f"milestones[{i}]", m, hint="A step: a positive int.")
        if any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(
                f"Sequential: milestones must increase strictly, got {list(value)}. Sort them, "
                "and drop a schedule that would run for no step."
            )

    def __call__(self, step: Tensor) -> Tensor:
        # Every schedule is evaluated (no branching on the step); each after the first on
        # its own step count, clamped at 0 before its milestone so its input stays valid.
        starts = (0, *self.milestones)
        out = self.schedules[-1]((step - starts[-1]).clamp(min=0)).to(F64)
        for j in range(len(self.schedules) - 2, -1, -1):
            mine = self.schedules[j]((step - starts[j]).clamp(min=0)).to(F64)
            out = torch.where(step < self.milestones[j], mine, out)
        return out


def sequential(schedules: Sequence[Schedule], milestones: Sequence[int]) -> Sequential:
    """Several schedules one after another, each from its own step 0.

    ``lr(k) = schedules[i](k - milestones[i - 1])`` where ``i`` is the number of
    milestones ``<= k`` (``milestones[-1]`` read as 0): torch's
    ``SequentialLR(opt, schedulers, milestones)``, in which the scheduler that takes over
    at a milestone starts at its own step 0. Wrap it in :func:`per_epoch` for milestones
    and schedules counted in epochs.

    Equivalent to::

        sched = torch.optim.lr_scheduler.SequentialLR(
            opt, [LinearLR(opt, start_factor=0.01, total_iters=5),
                  CosineAnnealingLR(opt, T_max=95)], milestones=[5])
        # = sequential([linear_warmup(lr, 5, init=0.01 * lr), cosine(lr, 95)], [5])
        for batch in loader:
            loss_fn(model, batch).backward()
            opt.step(); sched.step(); opt.zero_grad()

    Args:
        schedules: the schedules, in order; at least one.
        milestones: the step at which each schedule after the first starts: one fewer
            than ``schedules``, positive ints, increasing.

    Returns:
        A :class:`Sequential` schedule.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> s = schedules.sequential(
        ...     [schedules.linear_warmup(1.0, 2), schedules.cosine(1.0, 2)], milestones=[2]
        ... )
        >>> [float(s(torch.tensor(k))) for k in range(6)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    return Sequential(schedules, milestones)
