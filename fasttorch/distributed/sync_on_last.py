"""``sync_on_last``: data-parallel gradients, reduced once per accumulation window."""

from __future__ import annotations

import datetime
from typing import Any

import attrs

from fasttorch import _checks
from fasttorch.distributed.fsdp import ShardedWindow
from fasttorch.distributed.reducer import SyncConfig, WindowReduction
from fasttorch.phases import Batch, GradOut, Loss, Tensors
from fasttorch.state import TrainState
from fasttorch.steps import Step, check_wrap
from fasttorch.window import InModule, WindowSums
from fasttorch.window import Step as WindowStep

__all__ = ["sync_on_last"]


class _Sync(SyncConfig):
    """The reduction ``sync_on_last`` installs in the step's window.

    A replicated state: the window's last microbatch runs with the reducer's hooks
    (bucketed all-reduce while its backward runs). A state sharded with FSDP2: the
    window runs in the module's ``.grad`` with FSDP2's reduce-scatter on the last
    microbatch (:class:`~fasttorch.distributed.fsdp.ShardedWindow`).
    """

    def last(
        self, step: WindowStep, state: TrainState, acc: WindowSums | None, batch: Batch, n: int
    ) -> tuple[GradOut, GradOut]:
        """Run the last microbatch eagerly with the reducer's hooks; reduce the window.

        The backward runs outside any graph (its hooks launch the collectives while it
        goes on); under ``compiled`` the forward and the update are graphs.
        """
        reduction = WindowReduction(self, state.params, acc, n, state.step)
        forward = step.kernel("forward", lambda: step.loss)
        handles: list[Any] = []

        def loss(state: TrainState, params: Tensors, buffers: Tensors, batch: Batch) -> Loss:
            out: Loss = forward(state, params, buffers, batch)
            handles.extend(reduction.attach(params, out))
            return out

        try:
            g = step.grad(loss, state, batch, 1.0 / n)
        finally:
            for h in handles:
                h.remove()
        return g, reduction.finish(g)

    def sharded(self, step: WindowStep, state: TrainState, n: int) -> InModule:
        """FSDP2's reduce-scatter, once per window, around the ``.grad`` engine."""
        return ShardedWindow(self, step, state, n)


def sync_on_last(
    step: Step,
    *,
    group: Any = None,
    bucket_mb: float = 25.0,
    timeout: datetime.timedelta = datetime.timedelta(minutes=5),
) -> Step:
    """Average gradients across ranks, on the last microbatch of each window only.

    Every rank runs the same step on its own shard of the global batch. Microbatches
    before the last accumulate locally with no communication; during the last backward
    each parameter's gradient (plus the accumulated window) goes into a bucket whose
    asynchronous ``all_reduce`` starts as soon as the bucket is full, overlapping the
    rest of backward. The window's sample (or token) counts are reduced too, so the
    update uses the mean over the whole global batch, equal to one process training on
    all of it, whatever the sizes of the ranks' microbatches. Without
    ``grad_accumulate`` it reduces every step. An inf/NaN on any rank reaches every
    rank's sum, so with fp16 every rank skips the step and backs off the scale alike.
    A parameter that no rank's window reaches is not updated (no momentum, no weight
    decay), and one that some rank reaches gets the average with the others' zeros, as
    with DDP's ``find_unused_parameters=True`` (docs/concepts.md, "Parameters a step
    does not use"); nothing is read back to the host for it.

    A state sharded with FSDP2 (its module passed through ``fully_shard``) trains
    with the same transform: FSDP2 all-gathers and reduce-scatters, once per window on
    the last microbatch, and every rank agrees on the global norm, so clipping and
    skipping act alike everywhere (docs/distributed.md, "Sharding").

    Equivalent to (DDP, equal shards)::

        for i, micro in enumerate(microbatches):
            ctx = ddp.no_sync() if i < n - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(ddp, micro) / n).backward()
        opt.step()

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed (any order
            with ``with_amp``, ``grad_accumulate``, ``clip_scaled``; before ``compiled``).
        group: the process group (default: the world).
        bucket_mb: bucket size in MiB.
        timeout: how long a rank waits for the others before it raises
            :class:`DistributedStepError` instead of hanging.

    Example:
        >>> import torch, fasttorch
        >>> from fasttorch import sync_on_last
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> step = sync_on_last(fasttorch.grad_accumulate(fasttorch.step(loss_fn), 4))
        >>> step.transforms
        ('grad_accumulate', 'sync_on_last')
    """
    check_wrap(step, "sync_on_last")
    _checks.real(
        "sync_on_last",
        "bucket_mb",
        bucket_mb,
        low=0.0,
        low_open=True,
        finite=False,
        rule="a number > 0",
    )
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"sync_on_last: timeout must be a datetime.timedelta, got {timeout!r}")
    reduce = _Sync(group=group, bucket_mb=float(bucket_mb), timeout=timeout)
    return step.with_phases("sync_on_last", window=attrs.evolve(step.window, reduce=reduce))
