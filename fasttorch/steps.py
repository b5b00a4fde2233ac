"""Pure training steps built from a loss function, and the phases transforms wrap.

A :class:`Step` is ``(state, batch) -> (state, metrics)``. Inside, it runs three phases
that transforms replace one at a time:

* ``loss(state, params, buffers, batch) -> Loss``: the forward pass through the user's
  loss function (``with_amp`` wraps it in autocast);
* ``grad(loss, state, batch, mult) -> GradOut``: gradients of ``loss * mult`` for one
  (micro)batch (``with_amp`` multiplies in the loss scale);
* ``update(state, grads) -> (state, metrics)``: optimizer update (``clip_scaled`` and
  ``with_amp`` act before it).

The driver in :meth:`Step.__call__` adds what no phase should own: checking the inputs,
the RNG scope, the accumulation loop (``grad_accumulate``), compiled kernels
(``compiled``) and donation.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeAlias

import attrs
import torch
import torch.utils._pytree as pytree
from torch.func import functional_call

from fasttorch import struct
from fasttorch._rng import scoped_rng
from fasttorch.optim._base import computed_once, in_cpu_graph
from fasttorch.state import TrainState, check_alive, mark_donated

__all__ = [
    "Accumulation",
    "GradOut",
    "Loss",
    "Step",
    "global_norm",
    "scale_grads",
    "step",
]

Batch: TypeAlias = Any
Metrics: TypeAlias = dict[str, Any]
Tensors: TypeAlias = dict[str, torch.Tensor]


class Loss(struct.Record):
    """What a loss function may return when a bare scalar is not enough.

    Attributes:
        value: the mean loss over ``weight`` samples or tokens (a 0-d float tensor).
        weight: how many samples or tokens ``value`` averages over (for a masked
            token loss, ``mask.sum()``). Defaults to the batch's leading dimension.
            Accumulation and data parallelism weight each microbatch by it, so the
            result is the mean over the whole batch whatever the microbatch sizes.
        aux: auxiliary outputs (a pytree of tensors), returned in ``metrics["aux"]``.
    """

    value: torch.Tensor
    weight: Any = None
    aux: Any = None


class GradOut(struct.Record):
    """Gradients of one batch (or accumulation window) on their way to the optimizer.

    Attributes:
        grads: gradients by parameter name; they equal the true gradients times
            ``scale`` when ``scale`` is set. The update phase takes them over and may
            overwrite them in place (they are fresh tensors, never the state's own).
        value: the mean loss.
        weight: the samples or tokens the mean is over.
        aux: the loss function's auxiliary outputs, or ``None``.
        scale: the loss scale the gradients still carry, or ``None`` once unscaled.
        norm: global L2 norm of the true (unscaled, unclipped) gradients, once known.
        skip: a bool tensor: when true the update is not applied (non-finite grads).
    """

    grads: Tensors
    value: torch.Tensor
    weight: torch.Tensor
    aux: Any = None
    scale: torch.Tensor | None = None
    norm: torch.Tensor | None = None
    skip: torch.Tensor | None = None


LossFn: TypeAlias = Callable[[Callable[..., Any], Batch], Any]
LossPhase: TypeAlias = Callable[[TrainState, Tensors, Tensors, Batch], Loss]
GradPhase: TypeAlias = Callable[[LossPhase, TrainState, Batch, Any], GradOut]
UpdatePhase: TypeAlias = Callable[[TrainState, GradOut], "tuple[TrainState, Metrics]"]
Init: TypeAlias = Callable[[TrainState], Any]


@attrs.frozen
class Accumulation:
    """How ``grad_accumulate`` set a step up: ``n`` microbatches, in one call or across calls."""

    n: int
    across_calls: bool


@attrs.frozen(slots=False)
class Step:
    """A pure training step ``(state, batch) -> (state, metrics)`` and its phases.

    Build one with :func:`step`, change it with the transforms. Calling it checks its
    inputs, adds missing transform sub-states (``init``), then runs the phases, eager
    or compiled. With ``donate=True`` (the default) the input state's tensors are
    updated in place and the input state may not be used again.
    """

    loss: LossPhase
    grad: GradPhase
    update: UpdatePhase
    name: str
    doc: str | None = None
    inits: tuple[tuple[str, Init], ...] = ()
    accumulation: Accumulation | None = None
    donate: bool = True
    transforms: tuple[str, ...] = ()
    compile_options: Mapping[str, Any] | None = None
    sync: Any = None

    def __attrs_post_init__(self) -> None:
        # Keep the wrapped loss function's name and docs, as functools.wraps would.
        self.__dict__["__name__"] = self.name
        self.__dict__["__qualname__"] = self.name
        self.__dict__["__doc__"] = self.doc

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        return _run(self, state, batch)

    def init(self, state: TrainState) -> TrainState:
        """Return ``state`` with every sub-state this step needs (existing ones kept)."""
        check_alive(state, f"{self.name}.init")
        missing = [(k, f) for k, f in self.inits if k not in state.substates]
        if not missing:
            return state
        subs = dict(state.substates)
        for key, make in missing:
            subs[key] = make(state)
        return state.replace(substates=subs)

    def with_phases(self, transform: str, **changes: Any) -> Step:
        """A copy with some phases or settings replaced, recording ``transform``.

        This is how transforms are written: check the order, then replace phases.
        """
        check_wrap(self, transform)
        return attrs.evolve(self, transforms=(*self.transforms, transform), **changes)

    @functools.cached_property
    def kernels(self) -> _Kernels:
        """The functions the driver runs: plain, or compiled by ``compiled``."""
        return _Kernels(self)


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
            dead, as ``jax.jit(donate_argnums=0)``. ``False`` leaves every input state
            untouched and usable (copying semantics, for tests and comparisons).

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
    return Step(
        loss=_loss_phase(loss_fn),
        grad=grad_phase,
        update=update_phase,
        name=name,
        doc=getattr(loss_fn, "__doc__", None),
        donate=donate,
    )


# --------------------------------------------------------------------------- phases


def _loss_phase(loss_fn: LossFn) -> LossPhase:
    name = getattr(loss_fn, "__name__", repr(loss_fn))

    def loss(state: TrainState, params: Tensors, buffers: Tensors, batch: Batch) -> Loss:
        def apply(*args: Any, **kwargs: Any) -> Any:
            if type(params) is ModuleTensors:  # the module's own tensors: call it as is
                return state.module(*args, **kwargs)
            return functional_call(state.module, (params, buffers), args, kwargs)

        if torch.compiler.is_compiling():
            out = loss_fn(apply, batch)
        else:
            try:
                out = loss_fn(apply, batch)
            except Exception as e:
                e.add_note(
                    f"fasttorch: raised inside loss function {name!r}, called as "
                    f"{name}(apply, batch) with batch = {describe(batch)}"
                )
                raise
        return as_loss(out, batch, name)

    return loss


def as_loss(out: Any, batch: Batch, name: str) -> Loss:
    """Normalize a loss function's return value to a :class:`Loss`, checking it."""
    if isinstance(out, Loss):
        loss = out
    elif isinstance(out, tuple) and len(out) == 2:
        loss = Loss(out[0], aux=out[1])
    else:
        loss = Loss(out)
    v = loss.value
    if not isinstance(v, torch.Tensor) or v.ndim != 0 or not v.is_floating_point():
        got = (
            f"a tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
            if isinstance(v, torch.Tensor)
            else type(v).__name__
        )
        raise ValueError(
            f"loss function {name!r} must return the mean loss as a 0-d floating tensor "
            f"(or (loss, aux), or fasttorch.Loss); got {got}. Reduce it with .mean(), "
            "or return fasttorch.Loss(per_item.sum() / count, weight=count)"
        )
    weight = loss.weight if loss.weight is not None else batch_size(batch)
    if not isinstance(weight, torch.Tensor):
        weight = _constant(float(weight), device=v.device)
    return Loss(v, weight.to(torch.float32), loss.aux)


_CONSTANTS: dict[tuple[float, torch.dtype, torch.device, bool], torch.Tensor] = {}


def _constant(
    x: float, *, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``x`` as a 0-d tensor; in eager mode the same tensor each time.

    Nothing is allocated per step for a sample count or a ``1/n``, and an eager window
    sees by identity, not by reading values, that its microbatches weigh the same, so
    it skips multiplying and dividing by factors that are exactly 1. A tensor that
    anything wrote into (its version moved) is replaced.
    """
    if torch.compiler.is_compiling():
        return torch.tensor(x, dtype=dtype, device=device)
    key = (x, dtype, device, torch.is_inference_mode_enabled())
    t = _CONSTANTS.get(key)
    if t is None or t._version != 0:
        if len(_CONSTANTS) >= 256:
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = torch.tensor(x, dtype=dtype, device=device)
    return t


def grad_phase(loss: LossPhase, state: TrainState, batch: Batch, mult: Any) -> GradOut:
    """Gradients of ``loss.value * mult`` with respect to ``state.params``.

    ``mult`` carries the factors transforms put on the loss before backward: ``1/n``
    for accumulation, the loss scale for fp16. The gradients come from
    ``torch.autograd.grad`` on detached leaves (``compiled`` lets dynamo trace it), as
    ``loss.backward()`` computes them; parameters the loss does not use get zeros.
    While a data-parallel reduction is active (``fasttorch.distributed``, eager only),
    each parameter's hook hands its gradient to the reducer as soon as it is ready.
    """
    compiling = torch.compiler.is_compiling()
    reduction = None if compiling else _REDUCTION.get()
    direct = None if compiling else module_tensors(state)
    into = None if compiling else _INTO_GRAD.get()
    if into is not None and direct is not None and reduction is None:
        return _grad_into_module(loss, state, direct, batch, mult, into)
    params: Tensors = (
        direct
        if direct is not None
        else {k: p.detach().requires_grad_() for k, p in state.params.items()}
    )
    with torch.enable_grad():
        out = loss(state, params, state.buffers, batch)
        handles = [] if reduction is None else reduction.attach(params, out)
        try:
            grads = torch.autograd.grad(
                out.value * mult, list(params.values()), allow_unused=True, materialize_grads=True
            )
        finally:
            for h in handles:
                h.remove()
    aux = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out.aux)
    return GradOut(
        grads=dict(zip(params, grads)), value=out.value.detach(), weight=out.weight, aux=aux
    )


class _IntoGrad:
    """An eager window accumulating in the module's ``.grad`` (see ``_grad_into_module``)."""

    first: torch.Tensor | None = None  # the first microbatch's weight
    same: bool = True  # every microbatch's weight is that same tensor (factors exactly 1)


# Set by the driver around an eager window whose gradients accumulate in ``.grad``.
_INTO_GRAD: contextvars.ContextVar[_IntoGrad | None] = contextvars.ContextVar(
    "fasttorch_into_grad", default=None
)


def _grad_into_module(
    loss: LossPhase,
    state: TrainState,
    params: ModuleTensors,
    batch: Batch,
    mult: Any,
    into: _IntoGrad,
) -> GradOut:
    """Backward into the module's ``.grad``, as ``loss.backward()`` does; no grads returned.

    ``torch.autograd.grad`` hands over all of a microbatch's gradients at once, which
    then go into the window: one gradient set more at the peak than the plain loop,
    whose backward adds each gradient into ``.grad`` as soon as it exists. Here the
    engine does that. The window's gradient is ``sum_i w_i * grad(value_i) / sum_i w_i``;
    microbatch ``i`` backpropagates ``value_i`` with the seed ``mult * (w_i / w_1)``
    (``mult`` is ``1/n``, times the loss scale under fp16; the plain loop's
    ``(value / n).backward()`` seeds ``value`` with the same ``1/n``), and the driver
    divides the sum by ``sum_i w_i / (n * w_1)`` at the end. With equal weights both
    factors are exactly 1 and this is the plain loop, operation for operation.
    """
    with torch.enable_grad():
        out = loss(state, params, state.buffers, batch)
        v = out.value
        seed = (
            mult.to(v.dtype)
            if isinstance(mult, torch.Tensor)
            else _constant(float(mult), device=v.device, dtype=v.dtype)
        )
        if into.first is None:
            into.first = out.weight
        elif out.weight is not into.first:
            into.same = False
            seed = seed * (out.weight / into.first)
        inputs = _backward_inputs(params, state.module, v, batch)
        torch.autograd.backward(v, grad_tensors=seed, inputs=inputs)
    aux = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out.aux)
    return GradOut(grads={}, value=out.value.detach(), weight=out.weight, aux=aux)


# Per module: whether the first loss graph checked reached no leaf but its parameters.
_LEAVES_ARE_PARAMS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _backward_inputs(
    params: ModuleTensors, module: Any, value: torch.Tensor, batch: Batch
) -> list[torch.Tensor] | None:
    """``inputs=`` for the backward of ``value``: ``None`` where a plain backward reaches
    the parameters in ``params`` and no other tensor that requires grad.

    Given ``inputs``, the engine first marks the nodes that lead to them and then
    consults the marks at every node: 2-4% of the benchmark MLP's eager step
    (docs/design.md). Without it the backward accumulates into every leaf it reaches,
    as ``loss.backward()`` in the plain loop does. That is the parameters alone when
    every parameter of the module that requires grad is in ``params``, no tensor in the
    batch requires grad, and the loss's graph reached no other leaf when it was first
    checked, once per module (a walk over its nodes). Otherwise the parameters are
    passed as ``inputs``, and nothing else gets a ``.grad``.
    """
    if not params.complete or any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(batch)
    ):
        return list(params.values())
    ok = _LEAVES_ARE_PARAMS.get(module)
    if ok is None:
        ok = _LEAVES_ARE_PARAMS[module] = _leaves_within(value, params.values())
    return None if ok else list(params.values())


def _leaves_within(value: torch.Tensor, leaves: Any) -> bool:
    """Whether every leaf the backward of ``value`` accumulates into is in ``leaves``."""
    allowed = {id(t) for t in leaves}
    seen: set[Any] = set()
    stack = [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None and id(variable) not in allowed:
            return False
        stack.extend(fn for fn, _ in node.next_functions)
    return True


class ModuleTensors(dict[str, torch.Tensor]):
    """The module's own parameters, standing for ``state.params`` (same storage).

    ``complete``: every parameter of the module that requires grad is among them.
    """

    complete: bool = False


_MODULE_PARAMS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def module_tensors(state: TrainState) -> ModuleTensors | None:
    """The module's own parameters when the state's tensors are still the module's.

    A donated state shares storage with its module (``TrainState.create`` takes no
    copy and donating steps update in place). Then the module can run as it is, and
    ``torch.autograd.grad`` can differentiate its own parameters: the same graph and
    numbers as ``functional_call`` without swapping every tensor in and out on every
    call, which costs more than the arithmetic of a small model. Any state whose
    tensors are not the module's (copying semantics, a loaded checkpoint) gets ``None``
    and goes through ``functional_call``.
    """
    if not _IN_PLACE.get():
        return None
    module = state.module
    cached = _MODULE_PARAMS.get(module)
    if cached is None:
        named: dict[str, torch.Tensor] = dict(module.named_parameters())
        tensors = dict(named)
        tensors.update(module.named_buffers())
        cached = [named, tensors, None]
        _MODULE_PARAMS[module] = cached
    named, tensors, last = cached
    # The microbatches of one call share the state's dicts (records are immutable):
    # the answer for them is the one just found.
    if last is not None and last[0] is state.params and last[1] is state.buffers:
        return last[2]  # type: ignore[no-any-return]
    out: ModuleTensors | None = ModuleTensors()
    for group in (state.params, state.buffers):
        for k, t in group.items():
            m = tensors.get(k)
            if m is None or m.data_ptr() != t.data_ptr() or m.shape != t.shape:
                out = None
                break
        if out is None:
            break
    if out is not None:
        for k in state.params:
            p = named.get(k)
            if p is None or not p.requires_grad:
                out = None
                break
            out[k] = p
    if out is not None:
        out.complete = sum(p.requires_grad for p in named.values()) == len(out)
    cached[2] = (state.params, state.buffers, out)
    return out


class Reduction(Protocol):
    """What the gradient phase needs from an active data-parallel reduction."""

    def attach(self, params: Tensors, out: Loss) -> list[Any]:
        """Register per-parameter gradient hooks after the forward; return their handles."""
        ...


_REDUCTION: contextvars.ContextVar[Reduction | None] = contextvars.ContextVar(
    "fasttorch_reduction", default=None
)
# Set by the driver around an eager call that donates its state.
_IN_PLACE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fasttorch_in_place", default=False
)


@contextlib.contextmanager
def reducing(reduction: Reduction) -> Iterator[None]:
    """Make ``reduction`` receive the gradients of the grad phases run in this block."""
    token = _REDUCTION.set(reduction)
    try:
        yield
    finally:
        _REDUCTION.reset(token)


def update_phase(state: TrainState, g: GradOut) -> tuple[TrainState, Metrics]:
    """Unscale if needed, apply the optimizer, honour ``g.skip``; pure."""
    grads, norm = g.grads, g.norm
    if g.scale is not None:
        inv = reciprocal(g.scale)
        if norm is None:
            norm = global_norm(grads) * inv
        grads = scale_grads(grads, inv)
    elif norm is None:
        norm = global_norm(grads)
    opt = state.optimizer
    lr = opt.learning_rate(state.opt_state, state.step)
    # Eager and donating: update the state's tensors in place (fresh tensors cost more
    # than the arithmetic on CPU). Not when a skip must keep the old values around.
    inplace = g.skip is None and not torch.compiler.is_compiling() and _IN_PLACE.get()
    params, opt_state = opt.update(
        state.params, grads, state.opt_state, state.step, inplace=inplace
    )
    if g.skip is not None:
        keep = g.skip
        params, opt_state = pytree.tree_map(
            lambda old, new: torch.where(keep, old, new),
            (state.params, state.opt_state),
            (params, opt_state),
        )
    metrics: Metrics = {
        "loss": g.value,
        "grad_norm": norm,
        # A copy: a constant lr is a state tensor, overwritten in place under donation.
        "lr": lr.clone(),
    }
    if g.aux is not None:
        metrics["aux"] = g.aux
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` computed as ``GradScaler`` does (in float64, then float32)."""
    return scale.double().reciprocal().float()


def scale_grads(grads: Mapping[str, torch.Tensor], factor: torch.Tensor) -> Tensors:
    """``grads`` times ``factor``: in place in eager mode (the update phase owns them).

    In a graph, out of place: an in-place multiply of a graph input (the accumulation
    window's gradients) would be written back into it, a copy of every gradient for
    nothing. The same multiplication either way, so the same bits.
    """
    ts = list(grads.values())
    if in_cpu_graph(ts):
        # a multiply per tensor by a factor computed once (computed_once)
        (factor,) = computed_once(factor)
        return {k: t * factor for k, t in grads.items()}
    if torch.compiler.is_compiling():
        return dict(zip(grads, torch._foreach_mul(ts, factor)))
    torch._foreach_mul_(ts, factor)
    return dict(grads)


def global_norm(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Global L2 norm, computed as ``torch.nn.utils.clip_grad_norm_`` does.

    In a CPU graph the per-tensor norms are ``linalg.vector_norm`` reductions, which
    inductor generates and fuses with what computes the gradients (the mean over an
    accumulation window); ``_foreach_norm`` has no CPU lowering and would need every
    gradient written out first for the ATen call. On CPU ``_foreach_norm`` is that same
    per-tensor call in eager mode.
    """
    ts = list(tensors.values())
    if in_cpu_graph(ts):
        norms = [torch.linalg.vector_norm(t) for t in ts]
    else:
        norms = list(torch._foreach_norm(ts))
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


# --------------------------------------------------------------------------- checks


def describe(batch: Batch) -> str:
    """A short description of a batch's structure: types, shapes, dtypes, devices."""

    def leaf(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"Tensor{tuple(x.shape)}:{str(x.dtype).removeprefix('torch.')}@{x.device}"
        return type(x).__name__

    text = str(pytree.tree_map(leaf, batch))
    return text if len(text) < 300 else text[:297] + "..."


def batch_size(batch: Batch) -> int:
    """Leading dimension of the batch's first tensor (1 for a batch without one)."""
    for x in pytree.tree_leaves(batch):
        if isinstance(x, torch.Tensor) and x.ndim > 0:
            return int(x.shape[0])
    return 1


def check_batch(batch: Batch, device: torch.device, api: str) -> None:
    """Raise a clear error for batch leaves that are not tensors on ``device``."""
    leaves, _ = pytree.tree_flatten_with_path(batch)
    if not leaves:
        raise TypeError(f"{api}: the batch holds no tensors (got {describe(batch)})")
    for path, x in leaves:
        where = f"batch{pytree.keystr(path)}"
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{api}: {where} is a {type(x).__name__}; every leaf of the batch must be "
                f"a tensor (the batch is {describe(batch)}). Convert it with "
                "torch.as_tensor, or keep configuration out of the batch"
            )
        if x.device != device:
            raise ValueError(
                f"{api}: {where} is on {x.device} but the state is on {device}; move "
                "the batch to the state's device first (batch.to(device, non_blocking=True))"
            )


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


# --------------------------------------------------------------------------- composition

# Transforms that reach into phases; they need a Step and must come before `compiled`.
PHASE_TRANSFORMS = (
    "with_amp",
    "grad_accumulate",
    "clip_scaled",
    "sync_on_last",
    "ema",
    "skip_nonfinite",
)
_ONCE = (*PHASE_TRANSFORMS, "compiled")


def check_wrap(step: Any, transform: str) -> None:
    """Raise at wrap time if ``transform`` cannot wrap ``step``; see docs/composition.md."""
    if not isinstance(step, Step):
        kind = getattr(step, "__name__", type(step).__name__)
        raise TypeError(
            f"{transform} wraps the phases of a step built by fasttorch.step(loss_fn); "
            f"got {kind!r}. Only compiled and profiled accept any (state, batch) callable"
        )
    chain = " -> ".join(step.transforms) or "none"
    if transform in _ONCE and transform in step.transforms:
        raise ValueError(
            f"{transform} is already applied to this step (transforms so far: {chain}); "
            "apply it once"
        )
    if "compiled" in step.transforms:
        raise ValueError(
            f"{transform} cannot wrap a compiled step (transforms so far: {chain}): "
            f"compiled must be the outermost transform. Write "
            f"compiled({transform}(step, ...)) instead"
        )


# --------------------------------------------------------------------------- driver


class AccumState(struct.Record):
    """Sub-state of ``grad_accumulate(..., across_calls=True)``: the open window."""

    grads: Tensors
    weight: torch.Tensor
    value: torch.Tensor
    micro: int = struct.field(static=True, default=0)


def empty_window(params: Mapping[str, torch.Tensor], device: torch.device) -> AccumState:
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return AccumState(
        grads={k: torch.zeros_like(p) for k, p in params.items()},
        weight=zero,
        value=zero.clone(),
    )


class _Kernels:
    """The pure functions the driver calls, compiled once each when the step is."""

    def __init__(self, step: Step) -> None:
        self.step = step
        wrap: Callable[..., Callable[..., Any]]
        if step.compile_options is None:
            wrap = _identity
        else:
            options = dict(step.compile_options)

            def wrap(f: Callable[..., Any], cpp_wrapper: bool = False) -> Callable[..., Any]:
                return compile_step_fn(f, cpp_wrapper_on_cpu=cpp_wrapper, **options)

        self.full = wrap(self._full)
        # The microbatch graph (forward, backward, accumulation) gets inductor's C++
        # wrapper on CPU; the update graph keeps the Python one (see compile_step_fn).
        self.micro = wrap(self._micro, cpp_wrapper=True)
        self.close = wrap(self._close)
        # Data parallel: the last microbatch runs eagerly around a compiled forward
        # (its backward hooks launch collectives), then the update is one graph.
        self.forward = wrap(step.loss)
        self.apply = wrap(self._apply)
        self._scratch: AccumState | None = None

    def scratch_window(
        self, params: Mapping[str, torch.Tensor], device: torch.device
    ) -> AccumState:
        """A zeroed window for accumulation within one call, reused from call to call.

        A scratch buffer, not state: zeroing it is a memset, where fresh multi-MB
        tensors on every call cost page faults.
        """
        w = self._scratch
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
            w = self._scratch = empty_window(params, device)
            return w
        torch._foreach_zero_(list(w.grads.values()))
        w.weight.zero_()
        w.value.zero_()
        return w

    def _full(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        s = self.step
        return self._apply(state, s.grad(s.loss, state, batch, 1.0))

    def _micro(
        self, state: TrainState, acc: AccumState, batch: Batch, n: int, donate_acc: bool
    ) -> tuple[AccumState, GradOut]:
        s = self.step
        g = s.grad(s.loss, state, batch, 1.0 / n)
        # The gradients now live in the window; returning them too would make a
        # compiled graph keep every one of them alive as an output.
        return accumulate(acc, g, n, donate_acc), g.replace(grads={})

    def _apply(self, state: TrainState, g: GradOut) -> tuple[TrainState, Metrics]:
        new, metrics = self.step.update(state, g)
        return commit(self.step.donate, state, new), metrics

    def _close(
        self, state: TrainState, acc: AccumState, g: GradOut, reset: bool
    ) -> tuple[TrainState, Metrics, AccumState | None]:
        """Apply a full window ``acc`` (``g``: its last microbatch, without gradients)."""
        s = self.step
        # Within one call the window is a temporary; across calls it is the state's, and
        # ours to overwrite only when donated (it is zeroed for the next window below).
        owned = not reset or s.donate
        total = acc.weight.clone()  # the window is zeroed below when it is the state's
        new, metrics = self.update_window(
            state, acc.grads, total, acc.value / total, total, g, owned
        )
        fresh = None
        if reset:
            fresh = commit(s.donate, acc, empty_window(acc.grads, total.device))
        return new, metrics, fresh

    def update_window(
        self,
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
        s = self.step
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
        )
        new, metrics = s.update(state, window)
        return commit(s.donate, state, new), metrics

    def last(
        self, state: TrainState, acc: AccumState, batch: Batch, n: int, reset: bool
    ) -> tuple[TrainState, Metrics, AccumState | None, torch.Tensor]:
        """The window's last microbatch, then its update.

        Two kernels, not one: the microbatch kernel is the one every other microbatch
        runs, so under ``compiled`` the forward and backward are compiled once, and the
        update graph holds no model code (half the compile time of a graph that repeats
        the forward and backward, at the cost of one more graph call per window).
        """
        acc2, g = self.micro(state, acc, batch, n, not reset or self.step.donate)
        new, metrics, fresh = self.close(state, acc2, g, reset)
        return new, metrics, fresh, g.weight


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


def _synced_last(
    k: _Kernels, state: TrainState, acc: AccumState | None, batch: Batch, n: int, reset: bool
) -> tuple[TrainState, Metrics, AccumState | None, torch.Tensor]:
    """The window's last microbatch with its gradients reduced across ranks."""
    s = k.step
    reduction = s.sync.reduction(state.params, acc, n, state.step)
    with reducing(reduction):
        g = s.grad(k.forward, state, batch, 1.0 / n)
    new, metrics = k.apply(state, reduction.finish(g))
    fresh = None
    if reset and acc is not None:
        fresh = commit(s.donate, acc, empty_window(acc.grads, g.weight.device))
    return new, metrics, fresh, g.weight


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a function or bound method) over a fresh copy of its code object."""
    target = getattr(fn, "__func__", fn)
    if not isinstance(target, types.FunctionType):
        return fn
    copy = types.FunctionType(
        target.__code__.replace(),
        target.__globals__,
        target.__name__,
        target.__defaults__,
        target.__closure__,
    )
    copy.__kwdefaults__ = target.__kwdefaults__
    copy.__qualname__ = target.__qualname__
    copy.__dict__.update(target.__dict__)
    if target is not fn:  # a bound method
        return types.MethodType(copy, fn.__self__)  # type: ignore[attr-defined]
    return copy


def _identity(f: Callable[..., Any], cpp_wrapper: bool = False) -> Callable[..., Any]:
    return f


def compile_step_fn(
    fn: Callable[..., Any], *, cpp_wrapper_on_cpu: bool = False, **options: Any
) -> Callable[..., Any]:
    """``torch.compile(fn)``, called with dynamo allowed to trace ``torch.autograd.grad``.

    ``fn`` gets a code object of its own first: dynamo caches compiled graphs per code
    object, and every step's kernels share the same source, so without a copy each
    further compiled step in a process would count as a recompile of the first one (and
    with ``fullgraph=True`` the ninth would fail on dynamo's recompile limit).

    ``cpp_wrapper_on_cpu``: when every tensor of the first call is on the CPU and the
    backend is inductor, compile with inductor's C++ wrapper (``cpp_wrapper=True``)
    unless the caller's options set it. The graph then calls its kernels from C++
    instead of from a Python function: a forward and backward with hundreds of small
    kernels runs 15-26% faster per step on the benchmark models (the wrapper and the
    kernels compile as two files, see ``_with_cpp_wrapper``). The update graph does not
    get it: its single kernel with a few hundred arguments took longer to compile as
    part of a C++ wrapper (docs/design.md, "Compile time").
    """
    if isinstance(options.get("options"), dict):
        # torch.compile pops entries (guard_filter_fn) from this dict: one per kernel.
        options = {**options, "options": dict(options["options"])}
    compiled_fn: Callable[..., Any] | None = None
    opts: dict[str, Any] = options

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled_fn, opts
        if compiled_fn is None:  # on the first call, when the tensors' devices are known
            opts = _without_cpu_only_passes(options, (args, kwargs))
            if _on_cpu((args, kwargs)):
                probe_cpu_isa_early(opts)
            opts = _with_fusion_cap(opts)
            if cpp_wrapper_on_cpu and _only_on_cpu((args, kwargs)):
                opts = _with_cpp_wrapper(opts)
            compiled_fn = torch.compile(own_code(fn), **opts)
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            try:
                return compiled_fn(*args, **kwargs)
            except Exception as err:
                error = _cpp_compile_error(err)
                if error is None or not _separate_build_is_ours(options, opts):
                    raise
                # One graph (fullgraph), which failed to build: nothing ran, the inputs
                # are untouched, and the same call can be made again.
                warn_once(
                    "compiled: the C++ compiler failed on the wrapper and kernels built as "
                    "two files (cpp_wrapper_build_separate, which fasttorch sets); building "
                    "them as one file from now on, as inductor does by default. Pass "
                    "options={'cpp_wrapper_build_separate': False} to skip the attempt. "
                    f"The compiler said:\n{_tail(str(error), 4000)}"
                )
                inner = {**opts["options"], "cpp_wrapper_build_separate": False}
                opts = {**opts, "options": inner}
                compiled_fn = torch.compile(own_code(fn), **opts)
                return compiled_fn(*args, **kwargs)

    return run


def _cpp_compile_error(err: BaseException) -> BaseException | None:
    """The C++ compiler's error in ``err``'s chain of causes, if there is one."""
    from torch._inductor.exc import CppCompileError

    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, CppCompileError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _separate_build_is_ours(options: dict[str, Any], opts: dict[str, Any]) -> bool:
    """Whether ``opts`` build in two files because ``_with_cpp_wrapper`` set it."""
    mine = options.get("options") or {}
    now = opts.get("options") or {}
    return (
        opts.get("fullgraph") is True
        and "cpp_wrapper_build_separate" not in mine
        and now.get("cpp_wrapper_build_separate") is True
    )


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "..." + text[-n:]


@functools.cache
def warn_once(message: str) -> None:
    """``warnings.warn(message)`` the first time this process says ``message``."""
    warnings.warn(message, UserWarning, stacklevel=4)


def _on_cpu(args: Any) -> bool:
    return any(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in pytree.tree_leaves(args)
    )


def _only_on_cpu(args: Any) -> bool:
    devices = {t.device.type for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)}
    return devices == {"cpu"}


def _with_cpp_wrapper(options: dict[str, Any]) -> dict[str, Any]:
    """Inductor's options with ``cpp_wrapper=True``, unless the caller set it (any value).

    With it ``cpp_wrapper_build_separate=True``, again unless the caller set it: the
    wrapper (one large C++ function) and the kernels compile as two files, the wrapper
    at ``-O1`` and the kernels at ``-O3``, where one file would put the wrapper through
    ``-O3`` too. Measured on the benchmark models on 2 cores: M3's microbatch graph
    compiles in 5.6 s instead of 9.1 s, M1's cold compile is 17 s shorter; M1's step is
    4-6% longer, M3's the same within noise (docs/design.md, "Compile time"). Torch
    leaves the option off by default: where the C++ compiler fails on the two files,
    ``compile_step_fn`` warns once and builds the graph as one file.
    """
    if options.get("backend", "inductor") != "inductor":
        return options
    inner = dict(options.get("options") or {})
    inner.setdefault("cpp_wrapper", True)
    from torch._inductor import config as inductor_config

    if hasattr(inductor_config, "cpp_wrapper_build_separate"):
        inner.setdefault("cpp_wrapper_build_separate", True)
    _quiet_known_proxy_calls()
    return {**options, "options": inner}


# ATen ops that compiled's own graph rewrites call as extern kernels, and that have no C
# shim: a C++ wrapper calls them through inductor's proxy executor (measured: the step is
# still faster than with the Python wrapper). Inductor logs a warning for each such
# call site at every cold compile; for these it says nothing the user can act on.
_PROXY_CALLS_OF_OURS = frozenset({"aten._autocast_to_full_precision.default"})


class _KnownProxyCalls(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            isinstance(record.msg, str)
            and record.msg.startswith("%s is missing a c-shim implementation")
            and isinstance(record.args, tuple)
            and len(record.args) == 1
            and str(record.args[0]) in _PROXY_CALLS_OF_OURS
        )


_PROXY_FILTER = _KnownProxyCalls()


def _quiet_known_proxy_calls() -> None:
    """Drop inductor's proxy-executor warning for ``_PROXY_CALLS_OF_OURS`` only (once)."""
    logger = logging.getLogger("torch._inductor.ir")
    if _PROXY_FILTER not in logger.filters:
        logger.addFilter(_PROXY_FILTER)


_ISA_PROBE: list[threading.Thread] = []


def probe_cpu_isa_early(options: dict[str, Any]) -> None:
    """Start inductor's probe of the C++ compiler's vector instruction sets now, in a thread.

    Before its first CPU kernel inductor compiles and loads a small program per
    candidate instruction set (AVX512, AVX2, ...), once per process and, for the
    compiler's part, once per cache directory: 7-16 s on 2 cores, during which the
    compile waits. Started when the step is first called, it runs in the C++ compiler's
    own processes beside dynamo's tracing and AOT autograd, which come first and need
    no compiler; by the time code generation asks for the answer it is known. The
    thread computes what inductor would (``cpu_vec_isa.valid_vec_isa_list``, cached
    for the process), with the same configuration; where the caller's options change
    the C++ toolchain (``cpp.*``) or the backend is not inductor, nothing is started and
    inductor probes in line as usual. Once per process.
    """
    if _ISA_PROBE or options.get("backend", "inductor") != "inductor":
        return
    inner = options.get("options") or {}
    if any(k == "cpp" or k.startswith("cpp.") for k in inner):
        return
    try:
        from torch._inductor import cpu_vec_isa

        probe = cpu_vec_isa.valid_vec_isa_list
    except (ImportError, AttributeError):  # inductor reorganized: it probes in line
        return

    def run() -> None:
        # On failure inductor probes again in line and reports it there.
        with contextlib.suppress(Exception):
            probe()

    thread = threading.Thread(target=run, name="fasttorch-cpu-isa-probe", daemon=True)
    _ISA_PROBE.append(thread)
    thread.start()


def _without_cpu_only_passes(options: dict[str, Any], args: Any) -> dict[str, Any]:
    """``options`` less the inductor passes marked ``cpu_only`` when no tensor is on CPU.

    Such a pass (``compiled``'s bf16 matrix-product rewrite) would find nothing to do in
    a GPU graph, but the rounding option it asks for (``emulate_precision_casts``, when
    it set it) would still change the GPU kernels.
    """
    inner = options.get("options")
    if not isinstance(inner, dict):
        return options
    given = inner.get("post_grad_custom_pre_pass")
    passes = list(given) if isinstance(given, (list, tuple)) else [given]
    mine = [p for p in passes if getattr(p, "cpu_only", False)]
    if not mine or _on_cpu(args):
        return options
    inner = dict(inner)
    rest = [p for p in passes if p is not None and p not in mine]
    if rest:
        inner["post_grad_custom_pre_pass"] = rest[0] if len(rest) == 1 else rest
    else:
        del inner["post_grad_custom_pre_pass"]
    if any(getattr(p, "set_emulate", False) for p in mine):
        inner.pop("emulate_precision_casts", None)
    return {**options, "options": inner}


# Inductor's fusion search tries up to this many partners for each node among the
# nodes that read the same buffer (64 by default). A step's update reads the same 0-d
# hyperparameter tensors (lr, betas, loss scale) in every per-parameter node, so each
# node met 64 candidates: about 70,000 fusion checks and a third of a 130 s cold compile
# of the 0.1M-parameter MLP benchmark on 2 cores. Producer-consumer pairs share their
# own buffers and are still all found; the steady-state step time did not change.
FUSION_ATTEMPTS = 4


def _with_fusion_cap(options: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` arguments with the inductor fusion-search cap added.

    Only for the inductor backend, and only where the caller did not set the option.
    ``torch.compile`` takes ``mode`` or ``options``, not both, so a mode becomes its
    options (``torch._inductor.list_mode_options``, as torch.compile itself does).
    """
    if options.get("backend", "inductor") != "inductor":
        return options
    out = dict(options)
    inductor_opts = dict(out.pop("options", None) or {})
    mode = out.pop("mode", None)
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        inductor_opts = {**list_mode_options(mode, out.get("dynamic")), **inductor_opts}
    inductor_opts.setdefault("max_fusion_buffer_group_pairwise_attempts", FUSION_ATTEMPTS)
    out["options"] = inductor_opts
    return out


def commit(donate: bool, old: Any, new: Any) -> Any:
    """With donation, write ``new``'s tensors into ``old``'s and return ``new`` over them.

    Phases compute new values (in eager mode some update tensors they own in place);
    this is where a donated state's tensors take the results. Under ``compiled`` the
    copies fuse into the kernels that produce the values. The walk stops at subtrees
    that are the same object, so an update that already happened in place costs nothing.
    """
    if not donate:
        return new
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    out = _reuse(old, new, dst, src)
    if dst:
        torch._foreach_copy_(dst, src)
    return out


def _reuse(old: Any, new: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Any:
    """``new`` with its tensors swapped for ``old``'s where they differ (copies queued)."""
    if old is new:
        return new
    if isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype:
            dst.append(old)
            src.append(new)
            return old
        return new
    if isinstance(new, dict) and isinstance(old, dict):
        return {k: _reuse(old[k], v, dst, src) if k in old else v for k, v in new.items()}
    if isinstance(new, struct.Record) and type(old) is type(new):
        changes = {}
        for f in dataclasses.fields(new):  # type: ignore[arg-type]
            if f.metadata.get("fasttorch_static", False):
                continue
            a, b = getattr(old, f.name), getattr(new, f.name)
            if a is not b:
                changes[f.name] = _reuse(a, b, dst, src)
        return new.replace(**changes) if changes else new
    if isinstance(new, (list, tuple)) and isinstance(old, (list, tuple)) and len(old) == len(new):
        items = [_reuse(a, b, dst, src) for a, b in zip(old, new)]
        return type(new)(items) if isinstance(new, list) else tuple(items)
    return new


def _run(step: Step, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    check_alive(state, step.name)
    device = state.device
    check_batch(batch, device, step.name)
    given = state
    state = step.init(state)
    if not state.module.training:
        state.module.train()
    if not step.donate:
        # BatchNorm updates running stats in place: work on copies to leave inputs intact.
        state = state.replace(buffers={k: b.clone() for k, b in state.buffers.items()})
    k = step.kernels
    acc_cfg = step.accumulation
    last: Callable[..., Any] = k.last if step.sync is None else functools.partial(_synced_last, k)
    in_place = _IN_PLACE.set(step.donate)
    try:
        with scoped_rng(state.rng, device) as rng_now:
            if acc_cfg is None and step.sync is None:
                new, metrics = k.full(state, batch)
            elif acc_cfg is None:
                new, metrics, _, _ = last(state, None, batch, 1, False)
            elif not acc_cfg.across_calls and _grads_into_module(step, state):
                new, metrics = _window_in_module(step, state, split(batch, acc_cfg.n, step.name))
            elif not acc_cfg.across_calls:
                micro = split(batch, acc_cfg.n, step.name)
                acc = k.scratch_window(state.params, device)
                aux_sum: Any = None
                for mb in micro[:-1]:
                    acc, g = k.micro(state, acc, mb, acc_cfg.n, True)
                    aux_sum = _add_weighted(aux_sum, g.aux, g.weight)
                # The last microbatch adds to the window in place: note its weight first.
                before = acc.weight.clone() if aux_sum is not None else None
                new, metrics, _, w_last = last(state, acc, micro[-1], acc_cfg.n, False)
                if before is not None and "aux" in metrics:
                    total = _add_weighted(aux_sum, metrics["aux"], w_last)
                    weight = before + w_last
                    metrics["aux"] = pytree.tree_map(
                        lambda t: t / weight if _is_float(t) else t, total
                    )
            else:
                window: AccumState = state.substates["grad_accumulate"]
                rest = {k_: v for k_, v in state.substates.items() if k_ != "grad_accumulate"}
                inner = state.replace(substates=rest)
                if window.micro + 1 < acc_cfg.n:
                    acc, g = k.micro(inner, window, batch, acc_cfg.n, step.donate)
                    new = inner.replace(
                        substates={**rest, "grad_accumulate": acc.replace(micro=window.micro + 1)}
                    )
                    metrics = {"loss": g.value}
                    if g.aux is not None:
                        metrics["aux"] = g.aux
                else:
                    new, metrics, fresh, _ = last(inner, window, batch, acc_cfg.n, True)
                    new = new.replace(substates={**new.substates, "grad_accumulate": fresh})
            rng = rng_now()
            if step.donate and rng.shape == state.rng.shape:
                rng = state.rng.copy_(rng)  # the state's own tensor takes the advanced state
    finally:
        _IN_PLACE.reset(in_place)
    new = new.replace(rng=rng)
    if step.donate:
        mark_donated(given, f"step {step.name!r}")
        if state is not given:
            mark_donated(state, f"step {step.name!r}")
    return new, metrics


def _grads_into_module(step: Step, state: TrainState) -> bool:
    """Whether an eager window can accumulate in the module's own ``.grad``."""
    return step.compile_options is None and step.sync is None and module_tensors(state) is not None


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
    into = _IntoGrad()
    token = _INTO_GRAD.set(into)
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
            g = step.grad(step.loss, state, mb, 1.0 / n)
            aux_sum = _add_weighted(aux_sum, g.aux, g.weight)
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
        sums = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in params.items()}
        if not into.same:  # with equal weights the divisor is exactly 1
            torch._foreach_div_(list(sums.values()), total / (into.first * n))
        value = value_sum / total
        last = last.replace(value=value, weight=total)
        del into, value_sum
    finally:
        _INTO_GRAD.reset(token)
        for p, old in zip(plist, saved):
            p.grad = old
    # .grad holds sum_i (w_i / w_1) * grad_i / n; the window's mean gradient is
    # sum_i w_i * grad_i / sum_i w_i, that divided by sum_i w_i / (n * w_1) (1 when the
    # weights are equal).
    new, metrics = step.kernels.update_window(state, sums, None, value, total, last, True)
    if aux_sum is not None and "aux" in metrics:
        metrics["aux"] = pytree.tree_map(lambda t: t / total if _is_float(t) else t, aux_sum)
    return new, metrics


def _repeat_sum(w: torch.Tensor, k: int) -> torch.Tensor:
    """``w + w + ... + w`` (``k`` terms), added in order as a running sum would."""
    total = w.clone()
    for _ in range(k - 1):
        total.add_(w)
    return total


def _add_weighted(total: Any, aux: Any, w: torch.Tensor) -> Any:
    if aux is None:
        return None
    scaled = pytree.tree_map(lambda a: a * w if _is_float(a) else a, aux)
    if total is None:
        return scaled
    return pytree.tree_map(lambda t, a: t + a if _is_float(a) else a, total, scaled)


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
