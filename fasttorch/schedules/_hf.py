"""Hugging Face's ``transformers.get_scheduler`` types, value for value.

Each class here is one ``name`` of ``get_scheduler(name, optimizer, num_warmup_steps,
num_training_steps, scheduler_specific_kwargs)``; ``schedules.hf`` builds one from the
same arguments. ``schedule(k)`` is ``peak * lr_lambda(k)``: the rate the ``LambdaLR``
that Hugging Face builds gives the optimizer for its ``k``-th ``opt.step()``, where
``peak`` is the optimizer's ``lr``. The factor is computed with the float64 operations
Hugging Face runs in Python floats, in the same order, selected with ``torch.where``
instead of ``if``; the values after ``num_training_steps`` are Hugging Face's too (its
``"cosine"`` rises again there; ``"linear"`` stays at 0).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from torch import Tensor

from fasttorch.schedules._base import choice, count, number, steps

__all__ = [
    "HFConstantWithWarmup",
    "HFCosine",
    "HFCosineWarmupWithMinLR",
    "HFCosineWithRestarts",
    "HFInverseSqrt",
    "HFLinear",
    "HFPolynomial",
    "HFWarmupStableDecay",
]

_SHAPES = ("linear", "cosine", "1-sqrt")


def _ramp(step: Tensor, warmup_steps: int) -> Tensor:
    # float(current_step) / float(max(1, num_warmup_steps))
    return steps(step) / float(max(1, warmup_steps))


def _progress(step: Tensor, warmup_steps: int, total_steps: int) -> Tensor:
    # float(current_step - num_warmup_steps) / float(max(1, num_training_steps - ...))
    return steps(step - warmup_steps) / float(max(1, total_steps - warmup_steps))


def _check_total(inst: Any) -> None:
    if inst.total_steps < inst.warmup_steps:
        raise ValueError(
            f"{type(inst).__name__}: warmup_steps={inst.warmup_steps} is more than "
            f"total_steps={inst.total_steps}; the warm-up is part of the training steps. "
            "Pass total_steps >= warmup_steps."
        )


@attrs.frozen
class HFLinear:
    """Hugging Face's ``"linear"``: ``get_linear_schedule_with_warmup``.

    ``k / warmup_steps`` of ``peak`` while ``k < warmup_steps``, then down in a line to
    0 at ``total_steps``, and 0 after.

    Example:
        >>> [float(HFLinear(1.0, 2, 6)(torch.tensor(k))) for k in range(8)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    warmup_steps: int = attrs.field(validator=count("warmup_steps", low=0))
    total_steps: int = attrs.field(validator=count("total_steps"))

    def __attrs_post_init__(self) -> None:
        _check_total(self)

    def __call__(self, step: Tensor) -> Tensor:
        left = steps(self.total_steps - step) / float(max(1, self.total_steps - self.warmup_steps))
        factor = torch.where(
            step < self.warmup_steps, _ramp(step, self.warmup_steps), left.clamp(min=0.0)
        )
        return self.peak * factor


@attrs.frozen
class HFCosine:
    """Hugging Face's ``"cosine"`` (``get_cosine_schedule_with_warmup``), and with
    ``min_lr_rate`` its ``"cosine_with_min_lr"``.

    After the linear warm-up, ``peak * max(0, c * (1 - min_lr_rate) + min_lr_rate)``
    with ``c = (1 + cos(2 pi num_cycles p)) / 2`` and ``p = (k - warmup_steps) /
    (total_steps - warmup_steps)``. With the default ``num_cycles=0.5`` the rate falls
    to ``peak * min_lr_rate`` at ``total_steps`` and rises again after, as Hugging
    Face's does.

    Example:
        >>> [float(HFCosine(1.0, 1, 3)(torch.tensor(k))) for k in range(4)]
        [0.0, 1.0, 0.5, 0.0]
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    warmup_steps: int = attrs.field(validator=count("warmup_steps", low=0))
    total_steps: int = attrs.field(validator=count("total_steps"))
    num_cycles: float = attrs.field(default=0.5, validator=number("num_cycles", low=0.0))
    min_lr_rate: float = attrs.field(
        default=0.0, validator=number("min_lr_rate", low=0.0, high=1.0)
    )

    def __attrs_post_init__(self) -> None:
        _check_total(self)

    def __call__(self, step: Tensor) -> Tensor:
        turn = math.pi * float(self.num_cycles) * 2.0
        wave = 0.5 * (1.0 + torch.cos(turn * _progress(step, self.warmup_steps, self.total_steps)))
        wave = (wave * (1 - self.min_lr_rate) + self.min_lr_rate).clamp(min=0.0)
        return self.peak * torch.where(
            step < self.warmup_steps, _ramp(step, self.warmup_steps), wave
        )


@attrs.frozen
class HFCosineWithRestarts:
    """Hugging Face's ``"cosine_with_restarts"``:
    ``get_cosine_with_hard_restarts_schedule_with_warmup``.

    After the linear warm-up, ``num_cycles`` cosine decays from ``peak`` to 0, each
    restarting at ``peak``, over ``total_steps - warmup_steps``; 0 from ``total_steps``.

    Example:
        >>> s = HFCosineWithRestarts(1.0, 0, 4, num_cycles=2)
        >>> [float(s(torch.tensor(k))) for k in range(5)]
        [1.0, 0.5, 1.0, 0.5, 0.0]
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    warmup_steps: int = attrs.field(validator=count("warmup_steps", low=0))
    total_steps: int = attrs.field(validator=count("total_steps"))
    num_cycles: float = attrs.field(default=1, validator=number("num_cycles", low=0.0, strict=True))

    def __attrs_post_init__(self) -> None:
        _check_total(self)

    def __call__(self, step: Tensor) -> Tensor:
        progress = _progress(step, self.warmup_steps, self.total_steps)
        phase = torch.remainder(float(self.num_cycles) * progress, 1.0)
        wave = (0.5 * (1.0 + torch.cos(math.pi * phase))).clamp(min=0.0)
        wave = torch.where(progress >= 1.0, 0.0, wave)
        return self.peak * torch.where(
            step < self.warmup_steps, _ramp(step, self.warmup_steps), wave
        )


@attrs.frozen
class HFPolynomial:
    """Hugging Face's ``"polynomial"``: ``get_polynomial_decay_schedule_with_warmup``.

    After the linear warm-up, ``(peak - lr_end) * (1 - p) ** power + lr_end`` with ``p =
    (k - warmup_steps) / (total_steps - warmup_steps)``, and ``lr_end`` after
    ``total_steps``. As in Hugging Face, the factor is that value over ``peak`` and the
    rate ``peak`` times it.

    Example:
        >>> s = HFPolynomial(1.0, 0, 2, lr_end=0.5)
        >>> [float(s(torch.tensor(k))) for k in range(4)]
        [1.0, 0.75, 0.5, 0.5]
    """

    peak: float = attrs.field(validator=number("peak", low=0.0, strict=True))
    warmup_steps: int = attrs.field(validator=count("warmup_steps", low=0))
    total_steps: int = attrs.field(validator=count("total_steps"))
    lr_end: float = attrs.field(default=1e-7, validator=number("lr_end", low=0.0))
    power: float = attrs.field(default=1.0, validator=number("power", low=0.0))

    def __attrs_post_init__(self) -> None:
        if not self.peak > self.lr_end:
            raise ValueError(
                f"HFPolynomial: lr_end={self.lr_end} must be smaller than peak={self.peak} "
                "(Hugging Face raises the same). Lower lr_end or raise peak."
            )
        if self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"HFPolynomial: total_steps={self.total_steps} must be more than "
                f"warmup_steps={self.warmup_steps}: the decay needs at least one step "
                "(Hugging Face divides by zero at total_steps). Raise total_steps."
            )

    def __call__(self, step: Tensor) -> Tensor:
        decay_steps = self.total_steps - self.warmup_steps
        pct_remaining = 1 - steps(step - self.warmup_steps) / decay_steps
        # clamp: identity where this branch is chosen; keeps pow's base >= 0 elsewhere.
        decay = (self.peak - self.lr_end) * pct_remaining.clamp(
            0.0, 1.0
        ) ** self.power + self.lr_end
        factor = torch.where(step > self.total_steps, self.lr_end / self.peak, decay / self.peak)
        return self.peak * torch.where(
            step < self.warmup_steps, _ramp(step, self.warmup_steps), factor
        )


@attrs.frozen
class HFConstantWithWarmup:
    """Hugging Face's ``"constant_with_warmup"``: ``get_constant_schedule_with_warmup``.

    Example:
        >>> [float(HFConstantWithWarmup(1.0, 2)(torch.tensor(k))) for k in range(4)]
        [0.0, 0.5, 1.0, 1.0]
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    warmup_steps: int = attrs.field(validator=count("warmup_steps", low=0))

    def __call__(self, step: Tensor) -> Tensor:
        return self.peak * torch.where(
            step < self.warmup_steps, _ramp(step, self.warmup_steps), 1.0
        )


@attrs.frozen
class HFInverseSqrt:
    """Hugging Face's ``"inverse_sqrt"``: ``get_inverse_sqrt_schedule``.

    After the linear warm-up, ``peak / sqrt((k + timescale - warmup_steps) /
    timescale)``. ``timescale=None`` is Hugging Face's default, ``warmup_steps`` (or
    10000 without a warm-up).

    Example:
        >>> [float(HFInverseSqrt(1.0, 1)(torch.tensor(k))) for k in (0, 1, 4)]
        [0.0, 1.0, 0.5]
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    warmup_steps: int = attrs.field(validator=count("warmup_steps", low=0))
    timescale: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(count("timescale"))
    )

    def __call__(self, step: Tensor) -> Tensor:
        timescale = self.timescale or self.warmup_steps or 10_000
        shift = timescale - self.warmup_steps
        # clamp: identity where this branch is chosen; keeps sqrt's argument > 0 elsewhere.
        after = 1.0 / torch.sqrt(steps(step.clamp(min=self.warmup_steps) + shift) / timescale)
        return self.peak * torch.where(
            step < self.warmup_steps, _ramp(step, self.warmup_steps), after
        )


def _shape(kind: str, progress: Tensor, *, rising: bool, num_cycles: float = 0.5) -> Tensor:
    # _get_wsd_scheduler_lambda's three warm-up and three decay shapes, term for term.
    if kind == "linear":
        return progress if rising else 1.0 - progress
    if kind == "cosine":
        if rising:
            return 0.5 * (1.0 - torch.cos(math.pi * progress))
        return 0.5 * (1.0 + torch.cos(math.pi * float(num_cycles) * 2.0 * progress))
    # "1-sqrt"; clamp: identity where this phase is chosen, keeps sqrt real elsewhere.
    return 1.0 - torch.sqrt((1.0 - progress if rising else progress).clamp(min=0.0))


@attrs.frozen
class HFWarmupStableDecay:
    """Hugging Face's ``"warmup_stable_decay"``: ``get_wsd_schedule``.

    Three phases: a warm-up from ``peak * min_lr_ratio`` to ``peak`` over
    ``warmup_steps`` (shape ``warmup_type``), ``peak`` for ``stable_steps``, a decay to
    ``peak * min_lr_ratio`` over ``decay_steps`` (shape ``decay_type``); then ``peak *
    min_lr_ratio``. The shapes are ``"linear"``, ``"cosine"`` and ``"1-sqrt"``.

    Example:
        >>> s = HFWarmupStableDecay(1.0, 2, 1, 2, decay_type="linear")
        >>> [float(s(torch.tensor(k))) for k in range(7)]
        [0.0, 0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    warmup_steps: int = attrs.field(validator=count("warmup_steps", low=0))
    stable_steps: int = attrs.field(validator=count("stable_steps", low=0))
    decay_steps: int = attrs.field(validator=count("decay_steps", low=0))
    warmup_type: str = attrs.field(default="linear", validator=choice("warmup_type", _SHAPES))
    decay_type: str = attrs.field(default="cosine", validator=choice("decay_type", _SHAPES))
    min_lr_ratio: float = attrs.field(
        default=0.0, validator=number("min_lr_ratio", low=0.0, high=1.0)
    )
    num_cycles: float = attrs.field(default=0.5, validator=number("num_cycles", low=0.0))

    def __call__(self, step: Tensor) -> Tensor:
        w, s, d, m = self.warmup_steps, self.stable_steps, self.decay_steps, self.min_lr_ratio
        up = _shape(self.warmup_type, _ramp(step, w), rising=True)
        down_progress = steps(step - w - s) / float(max(1, d))
        down = _shape(self.decay_type, down_progress, rising=False, num_cycles=self.num_cycles)
        factor = torch.where(step < w + s + d, (down * (1.0 - m) + m).clamp(min=0.0), m)
        factor = torch.where(step < w + s, 1.0, factor)
        factor = torch.where(step < w, (up * (1.0 - m) + m).clamp(min=0.0), factor)
        return self.peak * factor


@attrs.frozen
class HFCosineWarmupWithMinLR:
    """Hugging Face's ``"cosine_warmup_with_min_lr"``:
    ``get_cosine_with_min_lr_schedule_with_warmup_lr_rate``.

    The warm-up is ``(k + 1) / warmup_steps`` of ``peak`` (or, with
    ``warmup_lr_rate=r``, ``r + (1 - r) k / (warmup_steps - 1)``), then the cosine of
    :class:`HFCosine` one step ahead: ``p = (k - warmup_steps + 1) / (total_steps -
    warmup_steps)``.

    Example:
        >>> s = HFCosineWarmupWithMinLR(1.0, 2, 4, min_lr_rate=0.1)
        >>> [round(float(s(torch.tensor(k))), 3) for k in range(5)]
        [0.5, 1.0, 0.55, 0.1, 0.55]
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    warmup_steps: int = attrs.field(validator=count("warmup_steps", low=0))
    total_steps: int = attrs.field(validator=count("total_steps"))
    num_cycles: float = attrs.field(default=0.5, validator=number("num_cycles", low=0.0))
    min_lr_rate: float = attrs.field(
        default=0.0, validator=number("min_lr_rate", low=0.0, high=1.0)
    )
    warmup_lr_rate: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(number("warmup_lr_rate", low=0.0, high=1.0)),
    )

    def __attrs_post_init__(self) -> None:
        _check_total(self)

    def __call__(self, step: Tensor) -> Tensor:
        k, w = steps(step), float(self.warmup_steps)
        if self.warmup_lr_rate is None:
            warm = (k + 1.0) / max(1.0, w)
        else:
            r = float(self.warmup_lr_rate)
            warm = r + (1.0 - r) * k / max(1, w - 1)
        progress = (k - w + 1.0) / max(1.0, float(self.total_steps) - w)
        wave = 0.5 * (1.0 + torch.cos(math.pi * float(self.num_cycles) * 2.0 * progress))
        wave = (wave * (1 - self.min_lr_rate) + self.min_lr_rate).clamp(min=0.0)
        return self.peak * torch.where(k < w, warm, wave)
