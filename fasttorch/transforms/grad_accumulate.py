"""``grad_accumulate``: one update from the gradients of ``n`` microbatches.

The transform owns its window's sums: :class:`AccumState` (a window's gradient sums,
weight and loss sum, with the kernels that add one microbatch to it and take its mean)
and, across calls, the sub-state that keeps it (``state.substates[KEY]``). It declares
the step's window (``n`` microbatches, within or across calls, its sums
:class:`AccumState`); :mod:`fasttorch.window`'s generic loop runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs
import torch

from fasttorch import _checks, struct
from fasttorch.phases import GradOut, Tensors
from fasttorch.state import TrainState
from fasttorch.steps import Step, check_wrap
from fasttorch.substates import SubState

__all__ = ["KEY", "SUBSTATE", "AccumState", "accumulate", "empty_window", "grad_accumulate"]

KEY = "grad_accumulate"
"""The sub-state key of an across-calls window (``state.substates[KEY]``)."""


class AccumState(struct.Record):
    """Sub-state of ``grad_accumulate(..., across_calls=True)``: the open window.

    Also the scratch window of accumulation within a call (reused from call to call).
    The window's loop (:func:`fasttorch.window.run`) reads it through
    :class:`fasttorch.window.WindowSums`: :meth:`add` one microbatch, :meth:`mean`
    of a full window, :meth:`zeroed` for the next.

    Per rank: each rank of a data-parallel run accumulates its own microbatches, so a
    checkpoint stores one window per rank (``per_rank``), and one saved inside a window
    is named after ``micro`` (``window_position``).
    """

    grads: Tensors
    weight: torch.Tensor
    value: torch.Tensor
    micro: int = struct.field(static=True, default=0)
    # Parameters no microbatch so far reached (None: no microbatch yet); a parameter
    # used by any microbatch of the window is updated, as torch.optim sees its .grad.
    unused: frozenset[str] | None = struct.field(static=True, default=None)

    # The sub-state key the window's loop keeps an across-calls window under.
    key: ClassVar[str] = KEY
    # Donated windows are zeroed and refilled in place (commit): the same tensors on
    # every call, as the scratch window of accumulation within a call.
    kept_across_calls: ClassVar[bool] = True
    # Read by fasttorch.checkpoint (fasttorch.substates): saved per rank, with the
    # position in the window in the checkpoint's name and manifest.
    per_rank: ClassVar[bool] = True
    window_position: ClassVar[str] = "micro"

    @classmethod
    def empty(cls, params: Mapping[str, torch.Tensor], device: torch.device) -> AccumState:
        """An empty window for gradients shaped as ``params`` (:func:`empty_window`)."""
        return empty_window(params, device)

    @classmethod
    def scratch(
        cls, memo: dict[str, Any], params: Mapping[str, torch.Tensor], device: torch.device
    ) -> AccumState:
        """A zeroed window for accumulation within one call, reused from call to call.

        A scratch buffer, not state: zeroing it is a memset, where fresh multi-MB
        tensors on every call cost page faults. ``memo``: the step's dict for it.
        """
        w: AccumState | None = memo.get("scratch")
        if (
            w is None
            or any(
                k not in w.grads
                or w.grads[k].shape != p.shape
                or w.grads[k].dtype != p.dtype
                or w.grads[k].device != p.device
                for k, p in params.items()
            )
            or len(w.grads) != len(params)
        ):
            w = memo["scratch"] = empty_window(params, device)
            return w
        torch._foreach_zero_(list(w.grads.values()))
        w.weight.zero_()
        w.value.zero_()
        return w

    def zeroed(self) -> AccumState:
        """A fresh, empty window shaped as this one."""
        return empty_window(self.grads, self.weight.device)

    def add(self, g: GradOut, n: int, in_place: bool) -> AccumState:
        """This window with microbatch ``g`` added (:func:`accumulate`)."""
        return accumulate(self, g, n, in_place)

    def mean(
        self, g: GradOut, divide: Callable[[list[torch.Tensor], torch.Tensor], list[torch.Tensor]]
    ) -> GradOut:
        """The full window's mean gradient (``g``: its last microbatch, without gradients).

        Each gradient sum divided by the window's total weight, through ``divide(sums,
        total)``, which the window's loop chooses (in place where the window is its to
        overwrite); the loss is the window's weighted mean.
        """
        total = self.weight.clone()  # the window may be zeroed in place after this
        ts = divide(list(self.grads.values()), total)
        return GradOut(
            grads=dict(zip(self.grads, ts)),
            value=self.value / total,
            weight=total,
            aux=g.aux,
            scale=g.scale,
            counted=g.counted,
            unused=self.unused or frozenset(),
        )


def empty_window(params: Mapping[str, torch.Tensor], device: torch.device) -> AccumState:
    """An empty window for gradients shaped as ``params``."""
    first = next(iter(params.values()), None)
    # new_zeros: under torch.func.vmap (fasttorch.vmapped) a zero per member, which the
    # in-place sums of the window need; otherwise the same 0-d float32 zero.
    zero = (
        torch.zeros((), dtype=torch.float32, device=device)
        if first is None
        else first.new_zeros((), dtype=torch.float32)
    )
    return AccumState(
        grads={k: torch.zeros_like(p) for k, p in params.items()},
        weight=zero,
        value=zero.clone(),
    )


def accumulate(acc: AccumState, g: GradOut, n: int, in_place: bool) -> AccumState:
    """The window ``acc`` with microbatch ``g`` added (its gradient sums in place if asked).

    ``g`` holds the gradients of (mean * mult / n); times (weight * n) they are those of
    (sum * mult), and the window's gradient is their total over its total weight. With
    equal microbatches whose size and count are powers of two, every multiply and divide
    is exact and the result is bit-identical to the loop that backpropagates loss / n.
    """
    w = g.weight
    fresh = list(g.grads.values())
    sums = list(acc.grads.values())
    factors = [w * n] * len(fresh)  # sums += fresh * (w * n): one kernel per tensor
    if in_place:  # the window is a temporary, or donated: no allocation per microbatch
        torch._foreach_addcmul_(sums, fresh, factors)
        acc.weight.add_(w)
        acc.value.add_(g.value * w)
        return acc
    sums = list(torch._foreach_addcmul(sums, fresh, factors))
    return AccumState(
        grads=dict(zip(acc.grads, sums)), weight=acc.weight + w, value=acc.value + g.value * w
    )


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

    Under ``compiled`` the microbatch is one graph reused ``n`` times, and the update
    is the other (on a CPU with an optimizer that runs torch's fused kernel, the
    default, it runs outside the graphs): the loop is never unrolled.

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
            window=attrs.evolve(step.window, n=n, across_calls=True, sums=AccumState),
            substate=SUBSTATE,
        )
    return step.with_phases(
        "grad_accumulate", window=attrs.evolve(step.window, n=n, sums=AccumState)
    )
