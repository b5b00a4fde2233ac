"""``grad_accumulate``: one update from the gradients of ``n`` microbatches.

The transform installs a runner (:func:`_within_call` or :func:`_across_calls`) that
splits the work into microbatches and keeps their gradient sums in a window
(:class:`AccumState`). Every microbatch but the last runs the microbatch kernel; the
last goes to the step's finisher, by default :func:`finish_window` (the same microbatch
kernel, then the window's update), or ``sync_on_last``'s. Under ``compiled`` those are
two graphs, each compiled once: the loop over microbatches is never unrolled.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree

from fasttorch import _checks, _scope, struct
from fasttorch.donation import commit
from fasttorch.phases import (
    Batch,
    GradOut,
    IntoGrad,
    Metrics,
    Tensors,
    add_weighted_aux,
    describe,
    divide_aux,
    module_tensors,
    skip_empty_window,
)
from fasttorch.state import TrainState, is_sharded
from fasttorch.steps import Step, apply_update, check_wrap
from fasttorch.substates import SubState

__all__ = ["KEY", "AccumState", "accumulate", "empty_window", "finish_window", "grad_accumulate"]

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
    _checks.count("grad_accumulate", "n", n)
    _checks.flag("grad_accumulate", "across_calls", across_calls)
    if n == 1:
        return step
    if across_calls:

        def init(state: TrainState) -> AccumState:
            return empty_window(state.params, state.device)

        return step.with_phases(
            "grad_accumulate",
            runner=functools.partial(_across_calls, n=n),
            substate=SubState(KEY, AccumState, init),
        )
    return step.with_phases("grad_accumulate", runner=functools.partial(_within_call, n=n))


# --------------------------------------------------------------------------- runners


def _within_call(
    step: Step, state: TrainState, batch: Batch, *, n: int
) -> tuple[TrainState, Metrics]:
    """Split ``batch`` into ``n`` microbatches and update once from their window."""
    micro = split(batch, n, step.name)
    whole = getattr(step.finish, "window", None)
    if whole is not None:
        done: tuple[TrainState, Metrics] | None = whole(step, state, micro)
        if done is not None:
            return done
    if step.is_eager and step.finish is None and module_tensors(state) is not None:
        return _window_in_module(step, state, micro)
    finish = step.finish or finish_window
    acc = _scratch_window(step, state.params, state.device)
    micro_kernel = _micro_kernel(step)
    aux_sum: Any = None
    unused: frozenset[str] | None = None
    for mb in micro[:-1]:
        acc, g = micro_kernel(state, acc, mb, n, True)
        aux_sum = add_weighted_aux(aux_sum, g.aux, g.weight)
        unused = meet_unused(unused, g.unused)
    acc = acc.replace(unused=unused)
    # The last microbatch adds to the window in place: note its weight first.
    before = acc.weight.clone() if aux_sum is not None else None
    new, metrics, _, w_last = finish(step, state, acc, micro[-1], n, False)
    if before is not None and "aux" in metrics:
        total = add_weighted_aux(aux_sum, metrics["aux"], w_last)
        weight = before + w_last
        metrics["aux"] = divide_aux(total, weight)
    return new, metrics


def _across_calls(
    step: Step, state: TrainState, batch: Batch, *, n: int
) -> tuple[TrainState, Metrics]:
    """One microbatch per call: accumulate into the state's window, update on the n-th."""
    if is_sharded(state.module):
        raise ValueError(
            f"step {step.name!r}: grad_accumulate(..., across_calls=True) cannot train a "
            "state sharded with FSDP2: between calls the window's gradients would live "
            "unsharded in the module's .grad, outside the state (neither pure nor "
            "checkpointed). Give each call the whole window's batch instead: "
            "grad_accumulate(step, n) splits it and reduces once, on the last microbatch"
        )
    window: AccumState = state.substates[KEY]
    inner = state.without_substate(KEY)
    # The kernels see the window at micro=0: a Python int that changes from call to call
    # would be a guard (torch 2.10's dynamo guards on it though no kernel reads it), so a
    # recompile per position. The position is set on the result here.
    plain = window.replace(micro=0)
    if window.micro + 1 < n:
        acc, g = _micro_kernel(step)(inner, plain.replace(unused=None), batch, n, step.donate)
        acc = acc.replace(micro=window.micro + 1, unused=meet_unused(window.unused, g.unused))
        new = inner.with_substate(KEY, acc)
        metrics: Metrics = {"loss": g.value}
        if g.aux is not None:
            metrics["aux"] = g.aux
        return new, metrics
    finish = step.finish or finish_window
    new, metrics, fresh, _ = finish(step, inner, plain, batch, n, True)
    return new.with_substate(KEY, fresh), metrics


# --------------------------------------------------------------------------- kernels


def _micro_kernel(step: Step) -> Any:
    return step.kernel("micro", lambda: functools.partial(_micro, step), cpp_wrapper=True)


def _micro(
    step: Step, state: TrainState, acc: AccumState, batch: Batch, n: int, donate_acc: bool
) -> tuple[AccumState, GradOut]:
    g = step.grad(step.loss, state, batch, 1.0 / n)
    # The gradients now live in the window; returning them too would make a
    # compiled graph keep every one of them alive as an output.
    return accumulate(acc, g, n, donate_acc), g.replace(grads={})


def finish_window(
    step: Step, state: TrainState, acc: Any, batch: Batch, n: int, reset: bool
) -> tuple[TrainState, Metrics, AccumState | None, torch.Tensor]:
    """The window's last microbatch, then its update (the default finisher).

    Two kernels, not one: the microbatch kernel is the one every other microbatch
    runs, so under ``compiled`` the forward and backward are compiled once, and the
    update graph holds no model code (half the compile time of a graph that repeats
    the forward and backward, at the cost of one more graph call per window).
    """
    # The kernel sees no ``unused`` (a static field that changes within a window would
    # recompile it); the window's is put on its result here, outside any graph.
    window_unused = acc.unused
    acc2, g = _micro_kernel(step)(
        state, acc.replace(unused=None), batch, n, not reset or step.donate
    )
    acc2 = acc2.replace(unused=meet_unused(window_unused, g.unused))
    close = step.kernel("close", lambda: functools.partial(_close, step))
    new, metrics, fresh = close(state, acc2, g, reset)
    return new, metrics, fresh, g.weight


def _close(
    step: Step, state: TrainState, acc: AccumState, g: GradOut, reset: bool
) -> tuple[TrainState, Metrics, AccumState | None]:
    """Apply a full window ``acc`` (``g``: its last microbatch, without gradients)."""
    # Within one call the window is a temporary; across calls it is the state's, and
    # ours to overwrite only when donated (it is zeroed for the next window below).
    owned = not reset or step.donate
    total = acc.weight.clone()  # the window is zeroed below when it is the state's
    g = g.replace(unused=acc.unused or frozenset())
    new, metrics = update_window(step, state, acc.grads, total, acc.value / total, total, g, owned)
    fresh = None
    if reset:
        fresh = commit(step.donate, acc, empty_window(acc.grads, total.device))
    return new, metrics, fresh


def update_window(
    step: Step,
    state: TrainState,
    sums: Tensors,
    divisor: torch.Tensor | None,
    value: torch.Tensor,
    total: torch.Tensor,
    g: GradOut,
    owned: bool,
) -> tuple[TrainState, Metrics]:
    """Update with the window's mean gradient ``sums / divisor`` (in place if owned).

    ``divisor=None``: ``sums`` are the mean already. ``value``: the window's mean loss.
    """
    ts = list(sums.values())
    if divisor is None:
        pass
    elif owned and not torch.compiler.is_compiling():
        # In place saves an allocation in eager mode. In a graph it would make the
        # graph write the quotients back into its input, the window: a copy of every
        # gradient that the next window's zeroing throws away.
        torch._foreach_div_(ts, divisor)
    else:
        ts = list(torch._foreach_div(ts, divisor))
    window = GradOut(
        grads=dict(zip(sums, ts)),
        value=value,
        weight=total,
        aux=g.aux,
        scale=g.scale,
        counted=g.counted,
        unused=g.unused,
    )
    return apply_update(step, state, skip_empty_window(window))


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


def _scratch_window(
    step: Step, params: Mapping[str, torch.Tensor], device: torch.device
) -> AccumState:
    """A zeroed window for accumulation within one call, reused from call to call.

    A scratch buffer, not state: zeroing it is a memset, where fresh multi-MB
    tensors on every call cost page faults.
    """
    memo = step.memo(KEY)
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


# --------------------------------------------------------------------------- eager window in .grad


def _window_in_module(
    step: Step, state: TrainState, micro: list[Batch]
) -> tuple[TrainState, Metrics]:
    """An eager within-call window whose gradients accumulate in the module's ``.grad``.

    The plain loop's memory profile: each microbatch's gradients are added into
    ``.grad`` by the backward as they are produced, and ``.grad`` is handed back as it
    was found (``None`` as a rule) after the update, so nothing stays allocated between
    steps. The ``.grad`` the module had before is restored, also on an error.
    """
    params = module_tensors(state)
    assert params is not None
    plist = list(params.values())
    saved = [p.grad for p in plist]
    into = IntoGrad()
    n = len(micro)
    try:
        for p in plist:
            p.grad = None
        aux_sum: Any = None
        value_sum: torch.Tensor | None = None
        total: torch.Tensor | None = None
        last: GradOut | None = None
        # The sums are built in place and each microbatch's outputs let go before the
        # next backward: no scalar more than the plain loop's is held where memory peaks.
        for i, mb in enumerate(micro):
            with _scope.scope(into=into):
                g = step.grad(step.loss, state, mb, 1.0 / n)
            aux_sum = add_weighted_aux(aux_sum, g.aux, g.weight)
            vw = g.value * g.weight
            if value_sum is None:
                value_sum = vw
            else:
                value_sum.add_(vw)
            del vw
            if total is not None:
                total.add_(g.weight)
            elif not into.same:  # the first weight that differs: the sum up to here
                assert into.first is not None
                total = _repeat_sum(into.first, i)
                total.add_(g.weight)
            if i == n - 1:
                last = g
            del g
        assert last is not None and value_sum is not None
        assert into.first is not None
        if total is None:  # every weight is into.first
            total = _repeat_sum(into.first, n)
        # A .grad still None after the window: no microbatch's backward reached it.
        unused = frozenset(k for k, p in params.items() if p.grad is None)
        sums = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in params.items()}
        if not into.same:  # with equal weights the divisor is exactly 1
            torch._foreach_div_(list(sums.values()), total / (into.first * n))
        value = value_sum / total
        last = last.replace(value=value, weight=total, unused=unused)
        del into, value_sum
    finally:
        for p, old in zip(plist, saved):
            p.grad = old
    # .grad holds sum_i (w_i / w_1) * grad_i / n; the window's mean gradient is
    # sum_i w_i * grad_i / sum_i w_i, that divided by sum_i w_i / (n * w_1) (1 when the
    # weights are equal).
    new, metrics = update_window(step, state, sums, None, value, total, last, True)
    if aux_sum is not None and "aux" in metrics:
        metrics["aux"] = divide_aux(aux_sum, total)
    return new, metrics


def _repeat_sum(w: torch.Tensor, k: int) -> torch.Tensor:
    """``w + w + ... + w`` (``k`` terms), added in order as a running sum would."""
    total = w.clone()
    for _ in range(k - 1):
        total.add_(w)
    return total
