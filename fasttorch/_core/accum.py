"""The window's sums: the record a window keeps and the arithmetic that fills it.

:class:`AccumState` holds a window's gradient sums, weight and loss sum: the scratch
window of accumulation within a call (reused from call to call) and, across calls, the
sub-state ``state.substates[KEY]``. :func:`accumulate` adds one microbatch to it;
:func:`split` cuts a batch into the window's microbatches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree

from fasttorch import struct
from fasttorch._tree import add_weighted_aux, describe
from fasttorch.phases import Batch, GradOut, Tensors

__all__ = [
    "KEY",
    "AccumState",
    "accumulate",
    "empty_window",
    "meet_unused",
    "scratch_window",
    "split",
]

KEY = "grad_accumulate"
"""The sub-state key of an across-calls window (``state.substates[KEY]``)."""


class AccumState(struct.Record):
    """Sub-state of ``grad_accumulate(..., across_calls=True)``: the open window.

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

    # Donated windows are zeroed and refilled in place (commit): the same tensors on
    # every call, as the scratch window of accumulation within a call.
    kept_across_calls: ClassVar[bool] = True
    # Read by fasttorch.checkpoint (fasttorch.substates): saved per rank, with the
    # position in the window in the checkpoint's name and manifest.
    per_rank: ClassVar[bool] = True
    window_position: ClassVar[str] = "micro"

    def zeroed(self) -> AccumState:
        """A fresh, empty window shaped as this one."""
        return empty_window(self.grads, self.weight.device)


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


def scratch_window(
    memo: dict[str, Any], params: Mapping[str, torch.Tensor], device: torch.device
) -> AccumState:
    """A zeroed window for accumulation within one call, reused from call to call.

    A scratch buffer, not state: zeroing it is a memset, where fresh multi-MB
    tensors on every call cost page faults.
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


def meet_unused(window: frozenset[str] | None, micro: frozenset[str]) -> frozenset[str]:
    """The parameters unused by a window so far and by one more microbatch."""
    return micro if window is None else window & micro


def split(batch: Batch, n: int, api: str) -> list[Batch]:
    """Split every tensor of ``batch`` into ``n`` microbatches along dim 0."""
    leaves, spec = pytree.tree_flatten(batch)
    sizes = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.ndim > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"{api}: to split a batch into {n} microbatches every tensor needs the same "
            f"leading (batch) dimension; got {describe(batch)}"
        )
    (size,) = sizes
    if size < n:
        raise ValueError(f"{api}: a batch of {size} cannot be split into {n} microbatches")
    parts = [
        torch.tensor_split(x, n) if isinstance(x, torch.Tensor) and x.ndim > 0 else [x] * n
        for x in leaves
    ]
    return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(n)]


class Sums:
    """What the ``.grad`` engine sums over a window besides the gradients themselves."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype  # the loss sum's dtype; None: that of value * weight
        self.value: torch.Tensor | None = None  # sum of value * weight
        self.weight: torch.Tensor | None = None  # sum of the weights
        self.aux: Any = None  # sum of aux * weight
        self.count = 0

    def add(self, g: GradOut) -> None:
        """Add one microbatch's loss, weight and ``aux`` (running sums, in order)."""
        vw = (g.value if self.dtype is None else g.value.to(self.dtype)) * g.weight
        if self.value is None or self.weight is None:
            self.value, self.weight = vw, g.weight.clone()
        else:
            self.value.add_(vw)
            self.weight.add_(g.weight)
        self.aux = add_weighted_aux(self.aux, g.aux, g.weight)
        self.count += 1
