"""One call of a step, top to bottom: the :class:`Step` record, the driver, the window.

``fasttorch.steps`` and ``fasttorch.window`` are the public faces; the definitions live
here, in reading order:

* the window's sums: :class:`WindowSums`, what the loop needs of the record that holds
  a window's gradient sums, weight and loss sum, and of the kernels that add one
  microbatch to it and take its mean; the transform that accumulates declares it
  (``grad_accumulate``'s ``AccumState``, in :attr:`Window.sums`), so the loop stays
  generic; :func:`split` cuts a batch into the window's microbatches;
* the accumulation window: every call runs a window of ``n`` microbatches (one without
  ``grad_accumulate``), their gradients summed, each weighted by its sample (or token)
  count, and applied once. A step declares its window (:class:`Window`: ``n`` and
  ``across_calls``, and a :class:`Reduction` across ranks, ``sync_on_last``'s).
  :func:`run`, the step's default runner, is the one loop, over one of three engines:
  kernels (:func:`_in_kernels`: a microbatch kernel adds into the window's sums
  and a close kernel divides and updates; under ``compiled`` each is one graph,
  compiled once, so the loop is never unrolled; with a reduction the last microbatch
  is the reduction's), the module's ``.grad`` (:func:`_in_module`: eagerly over a
  donated state, each backward adds into ``.grad`` as ``loss.backward()`` does;
  :class:`InModule` says which parameters and how the sums become the mean), or
  sharded (the same ``.grad`` engine under FSDP2's hooks, ``Reduction.sharded``);
* the step: :class:`Step` is ``(state, batch) -> (state, metrics)``, its three phases
  (:mod:`fasttorch.phases`), its window, and three hooks through which a transform
  changes how a call runs, never a field of its own: ``runner(step, state, batch)``
  (default :func:`run`; ``compiled`` wraps it under CUDA graphs), ``jit(fn,
  cpp_wrapper=...)`` (identity; ``compiled`` installs ``torch.compile``) and
  ``hooks`` (``before``/``after`` each call, outside any graph: ``skip_nonfinite``'s
  host-side limit). The driver, :meth:`Step.__call__`, adds what no transform should
  own: checking the inputs, adding sub-states, the RNG and call scope, and donation.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, TypeAlias

import attrs
import torch
import torch.utils._pytree as pytree

from fasttorch import _checks
from fasttorch._checks import warn_once
from fasttorch._core.phases import (
    Batch,
    GradOut,
    GradPhase,
    IntoGrad,
    Loss,
    LossFn,
    LossPhase,
    Metrics,
    Tensors,
    UpdatePhase,
    add_weighted_aux,
    check_batch,
    describe,
    divide_aux,
    global_norm,
    grad_phase,
    loss_phase,
    module_tensors,
    opaque_update,
    outside_graphs,
    reads_no_state_after_inner,
    scale_grads,
    skip_empty_window,
    update_phase,
)
from fasttorch._core.reached import unreached, unreached_error
from fasttorch._core.state import (
    AFTER_FAILURE,
    Progress,
    TrainState,
    begin,
    check_alive,
    check_template,
    commit,
    current,
    is_sharded,
    kernel_ran,
    mark_donated,
    mark_failed,
    mark_template_ok,
    restore_training,
    scope,
    scoped_rng,
)
from fasttorch.optim._base import check_matches
from fasttorch.substates import SubState, any_declares, merge

__all__ = [
    "CallHook",
    "GradOut",
    "InModule",
    "Loss",
    "Reduction",
    "Runner",
    "Step",
    "Sums",
    "Window",
    "WindowSums",
    "apply_update",
    "check_wrap",
    "eager",
    "global_norm",
    "kernel",
    "meet_unused",
    "memo",
    "run",
    "scale_grads",
    "split",
    "step",
    "warn_once",
]


# --------------------------------------------------------------------------- the window's sums


class WindowSums(Protocol):
    """What the window's loop needs of a window's sums, declared by the transform that
    accumulates (``grad_accumulate``'s ``AccumState``, in :attr:`Window.sums`).

    A record: the gradient sums, total weight and weighted loss sum of the
    microbatches so far, the position in an across-calls window (``micro``), and the
    parameters no microbatch reached (``unused``). The class says where an
    across-calls window lives (``state.substates[key]``) and builds empty or reused
    windows; an instance adds a microbatch and takes the window's mean.
    """

    key: ClassVar[str]

    @property
    def grads(self) -> Tensors:
        """The gradient sums, by parameter name."""
        ...

    @property
    def weight(self) -> torch.Tensor:
        """The total weight (sample or token count) of the microbatches so far."""
        ...

    @property
    def value(self) -> torch.Tensor:
        """The weighted sum of their losses."""
        ...

    @property
    def micro(self) -> int:
        """The microbatches so far of an across-calls window."""
        ...

    @property
    def unused(self) -> frozenset[str] | None:
        """The parameters no microbatch so far reached (``None``: no microbatch yet)."""
        ...

    @classmethod
    def empty(cls, params: Mapping[str, torch.Tensor], device: torch.device) -> WindowSums:
        """An empty window for gradients shaped as ``params``."""
        ...

    @classmethod
    def scratch(
        cls, memo: dict[str, Any], params: Mapping[str, torch.Tensor], device: torch.device
    ) -> WindowSums:
        """A zeroed window for accumulation within one call, kept in ``memo``."""
        ...

    def zeroed(self) -> WindowSums:
        """A fresh, empty window shaped as this one."""
        ...

    def add(self, g: GradOut, n: int, in_place: bool) -> WindowSums:
        """This window with microbatch ``g`` (one of ``n``) added, in place if asked."""
        ...

    def mean(
        self, g: GradOut, divide: Callable[[list[torch.Tensor], torch.Tensor], list[torch.Tensor]]
    ) -> GradOut:
        """The full window's mean gradient, its sums divided through ``divide``."""
        ...

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` applied."""
        ...


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


# --------------------------------------------------------------------------- the window


class Reduction(Protocol):
    """How a window's gradients meet the other ranks' (``sync_on_last`` installs one)."""

    def last(
        self, step: Step, state: TrainState, acc: WindowSums | None, batch: Batch, n: int
    ) -> tuple[GradOut, GradOut]:
        """Run the window's last microbatch, reducing the window while its backward runs.

        ``acc``: the earlier microbatches' sums (``None`` in a window of one). Returns
        the microbatch's own result (without gradients) and the window's mean
        gradient over every rank, ready for the update phase.
        """
        ...

    def sharded(self, step: Step, state: TrainState, n: int) -> InModule:
        """The ``.grad`` engine's policy for a window over a state sharded with FSDP2."""
        ...


@attrs.frozen
class Window:
    """What a step declares about its window; :func:`run` runs it.

    ``n``: microbatches per update. ``across_calls``: each call brings one microbatch,
    and the sums live in ``state.substates[sums.key]`` between calls. ``reduce``: how
    the window's gradients meet the other ranks' (``None``: one process). ``sums``: the
    record of a window's sums and its kernels (:class:`WindowSums`), declared by the
    transform that sets ``n`` above one (``grad_accumulate``).
    """

    n: int = 1
    across_calls: bool = False
    reduce: Reduction | None = None
    # Not compared: two windows of the same n, form and reduction are the same window,
    # whatever record their sums are kept in.
    sums: type[WindowSums] | None = attrs.field(default=None, eq=False)

    def sums_of(self, owner: str) -> type[WindowSums]:
        """The declared sums, for a window of more than one microbatch (``owner``: who
        asks, for the error: the transform at wrap time, the step when it runs)."""
        if self.sums is None:
            raise TypeError(
                f"{owner}: the step's window has n={self.n} microbatches"
                f"{' across calls' if self.across_calls else ''} but declares no sums "
                "(Window.sums) to accumulate them in; a transform that sets the window's "
                "n declares them too, as grad_accumulate declares its AccumState"
            )
        return self.sums


# --------------------------------------------------------------------------- kernels


def eager(fn: Callable[..., Any], *, cpp_wrapper: bool = False) -> Callable[..., Any]:
    """The default ``jit`` hook: run ``fn`` as it is."""
    return fn


def kernel(
    step: Step, name: str, make: Callable[[], Callable[..., Any]], *, cpp_wrapper: bool = False
) -> Callable[..., Any]:
    """The function ``make()`` returns, passed through ``step.jit`` once per step and name.

    (:meth:`fasttorch.Step.kernel`.) Each pure function a window runs comes from here,
    so that under ``compiled`` each is compiled once and reused.
    """
    cache: dict[str, Callable[..., Any]] = step.__dict__.setdefault("_kernels", {})
    fn = cache.get(name)
    if fn is None:
        fn = step.jit(make(), cpp_wrapper=cpp_wrapper)
        if step.jit is not eager:
            fn = kernel_ran(fn)
        cache[name] = fn
    return fn


def update_outside(step: Step, state: TrainState) -> bool:
    """Whether ``step``, compiled, runs its update outside its graphs, as eagerly.

    It does where the update is opaque (:func:`fasttorch.phases.opaque_update`: a
    donated step on a CPU whose optimizer runs torch's fused kernel), and for an
    optimizer a compiler cannot trace (``from_torch(..., fused=True)``) in such a step
    (``phases.outside_graphs``). An opaque update's work is a few operators a compiler
    cannot speed up (the global norm, the clip's multiply, the fused kernel), and
    traced they cost the first step more than anything but the model: AOT autograd
    functionalizes the fused kernel's writes into every state tensor (a base and a
    copy back per tensor, which inductor's passes then remove tensor by tensor), and
    the graph's guards cover every state tensor. Measured at 12
    GPT layers, the first step took 37.0 s against 51.5 s with the update traced, the
    steady step no longer (docs/design.md, "The update on a CPU runs outside the
    graphs"). The eager and the compiled step then run the same update, with the bits
    of ``torch.optim.AdamW(fused=True)``.
    """
    return step.jit is not eager and outside_graphs(state, step.donate and step.in_place_update)


def update_kernel(
    step: Step, state: TrainState, name: str, make: Callable[[], Callable[..., Any]]
) -> Callable[..., Any]:
    """The kernel of a window's update: :func:`kernel`'s, or, where the update runs
    outside the graphs (:func:`update_outside`), ``make()`` as it is."""
    if update_outside(step, state):
        cache: dict[str, Callable[..., Any]] = step.__dict__.setdefault("_kernels", {})
        fn = cache.get(f"{name} (eager)")
        if fn is None:  # made once, as kernel() makes its own
            fn = cache[f"{name} (eager)"] = make()
        return fn
    return kernel(step, name, make)


def memo(step: Step, name: str) -> dict[str, Any]:
    """A dict owned by ``step`` for ``name``: buffers a window reuses across calls."""
    memos: dict[str, dict[str, Any]] = step.__dict__.setdefault("_memos", {})
    return memos.setdefault(name, {})


def apply_update(step: Step, state: TrainState, g: GradOut) -> Result:
    """The update phase, its result committed into ``state``'s tensors under donation.

    Eagerly, the phases write the donated state's tensors in place only where no
    update phase around the innermost one reads its input state after calling it
    (``Step.in_place_update``): otherwise a transform would see the new values
    through the old state, where a compiled step shows it the old ones.
    """
    in_place = step.donate and step.in_place_update
    g = g.replace(donated=in_place, opaque=opaque_update(state, in_place))
    if torch.compiler.is_compiling():
        out = step.update(state, g)
    else:
        with scope(in_place=in_place):
            out = step.update(state, g)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], TrainState)):
        raise TypeError(
            f"step {step.name!r}: its update phase returned {_returned(out)}; an update "
            "phase returns (new_state, metrics), a TrainState and a dict of tensors (the "
            "metrics of the phase it wraps, or {}). Return both, e.g. "
            "new, metrics = inner(state, g); return new.replace(...), metrics"
        )
    new, metrics = out
    return commit(step.donate, state, new), metrics


def _returned(out: Any) -> str:
    if isinstance(out, tuple):
        kinds = ", ".join(type(x).__name__ for x in out)
        return f"a tuple of {len(out)} ({kinds})"
    return f"a {type(out).__name__}"


# --------------------------------------------------------------------------- the loop


def run(step: Step, state: TrainState, batch: Batch) -> Result:
    """The default runner: one call's window of microbatches, then its update."""
    w = step.window
    # Host-side facts, read outside any graph: a graph traces this loop only when a
    # runner around it compiles the whole call (vmapped), where neither applies.
    eager_call = not torch.compiler.is_compiling()
    sharded = eager_call and is_sharded(state.module)
    if sharded and w.reduce is None:
        raise ValueError(
            f"step {step.name!r}: the state is sharded with FSDP2 (fully_shard), whose "
            "gradients are reduce-scattered by its own hooks, but the step has no "
            "transform that drives them. Wrap it with fasttorch.sync_on_last (after "
            'grad_accumulate, before compiled): docs/distributed.md, "Sharding"'
        )
    if w.across_calls:
        if not eager_call:
            return _across_calls(step, state, batch, w.n)
        with scope(state_window=True):
            return _across_calls(step, state, batch, w.n)
    micro = [batch] if w.n == 1 else split(batch, w.n, step.name)
    if sharded:
        assert w.reduce is not None
        return _in_module(step, state, micro, w.reduce.sharded(step, state, w.n))
    if w.reduce is None:
        if w.n == 1:
            if eager_call and update_outside(step, state):
                # The update runs outside the graphs: the graph is the gradients'.
                g = kernel(step, "grad", lambda: functools.partial(_grad, step), cpp_wrapper=True)
                return apply_update(step, state, g(state, batch))
            full = kernel(step, "full", lambda: functools.partial(_full, step))
            return full(state, batch)  # type: ignore[no-any-return]
        params = (
            module_tensors(state.module, state.params, state.buffers)
            if eager_call and step.jit is eager
            else None
        )
        if params is not None:
            return _in_module(step, state, micro, InModule(params))
    return _in_kernels(step, state, micro)


def _full(step: Step, state: TrainState, batch: Batch) -> Result:
    return apply_update(step, state, _grad(step, state, batch))


def _grad(step: Step, state: TrainState, batch: Batch) -> GradOut:
    return step.grad(step.loss, state, batch, 1.0)


def _in_kernels(step: Step, state: TrainState, micro: list[Batch]) -> Result:
    """A window whose sums are a record the microbatch kernel adds into."""
    n = len(micro)
    acc = None
    aux_sum: Any = None
    if n > 1:
        sums = step.window.sums_of(f"step {step.name!r}")
        acc = sums.scratch(memo(step, sums.key), state.params, state.device)
        unused: frozenset[str] | None = None
        for mb in micro[:-1]:
            acc, g = _micro_kernel(step)(state, acc, mb, n, True)
            aux_sum = add_weighted_aux(aux_sum, g.aux, g.weight)
            unused = meet_unused(unused, g.unused)
        acc = acc.replace(unused=unused)
    # The last microbatch adds to the window in place: note its weight first.
    before = acc.weight.clone() if acc is not None and aux_sum is not None else None
    new, metrics, _, w_last = _last(step, state, acc, micro[-1], n, False)
    if before is not None and "aux" in metrics:
        total = add_weighted_aux(aux_sum, metrics["aux"], w_last)
        metrics["aux"] = divide_aux(total, before + w_last)
    return new, metrics


def _across_calls(step: Step, state: TrainState, batch: Batch, n: int) -> Result:
    """One microbatch per call: accumulate into the state's window, update on the n-th."""
    if is_sharded(state.module):
        raise ValueError(
            f"step {step.name!r}: grad_accumulate(..., across_calls=True) cannot train a "
            "state sharded with FSDP2: between calls the window's gradients would live "
            "unsharded in the module's .grad, outside the state (neither pure nor "
            "checkpointed). Give each call the whole window's batch instead: "
            "grad_accumulate(step, n) splits it and reduces once, on the last microbatch"
        )
    key = step.window.sums_of(f"step {step.name!r}").key
    window: WindowSums = state.substates[key]
    inner = state.without_substate(key)
    # The kernels see the window at micro=0: a Python int that changes from call to call
    # would be a guard (torch 2.10's dynamo guards on it though no kernel reads it), so a
    # recompile per position. The position is set on the result here.
    plain = window.replace(micro=0)
    if window.micro + 1 < n:
        acc, g = _micro_kernel(step)(inner, plain.replace(unused=None), batch, n, step.donate)
        acc = acc.replace(micro=window.micro + 1, unused=meet_unused(window.unused, g.unused))
        new = inner.with_substate(key, acc)
        metrics: Metrics = {"loss": g.value}
        if g.aux is not None:
            metrics["aux"] = g.aux
        return new, metrics
    new, metrics, fresh, _ = _last(step, inner, plain, batch, n, True)
    return new.with_substate(key, fresh), metrics


def _last(
    step: Step, state: TrainState, acc: WindowSums | None, batch: Batch, n: int, reset: bool
) -> tuple[TrainState, Metrics, WindowSums | None, torch.Tensor]:
    """The window's last microbatch and its update.

    With ``reset`` the window is the state's and comes back zeroed (``fresh``). Also
    returns the last microbatch's weight (for the window's ``aux`` mean).
    """
    reduce = step.window.reduce
    if reduce is None:
        assert acc is not None
        return _close_window(step, state, acc, batch, n, reset)
    g, mean = reduce.last(step, state, acc, batch, n)
    apply = update_kernel(step, state, "apply", lambda: functools.partial(apply_update, step))
    new, metrics = apply(state, mean)
    fresh = None
    if reset and acc is not None:
        fresh = commit(step.donate, acc, acc.zeroed())
    return new, metrics, fresh, g.weight


def _micro_kernel(step: Step) -> Any:
    return kernel(step, "micro", lambda: functools.partial(_micro, step), cpp_wrapper=True)


def _micro(
    step: Step, state: TrainState, acc: WindowSums, batch: Batch, n: int, donate_acc: bool
) -> tuple[WindowSums, GradOut]:
    g = step.grad(step.loss, state, batch, 1.0 / n)
    if not torch.compiler.is_compiling() and current().state_window:
        begin()  # the donated state's own window is added into in place next
    # The gradients now live in the window; returning them too would make a
    # compiled graph keep every one of them alive as an output.
    return acc.add(g, n, donate_acc), g.replace(grads={})


def _close_window(
    step: Step, state: TrainState, acc: WindowSums, batch: Batch, n: int, reset: bool
) -> tuple[TrainState, Metrics, WindowSums | None, torch.Tensor]:
    """The window's last microbatch, then its update, on one process.

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
    close = update_kernel(step, state, "close", lambda: functools.partial(_close, step))
    new, metrics, fresh = close(state, acc2, g, reset)
    return new, metrics, fresh, g.weight


def _close(
    step: Step, state: TrainState, acc: WindowSums, g: GradOut, reset: bool
) -> tuple[TrainState, Metrics, WindowSums | None]:
    """Apply a full window ``acc`` (``g``: its last microbatch, without gradients)."""
    # Within one call the window is a temporary; across calls it is the state's, and
    # ours to overwrite only when donated (it is zeroed for the next window below).
    owned = not reset or step.donate
    opaque = owned and opaque_update(state, step.donate)

    def divide(ts: list[torch.Tensor], total: torch.Tensor) -> list[torch.Tensor]:
        if opaque:
            return ts  # the total is divided out by the optimizer's kernel (below)
        if owned and not torch.compiler.is_compiling():
            # In place saves an allocation in eager mode. In a graph it would make the
            # graph write the quotients back into its input, the window: a copy of every
            # gradient that the next window's zeroing throws away.
            torch._foreach_div_(ts, total)
        else:
            ts = list(torch._foreach_div(ts, total))
        return ts

    mean = acc.mean(g, divide)
    if opaque:
        # The sums carry the window's total weight, as a loss scale: the opaque
        # optimizer's one pass divides it out (phases.opaque_update).
        total = mean.weight
        mean = mean.replace(scale=total if mean.scale is None else mean.scale * total)
    new, metrics = apply_update(step, state, skip_empty_window(mean))
    fresh = None
    if reset:
        fresh = commit(step.donate, acc, acc.zeroed())
    return new, metrics, fresh


# --------------------------------------------------------------------------- in .grad


class InModule:
    """How the ``.grad`` engine runs a window; by default, on one process.

    ``params``: the module's parameters the window differentiates. ``into``: the call
    scope's marker for the gradient phase (:class:`~fasttorch.phases.IntoGrad`), which
    seeds each microbatch's backward relative to the first one's weight.
    """

    value_dtype: torch.dtype | None = None

    def __init__(self, params: Mapping[str, torch.Tensor], into: IntoGrad | None = None) -> None:
        self.params = dict(params)
        self.into = IntoGrad() if into is None else into

    def before(self, i: int, n: int) -> None:
        """Called before microbatch ``i`` of ``n`` runs."""

    def after(self) -> None:
        """Called once the microbatches ran or failed, ``.grad`` given back."""

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor the update sees for parameter or gradient ``t``."""
        return t

    def mean(
        self,
        step: Step,
        state: TrainState,
        grads: Tensors,
        unused: frozenset[str],
        sums: Sums,
        last: GradOut,
    ) -> GradOut:
        """The window's mean gradient from the sums in ``grads`` and ``sums``.

        ``.grad`` holds ``sum_i (w_i / w_1) * grad_i / n``; the mean gradient is
        ``sum_i w_i * grad_i / sum_i w_i``, that divided by ``sum_i w_i / (n * w_1)``
        (exactly 1 when the weights are equal: no division then).
        """
        into = self.into
        assert sums.value is not None and sums.weight is not None
        if not into.same:
            assert into.first is not None
            torch._foreach_div_(list(grads.values()), sums.weight / (into.first * sums.count))
        mean = GradOut(
            grads=grads,
            value=sums.value / sums.weight,
            weight=sums.weight,
            aux=last.aux,
            scale=last.scale,
            counted=last.counted,
            unused=unused,
        )
        return skip_empty_window(mean)


def _in_module(step: Step, state: TrainState, micro: list[Batch], how: InModule) -> Result:
    """A window whose gradients accumulate in the module's ``.grad``.

    The plain loop's memory profile: each microbatch's gradients are added into
    ``.grad`` by the backward as they are produced, and ``.grad`` is handed back as it
    was found (``None`` as a rule) after the window, also on an error, so nothing
    stays allocated between steps.
    """
    plist = list(how.params.values())
    saved = [p.grad for p in plist]
    n = len(micro)
    sums = Sums(how.value_dtype)
    last: GradOut | None = None
    try:
        for p in plist:
            p.grad = None
        # The sums are built in place and each microbatch's outputs let go before the
        # next backward: no scalar more than the plain loop's is held where memory peaks.
        for i, mb in enumerate(micro):
            how.before(i, n)
            with scope(into=how.into):
                g = step.grad(step.loss, state, mb, 1.0 / n)
            sums.add(g)
            if i == n - 1:
                last = g
            del g
        assert last is not None
        # A .grad still None after the window: no microbatch's backward reached it.
        unused = frozenset(k for k, p in how.params.items() if p.grad is None)
        if len(unused) == len(how.params):
            raise unreached(f"no backward of the window reached its {len(unused)}")
        grads = {
            k: how.local(p.grad) if p.grad is not None else torch.zeros_like(how.local(p))
            for k, p in how.params.items()
        }
    finally:
        for p, old in zip(plist, saved):
            p.grad = old
        how.after()
    apply = update_kernel(step, state, "apply", lambda: functools.partial(apply_update, step))
    new, metrics = apply(state, how.mean(step, state, grads, unused, sums, last))
    if sums.aux is not None and sums.weight is not None and "aux" in metrics:
        metrics["aux"] = divide_aux(sums.aux, sums.weight)
    return new, metrics


# --------------------------------------------------------------------------- the step

Result: TypeAlias = "tuple[TrainState, Metrics]"


class Runner(Protocol):
    """Runs one call of ``step``: its gradient phase(s) and its update."""

    def __call__(self, step: Step, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        """Return the new state and the metrics."""
        ...


class CallHook(Protocol):
    """Host-side code around each call of a step, outside any graph."""

    def before(self, step: Step, state: TrainState) -> None:
        """Called with the input state before anything runs; may raise."""
        ...

    def after(self, step: Step, new: TrainState) -> None:
        """Called with the new state once the call has returned it."""
        ...


@attrs.frozen(slots=False)
class Step:
    """A pure training step ``(state, batch) -> (state, metrics)``: phases and hooks.

    Build one with :func:`step`, change it with the transforms. Calling it checks its
    inputs, adds missing transform sub-states (``init``), then runs ``runner``. With
    ``donate=True`` (the default) the input state's tensors are updated in place and
    the input state may not be used again, also when the call raises after it may have
    written into them (docs/concepts.md, "Donation"); an error raised before (by the
    loss function, by a compiler refusing the graph) leaves it usable.

    ``in_place_update``: whether the update phase may write the donated state's tensors
    in place before the call commits; true while every update phase wrapped around the
    default one is declared with :func:`fasttorch.phases.no_state_read_after_inner`
    (set by :meth:`with_phases`). Otherwise the update runs out of place and the commit
    copies its results, so that a phase reading its input state after its inner one
    sees the old values, as in a compiled step.
    """

    loss: LossPhase
    grad: GradPhase
    update: UpdatePhase
    name: str
    doc: str | None = None
    inits: tuple[SubState, ...] = ()
    donate: bool = True
    transforms: tuple[str, ...] = ()
    runner: Runner = run
    window: Window = attrs.field(factory=Window)
    jit: Callable[..., Callable[..., Any]] = eager
    hooks: tuple[CallHook, ...] = ()
    in_place_update: bool = True

    def __attrs_post_init__(self) -> None:
        # Keep the wrapped loss function's name and docs, as functools.wraps would.
        self.__dict__["__name__"] = self.name
        self.__dict__["__qualname__"] = self.name
        self.__dict__["__doc__"] = self.doc

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        return _run(self, state, batch)

    def __repr__(self) -> str:
        # The phases and hooks are closures, whose reprs tell a reader nothing.
        subs = [d.key for d in self.inits]
        return (
            f"Step({self.name!r}, transforms={list(self.transforms)}, "
            f"substates={subs}, donate={self.donate})"
        )

    def init(self, state: TrainState) -> TrainState:
        """Return ``state`` with every sub-state this step needs (existing ones kept)."""
        check_alive(state, f"{self.name}.init")
        given = state  # each sub-state is built from the state as it was given
        for d in self.inits:
            if d.key not in given.substates:
                state = state.with_substate(d.key, d.build(given, self.name))
        return state

    def with_phases(
        self, transform: str, *, substate: SubState | tuple[SubState, ...] = (), **changes: Any
    ) -> Step:
        """A copy with some phases or hooks replaced, recording ``transform``.

        This is how transforms are written: check the order, then replace phases.
        ``substate``: the sub-state(s) the transform keeps in the state
        (:class:`fasttorch.substates.SubState`), added to the step's ``inits``; one
        declaration shared by two transforms is kept once.
        """
        check_wrap(self, transform)
        # Every field but the record of what was applied; a typo is named here, not
        # as an unexpected keyword argument of Step.__init__.
        valid = [f.name for f in attrs.fields(Step) if f.name != "transforms"]
        unknown = sorted(set(changes) - set(valid))
        if unknown:
            raise TypeError(
                f"{transform}: with_phases got {', '.join(map(repr, unknown))}, which is not "
                f"a phase or hook of a Step; valid names are {', '.join(valid)} (and "
                "substate= for the sub-state the transform keeps)"
            )
        if "window" in changes and changes["window"].n > 1:
            changes["window"].sums_of(transform)  # its sums declared: at wrap time
        if substate:
            changes["inits"] = merge(changes.get("inits", self.inits), substate, transform)
        if "update" in changes and "in_place_update" not in changes:
            changes["in_place_update"] = self.in_place_update and reads_no_state_after_inner(
                changes["update"]
            )
        return attrs.evolve(self, transforms=(*self.transforms, transform), **changes)

    @property
    def is_eager(self) -> bool:
        """Whether the step's functions run as they are (no ``jit`` hook installed)."""
        return self.jit is eager

    def kernel(
        self, name: str, make: Callable[[], Callable[..., Any]], *, cpp_wrapper: bool = False
    ) -> Callable[..., Any]:
        """The function ``make()`` returns, passed through ``jit`` once per step and name.

        The window (:mod:`fasttorch.window`) and the reductions get their pure functions
        here, so that under ``compiled`` each is compiled once and reused (the cache is
        :func:`fasttorch.window.kernel`'s). ``cpp_wrapper``: a hint to the compiler that
        this function holds the model's forward and backward (see ``compiled``).
        """
        return kernel(self, name, make, cpp_wrapper=cpp_wrapper)

    def memo(self, name: str) -> dict[str, Any]:
        """A dict owned by this step for ``name``: buffers a runner reuses across calls."""
        return memo(self, name)


def step(loss_fn: LossFn, *, donate: bool = True) -> Step:
    """Build a pure training step from a loss function.

    ``loss_fn(apply, batch)`` gets ``apply``, the model's forward with the state's
    parameters (``torch.func.functional_call``), and the batch; it returns the mean loss
    (a 0-d tensor), a ``(loss, aux)`` pair, or a :class:`Loss`. The step computes the
    gradients with ``torch.autograd.grad``, updates with the state's optimizer,
    and returns the new state and metrics (``loss``, ``grad_norm``, ``lr`` as tensors).

    Equivalent to the plain PyTorch loop body::

        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    Args:
        loss_fn: ``(apply, batch) -> loss | (loss, aux) | Loss``.
        donate: update the input state's tensors in place (memory 1x) and mark it
            dead, as ``jax.jit(donate_argnums=0)``, also when the call fails after it
            may have written into them (an error of the loss function does not).
            ``False`` leaves every input state untouched and usable, whether the call
            returns or raises (copying semantics, for tests and comparisons).

    Raises:
        TypeError: ``loss_fn`` is not callable, or cannot be called as
            ``loss_fn(apply, batch)`` (checked here when its signature can be read).

    Calling the step raises ``ValueError``, in every mode, when the loss never calls
    ``apply`` (it calls ``model(x)`` or a ``copy.deepcopy(model)`` instead) or reaches
    none of the state's parameters, and (eagerly, when the state's tensors are not the
    model's own) when it mixes ``apply`` with the model's own parameters: call the model
    as ``apply(x)``; and when the state's tensors do not fit its
    module (names or shapes of another model). Parameters the loss does not reach are
    not updated, as ``torch.optim`` skips a ``grad`` of ``None`` (docs/concepts.md).

    Example:
        >>> import torch, fasttorch
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Linear(4, 1)
        >>> def loss_fn(apply, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(apply(x), y)
        >>> state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
        >>> train_step = fasttorch.step(loss_fn)
        >>> batch = (torch.randn(8, 4), torch.randn(8, 1))
        >>> state, metrics = train_step(state, batch)
        >>> sorted(metrics), int(state.step)
        (['grad_norm', 'loss', 'lr'], 1)
    """
    if not callable(loss_fn):
        raise TypeError(f"fasttorch.step expects a loss function, got {type(loss_fn).__name__}")
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    check_signature(loss_fn, name)
    _checks.flag("fasttorch.step", "donate", donate)
    return Step(
        loss=loss_phase(loss_fn),
        grad=grad_phase,
        update=update_phase,
        name=name,
        doc=getattr(loss_fn, "__doc__", None),
        donate=donate,
    )


# --------------------------------------------------------------------------- checks


def check_signature(loss_fn: Callable[..., Any], name: str) -> None:
    """Raise if ``loss_fn`` cannot be called as ``loss_fn(apply, batch)``.

    Callables whose signature ``inspect`` cannot read (some builtins) are accepted.
    """
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, None)
    except TypeError as e:
        raise TypeError(
            f"fasttorch.step: the loss function {name}{sig} cannot be called as "
            f"{name}(apply, batch) ({e}). A loss function takes two arguments: apply, the "
            "model's forward (call it as apply(x)), and batch, whatever one call of the "
            "step is given; unpack the batch inside, e.g. def loss_fn(apply, batch): "
            "x, y = batch; return torch.nn.functional.mse_loss(apply(x), y)"
        ) from None


def check_wrap(step: Any, transform: str) -> None:
    """Raise at wrap time if ``transform`` cannot wrap ``step``; see docs/composition.md."""
    if not isinstance(step, Step):
        if callable(getattr(step, "map_steps", None)):  # fasttorch.several: a step per member
            raise TypeError(
                f"{transform} wraps one model's step, not a several-model step ({step!r}): "
                f"apply it to each member's step before several(), e.g. several({{'d': "
                f"{transform}(d_step, ...), 'g': {transform}(g_step, ...)}}). Only compiled "
                "takes the whole (it compiles each member's step)"
            )
        kind = getattr(step, "__name__", type(step).__name__)
        raise TypeError(
            f"{transform} wraps the phases of a step built by fasttorch.step(loss_fn); "
            f"got {kind!r}. Only compiled and profiled accept any (state, batch) callable"
        )
    chain = " -> ".join(step.transforms) or "none"
    if transform in step.transforms:
        raise ValueError(
            f"{transform} is already applied to this step (transforms so far: {chain}); "
            "apply it once"
        )
    if not step.is_eager:
        raise ValueError(
            f"{transform} cannot wrap a compiled step (transforms so far: {chain}): "
            f"compiled must be the outermost transform. Write "
            f"compiled({transform}(step, ...)) instead"
        )


# --------------------------------------------------------------------------- driver


def _unshared(new: TrainState, olds: tuple[TrainState, ...]) -> TrainState:
    """``new`` with copies of the tensors it shares with ``olds`` (copying semantics).

    A phase may pass a tensor through unchanged (the hyperparameters, a sub-state no
    transform updates): under ``donate=False`` writing into the new state's tensor must
    not change the old state, nor the other way round.
    """
    old_ids = {id(t) for o in olds for t in pytree.tree_leaves(o) if isinstance(t, torch.Tensor)}
    leaves, spec = pytree.tree_flatten(new)
    if not any(id(t) in old_ids for t in leaves):
        return new
    fresh = [t.clone() if isinstance(t, torch.Tensor) and id(t) in old_ids else t for t in leaves]
    out: TrainState = pytree.tree_unflatten(fresh, spec)
    return out


def _run(step: Step, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    check_alive(state, step.name)
    with _device_lock(state.device):
        return _run_locked(step, state, batch)


def _intact_note(step: Step, state: TrainState) -> str:
    """The note on an error raised before a donating call wrote into its state."""
    note = (
        f"fasttorch: the state passed to step {step.name!r} is still usable: the call "
        "failed before writing into it"
    )
    if not (step.is_eager and state.buffers):
        return note
    # Not told apart by version counters: BatchNorm's kernels write its running
    # statistics without bumping them.
    return (
        f"{note}, except that the forward may have updated buffers in place before the "
        "error (BatchNorm running statistics), as model(x) does in a plain loop. Build "
        "the step with donate=False to keep them too"
    )


_LOCKS: dict[torch.device, threading.RLock] = {}
_LOCKS_LOCK = threading.Lock()


def _device_lock(device: torch.device) -> threading.RLock:
    """The lock that serializes the calls of steps on ``device`` across threads.

    A call installs its state's generator in the device's global generator, reuses
    its step's scratch buffers (``Step.memo``) and swaps the state's tensors into the
    shared template module (``functional_call``): two threads interleaving those would
    mix each other's tensors. Calls from one thread never wait (re-entrant).
    """
    lock = _LOCKS.get(device)
    if lock is None:
        with _LOCKS_LOCK:
            lock = _LOCKS.setdefault(device, threading.RLock())
    return lock


def _refuse_population(name: str, transforms: tuple[str, ...], state: TrainState) -> None:
    """Raise if step ``name``, which trains one model, is given a population: a state
    whose sub-states declare ``stacks_members`` (every leaf stacked by member)."""
    if any_declares(state.substates, "stacks_members") and "vmapped" not in transforms:
        n = state.step.shape[0] if state.step.dim() else "n"
        raise ValueError(
            f"step {name!r} trains one model, but the state is a population of {n} "
            f"members (every tensor stacked along a leading dimension of {n}). Wrap the "
            f"step: fasttorch.vmapped(step, {n}) trains every member in one call; or train "
            "one member alone: fasttorch.member(population, i)"
        )


def _run_locked(step: Step, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    _refuse_population(step.name, step.transforms, state)
    for hook in step.hooks:
        hook.before(step, state)
    device = state.device
    check_batch(batch, device, step.name, state.params)
    check_template(state, step.name)
    check_matches(state.optimizer, state.opt_state, state.params, f"step {step.name!r}")
    given = state
    state = step.init(state)
    if not state.module.training:  # left in evaluation mode: the modes it trains in
        restore_training(state.module)
    if not step.donate:
        # BatchNorm updates running stats in place: work on copies to leave inputs intact.
        state = state.replace(buffers={k: b.clone() for k, b in state.buffers.items()})
    progress = Progress()
    population = any_declares(state.substates, "stacks_members")
    # A step run by another driver (a member's step in fasttorch.several) reports to it
    # whether it may have written; that driver marks and notes the state it was given.
    outer = current().progress
    try:
        with (
            scope(in_place=step.donate, progress=progress),
            scoped_rng(state.rng, device, install=not population) as rng_now,
        ):
            new, metrics = step.runner(step, state, batch)
            rng = rng_now()
            if rng is None:  # one generator per member: the runner advanced them itself
                rng = new.rng
            elif step.donate and rng.shape == state.rng.shape:
                rng = state.rng.copy_(rng)  # the state's own tensor takes the advanced state
    except BaseException as e:
        if outer is not None and progress.began:
            outer.began = True
        if step.donate and progress.began:
            # Part of the results may already be in the input state's tensors (a
            # compiled kernel writes a counter before the one that fails, an eager
            # commit fails part-way): no longer a consistent state.
            mark_failed(given, f"step {step.name!r}", e)
            if state is not given:
                mark_failed(state, f"step {step.name!r}", e)
            if outer is None:
                e.add_note(
                    f"fasttorch: the state passed to step {step.name!r} was donated and is "
                    f"now unusable (DonatedStateError): {AFTER_FAILURE}"
                )
        elif step.donate and outer is None:
            e.add_note(_intact_note(step, state))
        clear = unreached_error(e)
        if clear is not None:  # raised while tracing a graph: the error as eager raises it
            for note in getattr(e, "__notes__", ()):
                clear.add_note(note)
            raise clear from e
        raise
    new = new.replace(rng=rng)
    if step.donate:
        mark_donated(given, f"step {step.name!r}")
        if state is not given:
            mark_donated(state, f"step {step.name!r}")
    else:
        new = _unshared(new, (given, state))
    mark_template_ok(new)
    for hook in step.hooks:
        hook.after(step, new)
    return new, metrics
