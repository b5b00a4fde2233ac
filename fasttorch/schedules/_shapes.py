"""The usual shapes, each equal to its ``torch.optim.lr_scheduler`` class.

``schedule(k)`` is the rate the torch scheduler gives the optimizer for its ``k``-th
``opt.step()`` (0-indexed).
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor

from fasttorch.schedules._base import F64, count, number, steps

__all__ = [
    "Constant",
    "Cosine",
    "LinearWarmup",
    "OneCycle",
    "StepDecay",
    "constant",
    "cosine",
    "linear_warmup",
    "one_cycle",
    "step_decay",
]


@attrs.frozen
class Constant:
    """The schedule built by :func:`constant`: ``value`` at every step.

    Example:
        >>> Constant(0.5)(torch.tensor(3))
        tensor(0.5000, dtype=torch.float64)
    """

    value: float = attrs.field(validator=number("value", low=0.0))

    def __call__(self, step: Tensor) -> Tensor:
        return torch.full((), self.value, dtype=F64, device=step.device)


@attrs.frozen
class LinearWarmup:
    """The schedule built by :func:`linear_warmup`.

    Example:
        >>> LinearWarmup(1.0, 4)(torch.tensor(1))
        tensor(0.2500, dtype=torch.float64)
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    warmup_steps: int = attrs.field(validator=count("warmup_steps"))
    init: float = attrs.field(default=0.0, validator=number("init", low=0.0))

    def __call__(self, step: Tensor) -> Tensor:
        frac = steps(step).clamp(0.0, self.warmup_steps) / self.warmup_steps
        return self.init + (self.peak - self.init) * frac


@attrs.frozen
class Cosine:
    """The schedule built by :func:`cosine`.

    Example:
        >>> Cosine(1.0, 10)(torch.tensor(5))
        tensor(0.5000, dtype=torch.float64)
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    decay_steps: int = attrs.field(validator=count("decay_steps"))
    end: float = attrs.field(default=0.0, validator=number("end", low=0.0))

    def __call__(self, step: Tensor) -> Tensor:
        s = steps(step).clamp(0.0, self.decay_steps)
        return (
            self.end + (self.peak - self.end) * (1 + torch.cos(math.pi * s / self.decay_steps)) / 2
        )


@attrs.frozen
class OneCycle:
    """The schedule built by :func:`one_cycle`.

    Example:
        >>> OneCycle(1.0, 10)(torch.tensor(2))
        tensor(1., dtype=torch.float64)
    """

    max_lr: float = attrs.field(validator=number("max_lr", low=0.0))
    total_steps: int = attrs.field(validator=count("total_steps"))
    pct_start: float = attrs.field(default=0.3, validator=number("pct_start", low=0.0))
    div_factor: float = attrs.field(
        default=25.0, validator=number("div_factor", low=0.0, strict=True)
    )
    final_div_factor: float = attrs.field(
        default=1e4, validator=number("final_div_factor", low=0.0, strict=True)
    )

    def __attrs_post_init__(self) -> None:
        # torch's phase boundaries; both phases need a positive length or pct divides by 0.
        warm = self.pct_start * self.total_steps
        if not 1.0 < warm < self.total_steps:
            raise ValueError(
                f"OneCycle: pct_start * total_steps = {self.pct_start} * {self.total_steps} "
                f"= {warm}; it must lie strictly between 1 and total_steps so that both the "
                "warm-up and the annealing phase last more than one step. Raise total_steps "
                "or choose pct_start in (1/total_steps, 1)."
            )

    def __call__(self, step: Tensor) -> Tensor:
        initial = self.max_lr / self.div_factor
        final = initial / self.final_div_factor
        end1 = float(self.pct_start * self.total_steps) - 1
        end2 = float(self.total_steps - 1)
        s = steps(step).clamp(0.0, end2)
        up = _anneal_cos(initial, self.max_lr, (s / end1).clamp(max=1.0))
        down = _anneal_cos(self.max_lr, final, ((s - end1) / (end2 - end1)).clamp(min=0.0))
        return torch.where(s <= end1, up, down)


def _anneal_cos(start: float, end: float, pct: Tensor) -> Tensor:
    # torch.optim.lr_scheduler.OneCycleLR._annealing_cos, term for term.
    return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)


@attrs.frozen
class StepDecay:
    """The schedule built by :func:`step_decay`.

    Example:
        >>> StepDecay(1.0, 2, gamma=0.5)(torch.tensor(5))
        tensor(0.2500, dtype=torch.float64)
    """

    init: float = attrs.field(validator=number("init", low=0.0))
    step_size: int = attrs.field(validator=count("step_size"))
    gamma: float = attrs.field(default=0.1, validator=number("gamma", low=0.0))

    def __call__(self, step: Tensor) -> Tensor:
        k = torch.div(step.clamp(min=0), self.step_size, rounding_mode="floor").to(F64)
        return self.init * torch.pow(self.gamma, k)


def constant(value: float) -> Constant:
    """A constant learning rate, as a schedule (``torch.optim`` with no scheduler).

    Args:
        value: the rate at every step.

    Returns:
        A :class:`Constant` schedule.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> schedules.constant(0.1)(torch.tensor(7))
        tensor(0.1000, dtype=torch.float64)
    """
    return Constant(value)


def linear_warmup(peak: float, warmup_steps: int, *, init: float = 0.0) -> LinearWarmup:
    """Linear ramp from ``init`` to ``peak`` over ``warmup_steps``, then ``peak``.

    ``lr(k) = init + (peak - init) * min(k, warmup_steps) / warmup_steps``; matches
    ``LinearLR(opt, start_factor=init/peak, end_factor=1.0, total_iters=warmup_steps)``
    with base lr ``peak`` (torch needs ``init > 0``; this one does not).

    Args:
        peak: the rate reached at ``warmup_steps`` and kept after.
        warmup_steps: length of the ramp, an int >= 1.
        init: the rate at step 0.

    Returns:
        A :class:`LinearWarmup` schedule.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> s = schedules.linear_warmup(1.0, 4)
        >>> [round(float(s(torch.tensor(k))), 2) for k in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    return LinearWarmup(peak, warmup_steps, init)


def cosine(peak: float, decay_steps: int, *, end: float = 0.0) -> Cosine:
    """Cosine decay from ``peak`` to ``end`` over ``decay_steps``, then ``end``.

    ``lr(k) = end + (peak - end) * (1 + cos(pi * min(k, decay_steps) / decay_steps)) / 2``;
    matches ``CosineAnnealingLR(opt, T_max=decay_steps, eta_min=end)`` for
    ``k <= decay_steps`` (torch's rises again after; this one stays at ``end``).

    Args:
        peak: the rate at step 0.
        decay_steps: length of the decay, an int >= 1.
        end: the final rate.

    Returns:
        A :class:`Cosine` schedule.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> s = schedules.cosine(1.0, 4)
        >>> [round(float(s(torch.tensor(k))), 3) for k in range(6)]
        [1.0, 0.854, 0.5, 0.146, 0.0, 0.0]
    """
    return Cosine(peak, decay_steps, end)


def one_cycle(
    max_lr: float,
    total_steps: int,
    *,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> OneCycle:
    """The 1cycle policy: cosine up to ``max_lr``, then cosine down to a tiny rate.

    Matches ``OneCycleLR(opt, max_lr, total_steps=total_steps, pct_start=pct_start,
    anneal_strategy="cos", div_factor=div_factor, final_div_factor=final_div_factor,
    three_phase=False)``: from ``max_lr / div_factor`` at step 0 up to ``max_lr`` at
    step ``pct_start * total_steps - 1``, down to ``max_lr / div_factor /
    final_div_factor`` at step ``total_steps - 1``, where it stays (torch raises there).

    Args:
        max_lr: the peak rate.
        total_steps: the length of the cycle, an int >= 1.
        pct_start: the fraction of the cycle spent rising.
        div_factor: ``max_lr / initial_lr``.
        final_div_factor: ``initial_lr / final_lr``.

    Returns:
        A :class:`OneCycle` schedule.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> s = schedules.one_cycle(1.0, 10, pct_start=0.3)
        >>> [round(float(s(torch.tensor(k))), 3) for k in (0, 1, 2, 9, 20)]
        [0.04, 0.52, 1.0, 0.0, 0.0]
    """
    return OneCycle(max_lr, total_steps, pct_start, div_factor, final_div_factor)


def step_decay(init: float, step_size: int, *, gamma: float = 0.1) -> StepDecay:
    """Multiply the rate by ``gamma`` every ``step_size`` steps.

    ``lr(k) = init * gamma ** (k // step_size)``; matches
    ``StepLR(opt, step_size=step_size, gamma=gamma)`` with base lr ``init``.

    Args:
        init: the rate at step 0.
        step_size: steps between decays, an int >= 1.
        gamma: the decay factor, >= 0.

    Returns:
        A :class:`StepDecay` schedule.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> s = schedules.step_decay(1.0, 2, gamma=0.5)
        >>> [float(s(torch.tensor(k))) for k in range(5)]
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    return StepDecay(init, step_size, gamma)
