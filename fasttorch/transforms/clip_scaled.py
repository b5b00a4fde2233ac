"""``clip_scaled``: global-norm gradient clipping that is right under loss scaling."""

from __future__ import annotations

import math

import torch

from fasttorch import _checks
from fasttorch.phases import (
    GradOut,
    Metrics,
    clipped,
    no_state_read_after_inner,
    reciprocal,
    unscaled_norm,
)
from fasttorch.state import TrainState
from fasttorch.steps import Step, check_wrap

__all__ = ["clip_scaled"]


def clip_scaled(step: Step, max_norm: float) -> Step:
    """Clip the gradients to a global L2 norm of at most ``max_norm``.

    The norm is taken on the gradients as they are (still multiplied by the fp16 loss
    scale, if any) and divided by the scale; unscaling and clipping then fold into one
    multiply by ``min(1, max_norm / (norm + 1e-6)) / scale``. With a power-of-two
    scale this is bit-identical to the plain loop below; the reported
    ``metrics["grad_norm"]`` is the unscaled norm before clipping. It commutes with
    ``with_amp`` and ``grad_accumulate``: any order gives the same result.

    Equivalent to::

        scaler.unscale_(opt)  # with fp16 loss scaling
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed.
        max_norm: the largest global norm allowed; ``math.inf`` disables clipping and
            returns ``step`` unchanged.

    Returns:
        The step with clipping before the optimizer update.

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean() * 1e3
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> clipped = fasttorch.clip_scaled(fasttorch.step(loss_fn), 1.0)
        >>> state, metrics = clipped(state, torch.randn(8, 4))
        >>> bool(metrics["grad_norm"] > 1.0)  # the norm before clipping
        True
    """
    check_wrap(step, "clip_scaled")
    _checks.real(
        "clip_scaled",
        "max_norm",
        max_norm,
        low=0.0,
        low_open=True,
        finite=False,
        hint="(math.inf turns clipping off)",
    )
    if math.isinf(max_norm):
        return step
    inner = step.update
    limit = float(max_norm)

    @no_state_read_after_inner
    def update(state: TrainState, g: GradOut) -> tuple[TrainState, Metrics]:
        inv = None if g.scale is None else reciprocal(g.scale)
        norm = unscaled_norm(g, inv=inv)  # the reciprocal computed once
        coef = torch.clamp(limit / (norm + 1e-6), max=1.0)
        out = clipped(g, coef, norm=norm, inv=inv)
        del coef, inv, g  # not held through the update, where memory peaks
        return inner(state, out)

    return step.with_phases("clip_scaled", update=update)
