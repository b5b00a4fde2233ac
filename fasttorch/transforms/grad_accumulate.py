"""``grad_accumulate``: one update from the gradients of ``n`` microbatches."""

from __future__ import annotations

from fasttorch.state import TrainState
from fasttorch.steps import AccumState, Accumulation, Step, check_wrap, empty_window

__all__ = ["grad_accumulate"]


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
      ``metrics = {"loss": ...}`` for their microbatch only.

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
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"grad_accumulate: n must be an integer >= 1, got {n!r}")
    if not isinstance(across_calls, bool):
        raise TypeError(f"grad_accumulate: across_calls must be a bool, got {across_calls!r}")
    if n == 1:
        return step
    inits = step.inits
    if across_calls:

        def init(state: TrainState) -> AccumState:
            return empty_window(state.params, state.device)

        inits = (*inits, ("grad_accumulate", init))
    return step.with_phases(
        "grad_accumulate", accumulation=Accumulation(n, across_calls), inits=inits
    )
