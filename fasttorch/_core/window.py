"""The accumulation window: how one call of a step runs its gradients and its update.

Every call runs a window of ``n`` microbatches (one without ``grad_accumulate``): their
gradients are summed, each weighted by its sample (or token) count, and applied once.
A step declares its window (:class:`Window`): ``n`` and ``across_calls``
(``grad_accumulate``), and a :class:`Reduction` across ranks (``sync_on_last``).
:func:`run`, the step's default runner, is the one loop, over one of three engines:

* kernels (:func:`_in_kernels`): a microbatch kernel adds into a window record
  (:class:`~fasttorch._accum.AccumState`) and a close kernel divides and updates;
  under ``compiled`` each is one graph, compiled once, so the loop is never unrolled.
  With a reduction the last microbatch is the reduction's (``Reduction.last``: its
  backward hands each gradient to the bucketed all-reduce).
* the module's ``.grad`` (:func:`_in_module`): eagerly over a donated state, each
  microbatch's backward adds into ``.grad`` as ``loss.backward()`` does, the plain
  loop's memory profile. :class:`InModule` says which parameters, how each microbatch
  begins and how the sums become the mean gradient.
* sharded: the same ``.grad`` engine under FSDP2's hooks, with the reduction's
  :class:`InModule` (``Reduction.sharded``: one reduce-scatter, on the last microbatch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import torch

from fasttorch import _opaque, _scope
from fasttorch._accum import (
    KEY,
    AccumState,
    Sums,
    accumulate,
    empty_window,
    meet_unused,
    scratch_window,
    split,
)
from fasttorch._engine import IntoGrad, module_tensors
from fasttorch._reached import unreached
from fasttorch._tree import add_weighted_aux, divide_aux
from fasttorch.phases import (
    Batch,
    GradOut,
    GradPhase,
    LossPhase,
    Metrics,
    Tensors,
    UpdatePhase,
    opaque_update,
    skip_empty_window,
)
from fasttorch.state import TrainState, commit, is_sharded

__all__ = [
    "InModule",
    "Reduction",
    "Sums",
    "Window",
    "apply_update",
    "eager",
    "kernel",
    "memo",
    "run",
]


class Step(Protocol):
    """What the window reads of a :class:`fasttorch.steps.Step`.

    A protocol rather than the class, because ``steps`` imports this module (no import
    circle, even for annotations: tests/test_import_cycles.py).
    """

    @property
    def name(self) -> str: ...
    @property
    def donate(self) -> bool: ...
    @property
    def window(self) -> Window: ...
    @property
    def loss(self) -> LossPhase: ...
    @property
    def grad(self) -> GradPhase: ...
    @property
    def update(self) -> UpdatePhase: ...
    @property
    def jit(self) -> Callable[..., Callable[..., Any]]: ...
    @property
    def is_eager(self) -> bool: ...
    @property
    def in_place_update(self) -> bool: ...
    def kernel(
        self, name: str, make: Callable[[], Callable[..., Any]], *, cpp_wrapper: bool = False
    ) -> Callable[..., Any]: ...


Result = tuple[TrainState, Metrics]


class Reduction(Protocol):
    """How a window's gradients meet the other ranks' (``sync_on_last`` installs one)."""

    def last(
        self, step: Step, state: TrainState, acc: AccumState | None, batch: Batch, n: int
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
    and the sums live in ``state.substates[KEY]`` between calls. ``reduce``: how the
    window's gradients meet the other ranks' (``None``: one process).
    """

    n: int = 1
    across_calls: bool = False
    reduce: Reduction | None = None


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
            fn = _scope.kernel_ran(fn)
        cache[name] = fn
    return fn


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
    g = g.replace(donated=in_place)
    if torch.compiler.is_compiling():
        out = step.update(state, g)
    else:
        with _scope.scope(in_place=in_place):
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
        with _scope.scope(state_window=True):
            return _across_calls(step, state, batch, w.n)
    micro = [batch] if w.n == 1 else split(batch, w.n, step.name)
    if sharded:
        assert w.reduce is not None
        return _in_module(step, state, micro, w.reduce.sharded(step, state, w.n))
    if w.reduce is None:
        if w.n == 1:
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
    return apply_update(step, state, step.grad(step.loss, state, batch, 1.0))


def _in_kernels(step: Step, state: TrainState, micro: list[Batch]) -> Result:
    """A window whose sums are a record the microbatch kernel adds into."""
    n = len(micro)
    acc = None
    aux_sum: Any = None
    if n > 1:
        acc = scratch_window(memo(step, KEY), state.params, state.device)
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
    new, metrics, fresh, _ = _last(step, inner, plain, batch, n, True)
    return new.with_substate(KEY, fresh), metrics


def _last(
    step: Step, state: TrainState, acc: AccumState | None, batch: Batch, n: int, reset: bool
) -> tuple[TrainState, Metrics, AccumState | None, torch.Tensor]:
    """The window's last microbatch and its update.

    With ``reset`` the window is the state's and comes back zeroed (``fresh``). Also
    returns the last microbatch's weight (for the window's ``aux`` mean).
    """
    reduce = step.window.reduce
    if reduce is None:
        assert acc is not None
        return _close_window(step, state, acc, batch, n, reset)
    g, mean = reduce.last(step, state, acc, batch, n)
    apply = kernel(step, "apply", lambda: functools.partial(apply_update, step))
    new, metrics = apply(state, mean)
    fresh = None
    if reset and acc is not None:
        fresh = commit(step.donate, acc, acc.zeroed())
    return new, metrics, fresh, g.weight


def _micro_kernel(step: Step) -> Any:
    return kernel(step, "micro", lambda: functools.partial(_micro, step), cpp_wrapper=True)


def _micro(
    step: Step, state: TrainState, acc: AccumState, batch: Batch, n: int, donate_acc: bool
) -> tuple[AccumState, GradOut]:
    g = step.grad(step.loss, state, batch, 1.0 / n)
    if not torch.compiler.is_compiling() and _scope.current().state_window:
        _scope.begin()  # the donated state's own window is added into in place next
    # The gradients now live in the window; returning them too would make a
    # compiled graph keep every one of them alive as an output.
    return accumulate(acc, g, n, donate_acc), g.replace(grads={})


def _close_window(
    step: Step, state: TrainState, acc: AccumState, batch: Batch, n: int, reset: bool
) -> tuple[TrainState, Metrics, AccumState | None, torch.Tensor]:
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
    close = kernel(step, "close", lambda: functools.partial(_close, step))
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
    ts = list(acc.grads.values())
    if owned and ts and opaque_update(state, step.donate):
        _opaque.foreach_div_(ts, total)  # as below, as one operator (phases.opaque_update)
    elif owned and not torch.compiler.is_compiling():
        # In place saves an allocation in eager mode. In a graph it would make the
        # graph write the quotients back into its input, the window: a copy of every
        # gradient that the next window's zeroing throws away.
        torch._foreach_div_(ts, total)
    else:
        ts = list(torch._foreach_div(ts, total))
    mean = GradOut(
        grads=dict(zip(acc.grads, ts)),
        value=acc.value / total,
        weight=total,
        aux=g.aux,
        scale=g.scale,
        counted=g.counted,
        unused=acc.unused or frozenset(),
    )
    new, metrics = apply_update(step, state, skip_empty_window(mean))
    fresh = None
    if reset:
        fresh = commit(step.donate, acc, empty_window(acc.grads, total.device))
    return new, metrics, fresh


# --------------------------------------------------------------------------- in .grad


class InModule:
    """How the ``.grad`` engine runs a window; by default, on one process.

    ``params``: the module's parameters the window differentiates. ``into``: the call
    scope's marker for the gradient phase (:class:`~fasttorch._engine.IntoGrad`), which
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
            with _scope.scope(into=how.into):
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
    apply = kernel(step, "apply", lambda: functools.partial(apply_update, step))
    new, metrics = apply(state, how.mean(step, state, grads, unused, sums, last))
    if sums.aux is not None and sums.weight is not None and "aux" in metrics:
        metrics["aux"] = divide_aux(sums.aux, sums.weight)
    return new, metrics
