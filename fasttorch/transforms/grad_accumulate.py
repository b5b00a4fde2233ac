"""``grad_accumulate``: one update from the gradients of ``n`` microbatches.

The transform declares the step's window (``n`` microbatches, within or across calls);
:mod:`fasttorch.window` runs it, and keeps an across-calls window in the sub-state
:class:`AccumState` (``state.substates[KEY]``).
"""

from __future__ import annotations

import attrs

from fasttorch import _checks
from fasttorch.state import TrainState
from fasttorch.steps import Step, check_wrap
from fasttorch.substates import SubState
from fasttorch.window import KEY, AccumState, accumulate, empty_window

__all__ = ["KEY", "SUBSTATE", "AccumState", "accumulate", "empty_window", "grad_accumulate"]


def _init(state: TrainState) -> AccumState:
    return empty_window(state.params, state.device)


SUBSTATE = SubState(KEY, AccumState, _init)
"""The across-calls window's declaration: ``state.substates[KEY]``, an empty window."""


def grad_accumulate(step: Step, n: int, *, across_calls: bool = False) -> Step:
    """Accumulate gradients over ``n`` microbatches before each optimizer update.

    The update uses the mean gradient over every sample (or token, with
    ``fasttorch.Loss(..., weight=count)``) of the whole window, also when microbatches
    differ in size: each microbatch's gradient is weighted by its own count and the
    total is divided by the window's count, so the 2024 "loss divided by the number of
    microbatches" bug cannot happen. Nothing is read back to the host.

    Two forms:

    * ``across_calls=False``: each call gets the whole batch, splits it into ``n``
      microbatches along dim 0 (``torch.tensor_split``) and updates once.
    * ``across_calls=True``: each call gets one microbatch; calls ``1..n-1`` only
      accumulate (into ``state.substates["grad_accumulate"]``), call ``n`` updates, as
      Lightning's ``accumulate_grad_batches``. Non-updating calls return
      ``metrics = {"loss": ...}`` for their microbatch only; the updating call's
      ``metrics["loss"]`` is the window's mean (its ``n`` microbatch losses weighted
      by their counts), not its own microbatch's loss, which a script logging
      ``loss.item()`` beside ``opt.step()`` reports.

    Under ``compiled`` the microbatch is one graph reused ``n`` times, and the last
    microbatch plus the update is the other: the loop is never unrolled.

    Equivalent to (equal microbatches)::

        for micro in batch.tensor_split(n):
            loss = loss_fn(model, micro) / n
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed.
        n: microbatches per update; ``1`` returns ``step`` unchanged.
        across_calls: accumulate across ``n`` calls instead of within one call.

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(apply(x), y)
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 1), fasttorch.optim.sgd(0.1))
        >>> accumulated = fasttorch.grad_accumulate(fasttorch.step(loss_fn), 4)
        >>> state, metrics = accumulated(state, (torch.randn(16, 4), torch.randn(16, 1)))
        >>> int(state.step)
        1
    """
    check_wrap(step, "grad_accumulate")
    _checks.count("grad_accumulate", "n", n)
    _checks.flag("grad_accumulate", "across_calls", across_calls)
    if n == 1:
        return step
    if across_calls:
        return step.with_phases(
            "grad_accumulate",
            window=attrs.evolve(step.window, n=n, across_calls=True),
            substate=SUBSTATE,
        )
    return step.with_phases("grad_accumulate", window=attrs.evolve(step.window, n=n))
