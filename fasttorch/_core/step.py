"""A training step: the :class:`Step` record, :func:`step`, wrap checks and the driver.

A :class:`Step` is ``(state, batch) -> (state, metrics)``. It holds three phases
(:mod:`fasttorch.phases`) that transforms replace one at a time, its accumulation
window, and three hooks through which a transform changes how a call runs, never a
field of its own:

* ``window``: a :class:`~fasttorch.window.Window`, what the call's window is: ``n``
  microbatches (``grad_accumulate``), within or across calls, and how its gradients
  are reduced across ranks (``sync_on_last``); :func:`fasttorch.window.run` runs it;
* ``runner(step, state, batch)``: runs one call's gradients and update (default:
  :func:`fasttorch.window.run`; ``compiled`` wraps it under CUDA graphs);
* ``jit(fn, cpp_wrapper=...)``: turns each pure function the step runs into a kernel
  (identity; ``compiled`` installs ``torch.compile``);
* ``hooks``: objects whose ``before(step, state)`` and ``after(step, new)`` run around
  each call, outside any graph (``skip_nonfinite``'s host-side limit).

The driver in :meth:`Step.__call__` adds what no transform should own: checking the
inputs, adding sub-states, the RNG and call scope, and donation.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeAlias

import attrs
import torch
import torch.utils._pytree as pytree

from fasttorch import _checks, _scope
from fasttorch._checks import warn_once
from fasttorch._module import restore_training
from fasttorch._reached import unreached_error
from fasttorch._rng import scoped_rng
from fasttorch._tree import check_batch
from fasttorch.optim._base import check_matches
from fasttorch.phases import (
    Batch,
    GradOut,
    GradPhase,
    Loss,
    LossFn,
    LossPhase,
    Metrics,
    UpdatePhase,
    global_norm,
    grad_phase,
    loss_phase,
    reads_no_state_after_inner,
    scale_grads,
    update_phase,
)
from fasttorch.state import (
    AFTER_FAILURE,
    TrainState,
    check_alive,
    check_template,
    mark_donated,
    mark_failed,
    mark_template_ok,
)
from fasttorch.substates import SubState, any_declares, merge
from fasttorch.window import Window, apply_update, eager, kernel, memo
from fasttorch.window import run as run_window

__all__ = [
    "CallHook",
    "GradOut",
    "Loss",
    "Runner",
    "Step",
    "apply_update",
    "check_wrap",
    "eager",
    "global_norm",
    "scale_grads",
    "step",
    "warn_once",
]

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
    runner: Runner = run_window
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
    progress = _scope.Progress()
    population = any_declares(state.substates, "stacks_members")
    # A step run by another driver (a member's step in fasttorch.several) reports to it
    # whether it may have written; that driver marks and notes the state it was given.
    outer = _scope.current().progress
    try:
        with (
            _scope.scope(in_place=step.donate, progress=progress),
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
