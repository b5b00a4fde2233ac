"""``scale_loss``: a constant weight on the loss before backward."""

from __future__ import annotations

from fasttorch import _checks
from fasttorch.phases import Batch, GradOut, LossPhase
from fasttorch.state import TrainState
from fasttorch.steps import Step, check_wrap

__all__ = ["scale_loss"]


def scale_loss(step: Step, factor: float) -> Step:
    """Backpropagate ``factor * loss`` instead of ``loss``.

    The gradients, and so the update, are those of the weighted loss: for a loss term
    weighted inside a larger objective, for a sum-reduced loss written as a mean (``factor``
    = the batch size), or for a reference that scales its loss. The reported
    ``metrics["loss"]`` stays the loss function's own value, and ``grad_norm`` is the norm
    of the weighted gradients. It multiplies into the same factor as ``grad_accumulate``'s
    ``1/n`` and the fp16 loss scale, so it composes with every transform in any order.

    Equivalent to::

        loss = loss_fn(model, batch)
        (loss * factor).backward()
        opt.step()

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed.
        factor: a finite number other than 0; ``1`` returns ``step`` unchanged.

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> weighted = fasttorch.scale_loss(fasttorch.step(loss_fn), 0.5)
        >>> state, metrics = weighted(state, torch.randn(8, 4))
        >>> int(state.step)
        1
    """
    check_wrap(step, "scale_loss")
    value = _checks.real("scale_loss", "factor", factor)
    if value == 0:
        raise ValueError(
            "scale_loss: factor must be finite and not 0 (0 would train on nothing); got 0"
        )
    if factor == 1:
        return step
    inner = step.grad
    weight = value

    def grad(loss: LossPhase, state: TrainState, batch: Batch, mult: object) -> GradOut:
        return inner(loss, state, batch, mult * weight)  # type: ignore[operator]

    return step.with_phases("scale_loss", grad=grad)
