"""timm's ``CosineLRScheduler``, value for value.

``timm.scheduler.CosineLRScheduler`` warms up linearly under the cosine rather than
before it: for ``t < warmup_t`` the rate is ``warmup_lr_init + t (peak -
warmup_lr_init) / warmup_t``, and from ``warmup_t`` it is the cosine *of t itself*, whose
first ``warmup_t`` steps the warm-up hid (unless ``warmup_prefix=True``, which starts the
cosine at the end of the warm-up, as :func:`fasttorch.schedules.warmup` does). The
formula is timm's ``_get_lr`` with its float64 operations in the same order and
``torch.where`` instead of ``if``.
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor

from fasttorch.schedules._base import count, number, steps

__all__ = ["TimmCosine", "timm_cosine"]


@attrs.frozen
class TimmCosine:
    """The schedule built by :func:`timm_cosine`.

    Example:
        >>> [float(TimmCosine(1.0, 4)(torch.tensor(k))) for k in (0, 2, 4)]
        [1.0, 0.5, 0.0]
    """

    peak: float = attrs.field(validator=number("peak", low=0.0))
    t_initial: int = attrs.field(validator=count("t_initial"))
    lr_min: float = attrs.field(default=0.0, validator=number("lr_min", low=0.0))
    cycle_mul: float = attrs.field(default=1.0, validator=number("cycle_mul", low=0.0, strict=True))
    cycle_decay: float = attrs.field(default=1.0, validator=number("cycle_decay", low=0.0))
    cycle_limit: int = attrs.field(default=1, validator=count("cycle_limit"))
    warmup_t: int = attrs.field(default=0, validator=count("warmup_t", low=0))
    warmup_lr_init: float = attrs.field(default=0.0, validator=number("warmup_lr_init", low=0.0))
    warmup_prefix: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    k_decay: float = attrs.field(default=1.0, validator=number("k_decay", low=0.0, strict=True))

    def __call__(self, step: Tensor) -> Tensor:
        warm = self.warmup_lr_init + steps(step) * self._warmup_slope()
        t = step - self.warmup_t if self.warmup_prefix else step
        t = t.clamp(min=0)  # identity where the cosine is chosen (t >= warmup_t)
        k = self.k_decay
        if self.cycle_mul != 1:
            mul = float(self.cycle_mul)
            tf = steps(t)
            x = 1 - tf / self.t_initial * (1 - mul)
            # cycle_mul < 1: the cycles' lengths sum to t_initial / (1 - cycle_mul), after
            # which x <= 0 and timm's math.log raises; here the rate is lr_min from there.
            inside = x > 0
            i = torch.floor(torch.log(torch.where(inside, x, 1.0)) / math.log(mul))
            i = torch.where(inside, i, math.inf)
            i_safe = torch.where(inside, i, 0.0)
            t_i = torch.pow(mul, i_safe) * self.t_initial
            t_curr = tf - (1 - torch.pow(mul, i_safe)) / (1 - mul) * self.t_initial
            t_i_k = torch.pow(t_i, k)
        else:
            i_int = torch.div(t, self.t_initial, rounding_mode="floor")
            t_curr = steps(t - self.t_initial * i_int)
            i = i_int.to(t_curr.dtype)
            i_safe = i
            t_i_k = torch.full((), float(self.t_initial) ** k, dtype=t_curr.dtype, device=t.device)
        lr_max = self.peak * torch.pow(self.cycle_decay, i_safe)
        wave = 1 + torch.cos(math.pi * torch.pow(t_curr, k) / t_i_k)
        cosine = self.lr_min + 0.5 * (lr_max - self.lr_min) * wave
        after = torch.where(i < self.cycle_limit, cosine, self.lr_min)
        return torch.where(step < self.warmup_t, warm, after)

    def _warmup_slope(self) -> float:
        # timm: warmup_steps = (base - warmup_lr_init) / warmup_t, 1 without a warm-up.
        return (self.peak - self.warmup_lr_init) / self.warmup_t if self.warmup_t else 1.0


def timm_cosine(
    peak: float,
    t_initial: int,
    *,
    lr_min: float = 0.0,
    cycle_mul: float = 1.0,
    cycle_decay: float = 1.0,
    cycle_limit: int = 1,
    warmup_t: int = 0,
    warmup_lr_init: float = 0.0,
    warmup_prefix: bool = False,
    k_decay: float = 1.0,
) -> TimmCosine:
    """timm's ``CosineLRScheduler``, stepped per update (``t_in_epochs=False``).

    For ``t >= warmup_t`` (``t`` the step; ``t - warmup_t`` with ``warmup_prefix``) the
    rate is ``lr_min + (peak * cycle_decay**i - lr_min) * (1 + cos(pi * t_c**k_decay /
    T_i**k_decay)) / 2`` in cycle ``i < cycle_limit``, of length ``T_i = t_initial *
    cycle_mul**i``, ``t_c`` steps into it; ``lr_min`` once ``cycle_limit`` cycles are
    over. Below ``warmup_t`` it is the linear warm-up from ``warmup_lr_init``, which
    replaces the cosine's first ``warmup_t`` steps rather than delaying them.

    timm's ``t_in_epochs=True`` (its default: ``scheduler.step(epoch)`` once per epoch,
    the rate constant within an epoch) is ``per_epoch(timm_cosine(...),
    steps_per_epoch)`` with ``t_initial`` and ``warmup_t`` in epochs. timm's noise
    (``noise_range_t``) is not provided.

    Equivalent to::

        opt = torch.optim.SGD(model.parameters(), lr=peak)
        sched = timm.scheduler.CosineLRScheduler(opt, t_initial, lr_min=lr_min, ...,
                                                 t_in_epochs=False)
        num_updates = 0
        for batch in loader:                  # update k uses timm_cosine(...)(k)
            loss_fn(model, batch).backward()
            opt.step(); opt.zero_grad()
            num_updates += 1
            sched.step_update(num_updates=num_updates)

    Args:
        peak: the optimizer's learning rate (timm's base value), the first cycle's top.
        t_initial: the first cycle's length in steps, an int >= 1.
        lr_min: the rate at the end of each cycle and after the last.
        cycle_mul: each cycle is ``cycle_mul`` times as long as the one before, > 0.
        cycle_decay: each cycle's top is ``cycle_decay`` times the one before.
        cycle_limit: how many cycles run, an int >= 1.
        warmup_t: the warm-up's length in steps, an int >= 0.
        warmup_lr_init: the rate at step 0 with a warm-up.
        warmup_prefix: start the cosine when the warm-up ends (timm's ``warmup_prefix``).
        k_decay: timm's k-decay exponent, > 0 (1: the plain cosine).

    Returns:
        A :class:`TimmCosine` schedule.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> s = schedules.timm_cosine(1.0, 4, warmup_t=2, warmup_lr_init=0.1)
        >>> [round(float(s(torch.tensor(k))), 3) for k in range(6)]
        [0.1, 0.55, 0.5, 0.146, 0.0, 0.0]
    """
    return TimmCosine(
        peak,
        t_initial,
        lr_min,
        cycle_mul,
        cycle_decay,
        cycle_limit,
        warmup_t,
        warmup_lr_init,
        warmup_prefix,
        k_decay,
    )
