"""The phases of a step, their records, and how the default phases compute.

``fasttorch.phases`` is the public face (the contract a transform author reads); the
definitions live here, in reading order:

* numbers and trees with no notion of a step: a 0-d :func:`constant` cached in eager
  mode, the loss scale's :func:`reciprocal`, gradients scaled (:func:`scale_grads`)
  and their :func:`global_norm` as ``torch.optim`` computes them, a window's weighted
  ``aux`` sums, a batch's size and description;
* the engine, how the default phases compute over a module's tensors (a
  :class:`Target`) and never the train state, as ``torch.func.grad`` differentiates a
  function: :func:`gradients` on one of four paths (in a graph, ``torch.autograd.grad``
  on detached leaves, or ``torch.func.grad`` before torch 2.12 and under vmap; eagerly
  over a donated state, the module's own parameters, :func:`module_tensors`; inside an
  eager accumulation window, an :class:`IntoGrad` in the call scope, a backward into
  the module's ``.grad``, also sharded with FSDP2; otherwise ``torch.autograd.grad``
  on detached copies), and :func:`apply_optimizer`, the optimizer over the gradients
  (fused on a GPU, in place when donating eagerly, skipped where asked);
* the contract: :class:`Loss`, :class:`GradOut`, the three default phases
  (``loss(state, params, buffers, batch) -> Loss``, ``grad(loss, state, batch, mult)
  -> GradOut``, ``update(state, grads) -> (state, metrics)``) and the helpers every
  transform that inspects gradients shares (:func:`unscaled_norm`, :func:`mark_skip`,
  :func:`skip_empty_window`, :func:`opaque_update`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar

import torch
import torch.utils._pytree as pytree

from fasttorch import _checks, _compat, struct
from fasttorch._core import opaque as _opaque
from fasttorch._core.buffers import restore_buffers
from fasttorch._core.reached import backward_leaves, check_reached, unreached
from fasttorch._core.state import TrainState, begin, call_with, current, is_sharded, reshard
from fasttorch.optim import _inner
from fasttorch.optim._base import (
    Optimizer,
    OptState,
    computed_once,
    in_cpu_graph,
    in_place_in_graph,
    update_outside_graphs,
    update_used,
)
from fasttorch.substates import any_declares

__all__ = [
    "GradOut",
    "IntoGrad",
    "Loss",
    "ModuleTensors",
    "Target",
    "add_weighted_aux",
    "apply_optimizer",
    "as_loss",
    "batch_size",
    "clipped",
    "constant",
    "describe",
    "divide_aux",
    "global_norm",
    "grad_phase",
    "gradients",
    "loss_phase",
    "mark_skip",
    "module_tensors",
    "no_state_read_after_inner",
    "opaque_update",
    "reads_no_state_after_inner",
    "reciprocal",
    "scale_grads",
    "scaled_grads",
    "skip_empty_window",
    "unscaled_norm",
    "update_phase",
]


Batch: TypeAlias = Any
Tensors: TypeAlias = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- numbers

_CONSTANTS: dict[tuple[float, torch.dtype, torch.device, bool], torch.Tensor] = {}


def constant(x: float, *, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
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


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` computed as ``GradScaler`` does (in float64, then float32)."""
    return scale.double().reciprocal().float()


def scale_grads(
    grads: Mapping[str, torch.Tensor], factor: torch.Tensor, *, opaque: bool = False
) -> Tensors:
    """``grads`` times ``factor``: in place in eager mode (the update phase owns them).

    In a graph, out of place: an in-place multiply of a graph input (the accumulation
    window's gradients) would be written back into it, a copy of every gradient for
    nothing. The same multiplication either way, so the same bits. With ``opaque``
    (:func:`fasttorch.phases.opaque_update`), in a CPU graph, in place as one operator
    the compiler does not look into (:mod:`fasttorch._core.opaque`).
    """
    ts = list(grads.values())
    if opaque and in_cpu_graph(ts):
        _opaque.foreach_mul_(ts, factor)
        return dict(grads)
    if in_cpu_graph(ts):
        # by a factor computed once (computed_once); one traced call for all tensors
        (factor,) = computed_once(factor)
    if torch.compiler.is_compiling():
        return dict(zip(grads, torch._foreach_mul(ts, factor)))
    torch._foreach_mul_(ts, factor)
    return dict(grads)


def global_norm(tensors: Mapping[str, torch.Tensor], *, opaque: bool = False) -> torch.Tensor:
    """Global L2 norm, computed as ``torch.nn.utils.clip_grad_norm_`` does.

    In a CPU graph the per-tensor norms are ``linalg.vector_norm`` reductions, which
    inductor generates and fuses with what computes the gradients (the mean over an
    accumulation window); ``_foreach_norm`` has no CPU lowering and would need every
    gradient written out first for the ATen call. On CPU ``_foreach_norm`` is that same
    per-tensor call in eager mode. With ``opaque`` (:func:`scale_grads`), in a CPU graph
    the eager computation as one operator.
    """
    ts = list(tensors.values())
    if opaque and in_cpu_graph(ts):
        return _opaque.global_norm(ts)
    if in_cpu_graph(ts):
        norms = [torch.linalg.vector_norm(t) for t in ts]
    else:
        norms = list(torch._foreach_norm(ts))
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


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


def add_weighted_aux(total: Any, aux: Any, w: torch.Tensor) -> Any:
    """``total + aux * w`` over a window's ``aux`` trees (floating leaves; others kept)."""
    if aux is None:
        return None
    scaled = pytree.tree_map(lambda a: a * w if _is_float(a) else a, aux)
    if total is None:
        return scaled
    return pytree.tree_map(lambda t, a: t + a if _is_float(a) else a, total, scaled)


def divide_aux(total: Any, w: torch.Tensor) -> Any:
    """``total / w`` on the floating leaves: the weighted mean of :func:`add_weighted_aux`."""
    return pytree.tree_map(lambda t: t / w if _is_float(t) else t, total)


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def check_batch(
    batch: Batch, device: torch.device, api: str, params: dict[str, torch.Tensor] | None = None
) -> None:
    """Raise a clear error for batch leaves that are not tensors on ``device``.

    With ``params``, also for an empty batch (a leading dimension of 0 in its first
    tensor, the one whose size is the default sample count) and for floating tensors
    wider than every parameter (a float64 batch for float32 parameters). Both are
    host-side checks of metadata: nothing is read from the device.
    """
    leaves, _ = pytree.tree_flatten_with_path(batch)
    if not leaves:
        raise TypeError(f"{api}: the batch holds no tensors (got {describe(batch)})")
    sized = False
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
        if params is None:
            continue
        if not sized and x.ndim > 0:
            sized = True
            if x.shape[0] == 0:
                raise ValueError(
                    f"{api}: {where} has 0 rows (the batch is {describe(batch)}): an empty "
                    "batch would still apply an update (weight decay, momentum, the step "
                    "count). Skip empty batches before calling the step"
                )
        if x.is_floating_point():
            _check_width(x, where, params, batch, api)


def _check_width(
    x: torch.Tensor, where: str, params: dict[str, torch.Tensor], batch: Batch, api: str
) -> None:
    """Raise if floating ``x`` is wider than every parameter (one comparison as a rule)."""
    first = next(iter(params.values()))
    if x.dtype.itemsize <= first.dtype.itemsize:
        return
    dtypes = {p.dtype for p in params.values()}
    if x.dtype in dtypes or all(x.dtype.itemsize <= d.itemsize for d in dtypes):
        return
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    raise ValueError(
        f"{api}: {where} is {str(x.dtype).removeprefix('torch.')} but the parameters are "
        f"{names} (the batch is {describe(batch)}); a batch wider than the parameters "
        "fails inside the model (in a compiled step, as an error from generated code) or "
        f"computes in the wider type. Convert the batch first: x.to({first.dtype})"
    )


# --------------------------------------------------------------------------- the engine


class _Loss(Protocol):
    # What this module reads of a fasttorch.phases.Loss. A protocol rather than the
    # record, because phases imports this module (no import circle, even for
    # annotations: tests/test_import_cycles.py).
    @property
    def value(self) -> torch.Tensor: ...
    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def aux(self) -> Any: ...
    def replace(self: L, **changes: Any) -> L: ...


L = TypeVar("L", bound=_Loss)
Found: TypeAlias = tuple[Tensors, L, frozenset[str]]


Run: TypeAlias = Callable[[Tensors, Tensors, Batch], L]


class Target(NamedTuple):
    """The tensors the gradient phase differentiates a loss over, and their module.

    ``params`` and ``buffers`` are the state's, ``module`` the template they run in.
    ``functional``: a sub-state asks for ``torch.func.grad`` (a population's members
    run under ``torch.func.vmap``, where ``torch.autograd.grad`` cannot: it needs
    ``requires_grad_()`` on batched tensors). ``key`` names the loss phase for the
    reached-parameter check's once-only cache.
    """

    module: Any
    params: Tensors
    buffers: Tensors
    functional: bool
    key: Any


def gradients(run: Run[L], target: Target, batch: Batch, mult: Any) -> Found[L]:
    """Gradients of ``run(params, buffers, batch).value * mult`` over ``target``'s tensors, on
    the path that fits the call (see above). ``run`` is the loss phase with the batch
    and the train state closed over; ``batch`` is passed too, because a tensor of it
    that requires grad changes the backward's inputs."""
    compiling = torch.compiler.is_compiling()
    into = None if compiling else current().into
    if into is not None and is_sharded(target.module):  # FSDP2: a sharded window
        return _grad_into_module(run, target, _SHARDED, batch, mult, into)
    direct = None if compiling else module_tensors(target.module, target.params, target.buffers)
    if into is not None and direct is not None:
        return _grad_into_module(run, target, direct, batch, mult, into)
    if (compiling and not _compat.AUTOGRAD_GRAD_IN_GRAPH) or target.functional:
        return _grad_functional(run, target, batch, mult)
    params: Tensors = (
        direct
        if direct is not None
        else {k: p.detach().requires_grad_() for k, p in target.params.items()}
    )
    with torch.enable_grad():
        out = run(params, target.buffers, batch)
        found = torch.autograd.grad(out.value * mult, list(params.values()), allow_unused=True)
    # None marks a parameter the loss's graph does not reach: a fact about the graph,
    # known while it is traced, so the update skips it with no tensor read or branch.
    unused = frozenset(k for k, gi in zip(params, found) if gi is None)
    if len(unused) == len(params) or (direct is None and (unused or not compiling)):
        check_reached(out.value, target.module, target.params, unused, target.key)
    grads = [torch.zeros_like(p) if gi is None else gi for p, gi in zip(params.values(), found)]
    return dict(zip(params, grads)), out, unused


def _grad_functional(run: Run[L], target: Target, batch: Batch, mult: Any) -> Found[L]:
    """``grad_phase`` inside a graph on torch 2.10 and 2.11: ``torch.func.grad``.

    Dynamo there refuses ``Tensor.requires_grad_()`` (the eager path's detached leaves,
    2.11) or ``torch.autograd.grad`` (2.10); it traces ``torch.func.grad``. Later
    releases take the eager path in the graph too (``_compat.AUTOGRAD_GRAD_IN_GRAPH``):
    ``torch.func.grad`` does not support saved-tensor hooks, so activation checkpointing
    under ``compiled`` needs torch 2.12 or later. Parameters and buffers are
    arguments, not captured tensors: a BatchNorm forward writes its running statistics
    into the buffers in place.
    """
    rest: list[Any] = []  # torch.func.grad's aux holds tensors only: the rest goes around
    record: list[L] = []

    def value(params: Tensors, buffers: Tensors) -> tuple[torch.Tensor, Any]:
        out = run(params, buffers, batch)
        record.append(out)
        leaves, spec = pytree.tree_flatten(out.aux)
        is_t = [isinstance(x, torch.Tensor) for x in leaves]
        rest.append((spec, is_t, [None if t else x for x, t in zip(leaves, is_t)]))
        tensors = [x for x, t in zip(leaves, is_t) if t]
        return out.value * mult, (out.value, out.weight, tensors)

    grads, (v, weight, tensors) = torch.func.grad(value, has_aux=True)(
        dict(target.params), target.buffers
    )
    spec, is_t, others = rest[0]
    it = iter(tensors)
    aux = pytree.tree_unflatten([next(it) if t else x for x, t in zip(others, is_t)], spec)
    # The loss record with the values that came out of torch.func.grad (those inside
    # it are its wrapped tensors); not counted, as this path has always reported it.
    out = record[0].replace(value=v, weight=weight, aux=aux, counted=False)
    return dict(grads), out, frozenset()


class IntoGrad:
    """An eager window accumulating in the module's ``.grad`` (see ``_grad_into_module``).

    The window's ``.grad`` engine (:mod:`fasttorch.window`) puts one in the call scope
    (``_scope``) for the window, a sharded window one of its own (``fsdp.ShardedWindow``).
    """

    first: torch.Tensor | None = None  # the weight each microbatch's seed is relative to
    same: bool = True  # every microbatch's weight is that same tensor (factors exactly 1)

    def reference(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight seeds are relative to, given the first microbatch's: that one.

        A sharded window takes the mean over ranks instead, so that
        every rank's gradients carry the same factor when FSDP2 reduces them.
        """
        return weight


def _grad_into_module(
    run: Run[L],
    target: Target,
    params: ModuleTensors,
    batch: Batch,
    mult: Any,
    into: IntoGrad,
) -> Found[L]:
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
        out = run(params, target.buffers, batch)
        v = out.value
        seed = (
            mult.to(v.dtype)
            if isinstance(mult, torch.Tensor)
            else constant(float(mult), device=v.device, dtype=v.dtype)
        )
        if into.first is None:
            into.first = into.reference(out.weight)
        if out.weight is not into.first:
            into.same = False
            seed = seed * (out.weight / into.first)
        inputs = _backward_inputs(params, target.module, v, batch)
        torch.autograd.backward(v, grad_tensors=seed, inputs=inputs)
    return {}, out, frozenset()


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
    if params.sharded:  # FSDP2 swaps its unsharded parameters in: loss.backward() as is
        return None
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
    return all(id(v) in allowed for v in backward_leaves(value))


class ModuleTensors(dict[str, torch.Tensor]):
    """The module's own parameters, standing for ``state.params`` (same storage).

    ``complete``: every parameter of the module that requires grad is among them.
    ``sharded``: empty, standing for a module sharded with FSDP2, whose forward
    all-gathers the state's shards itself.
    """

    complete: bool = False
    sharded: bool = False


_SHARDED = ModuleTensors()
_SHARDED.sharded = True


_MODULE_PARAMS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def module_tensors(module: Any, params: Tensors, buffers: Tensors) -> ModuleTensors | None:
    """The module's own parameters when a state's ``params`` and ``buffers`` are still
    ``module``'s own tensors.

    A donated state shares storage with its module (``TrainState.create`` takes no
    copy and donating steps update in place). Then the module can run as it is, and
    ``torch.autograd.grad`` can differentiate its own parameters: the same graph and
    numbers as ``functional_call`` without swapping every tensor in and out on every
    call, which costs more than the arithmetic of a small model. Any state whose
    tensors are not the module's (copying semantics, a loaded checkpoint) gets ``None``
    and goes through ``functional_call``.
    """
    if not current().in_place:
        return None
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
    if last is not None and last[0] is params and last[1] is buffers:
        return last[2]  # type: ignore[no-any-return]
    out: ModuleTensors | None = ModuleTensors()
    for group in (params, buffers):
        for k, t in group.items():
            m = tensors.get(k)
            if m is None or m.data_ptr() != t.data_ptr() or m.shape != t.shape:
                out = None
                break
        if out is None:
            break
    if out is not None:
        for k in params:
            p = named.get(k)
            if p is None or not p.requires_grad:
                out = None
                break
            out[k] = p
    if out is not None:
        out.complete = sum(p.requires_grad for p in named.values()) == len(out)
    cached[2] = (params, buffers, out)
    return out


class _Grads(Protocol):
    # What apply_optimizer reads of a fasttorch.phases.GradOut (a protocol: see _Loss).
    @property
    def grads(self) -> Tensors: ...
    @property
    def scale(self) -> torch.Tensor | None: ...
    @property
    def skip(self) -> torch.Tensor | None: ...
    @property
    def unused(self) -> frozenset[str]: ...
    @property
    def reached(self) -> Tensors | None: ...
    @property
    def opaque(self) -> bool: ...


def apply_optimizer(
    opt: Optimizer,
    params: Tensors,
    opt_state: OptState,
    step: torch.Tensor,
    g: _Grads,
    *,
    in_place: bool,
) -> tuple[Tensors, OptState]:
    """``opt``'s update of ``params`` by ``g``'s gradients: unscaled, and kept as they
    were where ``g.skip``; ``in_place`` (eager, donating) may update the tensors given.

    A fused kernel (fasttorch.optim's on a GPU) takes the loss scale and the skip flag
    itself, as with GradScaler: no copy of the old state, no select per tensor.
    Parameters the loss did not reach go through ``update_used``'s filter instead.
    """
    grads = g.grads
    # With an opaque optimizer (g.opaque) its kernel takes the factor the gradients
    # carry (the window's total weight, the clip's coefficient) whether or not a skip.
    fused = (
        getattr(opt, "fused_update", None)
        if in_place and (g.skip is not None or g.opaque) and not g.unused
        else None
    )
    if fused is not None:
        done = fused(params, grads, opt_state, step, grad_scale=g.scale, found_inf=g.skip)
        if done is not None:
            return done  # type: ignore[no-any-return]
    if g.scale is not None:
        grads = scale_grads(grads, reciprocal(g.scale))
    # In place when eager and donating (fresh tensors cost more than the arithmetic on
    # CPU); not when a skip must keep the old values around.
    new = update_used(
        opt,
        params,
        grads,
        opt_state,
        step,
        unused=g.unused,
        inplace=g.skip is None and in_place,
        reached=g.reached,
    )
    if g.skip is None:
        return new
    keep = g.skip
    return pytree.tree_map(  # type: ignore[no-any-return]
        # A tensor the update returned as it was (a hyperparameter) is kept, not
        # copied: the fused GPU kernels know it by identity (no host read).
        lambda old, new: new if new is old else _inner.where(keep, old, new),
        (params, opt_state),
        new,
    )


# --------------------------------------------------------------------------- the contract

Metrics: TypeAlias = dict[str, Any]


class Loss(struct.Record):
    """What a loss function may return when a bare scalar is not enough.

    Attributes:
        value: the mean loss over ``weight`` samples or tokens (a 0-d float tensor).
        weight: how many samples or tokens ``value`` averages over (for a masked
            token loss, ``mask.sum()``). Defaults to the batch's leading dimension.
            Accumulation and data parallelism weight each microbatch by it, so the
            result is the mean over the whole batch whatever the microbatch sizes.
        aux: auxiliary outputs (a pytree of tensors), returned in ``metrics["aux"]``.
        counted: set by fasttorch, not by the loss function: whether ``weight`` came
            from it (and so may be 0), rather than from the batch's size.
    """

    value: torch.Tensor
    weight: Any = None
    aux: Any = None
    counted: bool = struct.field(static=True, default=False)


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
        counted: the loss function gave ``weight`` (see :class:`Loss`), so a window's
            total weight may be 0.
        unused: names of the parameters the loss did not reach, known when the graph
            is built (``torch.autograd.grad(..., allow_unused=True)`` gives ``None``):
            their entries in ``grads`` are zeros, and the update leaves them, and their
            optimizer state, as they are, as ``torch.optim`` skips a ``grad`` of
            ``None`` (docs/concepts.md, "Parameters a step does not use").
        reached: for names in ``unused``, a 0-d bool tensor: whether another rank's
            loss reached that parameter in the window (``sync_on_last``). Such a
            parameter is updated with its (averaged) gradient where true and kept as
            it is where false, as DDP with ``find_unused_parameters=True`` does.
        donated: the step donates the state (``step.donate``), set by the runner
            before the update phase. Static, so that a compiled step knows it while
            tracing: on a CPU an opaque optimizer then updates in place as the eager
            step does (:func:`opaque_update`).
        opaque: the runner chose the opaque fast path for this update
            (:func:`opaque_update`, decided where it sets ``donated``). Static. The
            contract's helpers read it (:func:`unscaled_norm`, :func:`scaled_grads`,
            the default update phase), so a transform never names the fast path.
    """

    grads: Tensors
    value: torch.Tensor
    weight: torch.Tensor
    aux: Any = None
    scale: torch.Tensor | None = None
    norm: torch.Tensor | None = None
    skip: torch.Tensor | None = None
    counted: bool = struct.field(static=True, default=False)
    unused: frozenset[str] = struct.field(static=True, default=frozenset())
    reached: Tensors | None = None
    donated: bool = struct.field(static=True, default=False)
    opaque: bool = struct.field(static=True, default=False)


LossFn: TypeAlias = Callable[[Callable[..., Any], Batch], Any]
LossPhase: TypeAlias = Callable[[TrainState, Tensors, Tensors, Batch], Loss]
GradPhase: TypeAlias = Callable[[LossPhase, TrainState, Batch, Any], GradOut]
UpdatePhase: TypeAlias = Callable[[TrainState, GradOut], "tuple[TrainState, Metrics]"]


def loss_phase(loss_fn: LossFn, *, needs_apply: bool = True) -> LossPhase:
    """The loss phase of ``fasttorch.step(loss_fn)``: ``loss_fn(apply, batch)`` as a ``Loss``.

    ``needs_apply=False`` lets the loss reach the parameters other than through
    ``apply``: through a forward of the same parameters the step differentiates as
    well (a shared forward's output, :func:`fasttorch.several`'s ``outputs``).
    """
    name = getattr(loss_fn, "__name__", repr(loss_fn))

    def loss(state: TrainState, params: Tensors, buffers: Tensors, batch: Batch) -> Loss:
        called: list[bool] = []  # whether loss_fn ran the model through apply

        def apply(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                # Eager only: in a graph, apply may run inside torch.utils.checkpoint,
                # whose region refuses side effects; the compiled step refuses an
                # unreached loss from its graph's inputs instead (_reached).
                called.append(True)
            # The module's own tensors (a sharded state's are its shards, and a sharded
            # state never runs in a graph: FSDP2's hooks cannot): call it as is.
            own = type(params) is ModuleTensors
            if own or (
                not torch.compiler.is_compiling()
                and is_sharded(state.module)
                and params is state.params
            ):
                out = state.module(*args, **kwargs)
                if not own and not torch.is_grad_enabled():
                    # No backward will come to reshard the root (evaluation): do it now,
                    # so the module holds the state's shards again, not a full copy.
                    reshard(state.module)
                return out
            return call_with(state.module, (params, buffers), state.ties, args, kwargs)

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
        record = as_loss(out, batch, name)
        if needs_apply and not torch.compiler.is_compiling() and len(called) == 0:
            # The model itself, or a copy of it, ran instead: under compiled or
            # donate=False that trains nothing, and a donated eager step, whose state
            # shares the model's tensors, refuses it too rather than train differently.
            raise unreached(f"loss function {name!r} never called apply")
        return record

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
        # A Python number the user gave is checked here (a tensor's value cannot be without
        # a sync); the batch's own size needs no check, and under dynamic shapes it is a
        # symbolic int that only float() may read.
        if loss.weight is not None and not isinstance(weight, (torch.SymInt, torch.SymFloat)):
            weight = _checks.real(
                f"loss function {name!r}",
                "Loss.weight",
                weight,
                low=0.0,
                hint="It is the number of samples or tokens the mean loss is over.",
            )
        weight = constant(float(weight), device=v.device)
    return Loss(v, weight.to(torch.float32), loss.aux, counted=loss.weight is not None)


def grad_phase(loss: LossPhase, state: TrainState, batch: Batch, mult: Any) -> GradOut:
    """Gradients of ``loss.value * mult`` with respect to ``state.params``.

    ``mult`` carries the factors transforms put on the loss before backward: ``1/n``
    for accumulation, the loss scale for fp16. The gradients come from
    ``torch.autograd.grad`` on detached leaves (``compiled`` lets dynamo trace it), as
    ``loss.backward()`` computes them; parameters the loss does not reach get zeros
    and are named in ``GradOut.unused``, so that the update leaves them alone.
    ``loss`` gets the very tensors that are differentiated as its ``params``, so a loss
    that registers hooks on them (``sync_on_last``'s reducer) sees each gradient as the
    backward produces it.
    """

    functional = any_declares(state.substates, "functional_grads")
    target = Target(state.module, state.params, state.buffers, functional, loss)
    grads, out, unused = gradients(functools.partial(loss, state), target, batch, mult)
    aux = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out.aux)
    return GradOut(
        grads=grads,
        value=out.value.detach(),
        weight=out.weight,
        aux=aux,
        counted=out.counted,
        unused=unused,
    )


def update_phase(state: TrainState, g: GradOut) -> tuple[TrainState, Metrics]:
    """Unscale if needed, apply the optimizer, honour ``g.skip``; pure.

    Metrics: ``loss``, ``grad_norm`` (unscaled), ``lr``, ``aux`` if any, and ``skipped``
    whenever a transform marked the update skippable (:func:`mark_skip`), so a
    transform wrapping this phase reads the final skip flag from the metrics whatever
    the order it was applied in.
    """
    norm = unscaled_norm(g)
    lr = state.optimizer.learning_rate(state.opt_state, state.step)
    eager_in_place = not torch.compiler.is_compiling() and current().in_place
    if eager_in_place:
        begin()  # the optimizer writes the donated state's tensors from here on
    params, opt_state = apply_optimizer(
        state.optimizer,
        state.params,
        state.opt_state,
        state.step,
        g,
        in_place=eager_in_place or g.opaque,
    )
    buffers, substates = state.buffers, state.substates
    if g.skip is not None:
        buffers, substates = restore_buffers(state, g.skip)
    # lr: a copy, as a constant lr is a state tensor, overwritten in place under donation.
    metrics: Metrics = {"loss": g.value, "grad_norm": norm, "lr": lr.clone()}
    if g.aux is not None:
        metrics["aux"] = g.aux
    if g.skip is not None:
        metrics["skipped"] = g.skip
    new = state.replace(
        params=params,
        opt_state=opt_state,
        buffers=buffers,
        substates=substates,
        # In place when donating eagerly: one launch, not an add and the commit's copy.
        step=state.step.add_(1) if eager_in_place else state.step + 1,
    )
    return new, metrics


_NO_READ_AFTER = "__fasttorch_reads_no_state_after_inner__"


def no_state_read_after_inner(update: UpdatePhase) -> UpdatePhase:
    """Declare that ``update``, wrapping an inner update phase, reads nothing of the state
    it is given after the inner phase returns (it reads the state before, or the new one).

    A donating eager step then lets the inner phases write the state's tensors in place
    (the optimizer, the step counter): no copy at the commit. An update phase not
    declared this way sees its input state unchanged after calling the inner one, as
    in a compiled step, because the new values then reach the state's tensors only
    when the step commits them (``Step.in_place_update``, docs/concepts.md, "Phases").
    Returns ``update`` itself.

    Example:
        >>> import torch, fasttorch
        >>> from fasttorch.phases import no_state_read_after_inner
        >>> def with_next_step(step):
        ...     inner = step.update
        ...
        ...     @no_state_read_after_inner  # reads only `new` after inner returns
        ...     def update(state, g):
        ...         new, metrics = inner(state, g)
        ...         return new, {**metrics, "next_step": new.step.clone()}
        ...
        ...     return step.with_phases("with_next_step", update=update)
        >>> s = with_next_step(fasttorch.step(lambda apply, x: apply(x).pow(2).mean()))
        >>> s.in_place_update
        True
    """
    setattr(update, _NO_READ_AFTER, True)
    return update


def reads_no_state_after_inner(update: UpdatePhase) -> bool:
    """Whether ``update`` is :func:`update_phase` or declared by
    :func:`no_state_read_after_inner`."""
    return update is update_phase or getattr(update, _NO_READ_AFTER, False) is True


def opaque_update(state: TrainState, donated: bool) -> bool:
    """Whether a step's update runs opaque, in place on the donated state.

    On a CPU, in a step that donates its state (``donated``: ``GradOut.donated``, or
    ``step.donate`` before the update phase), for an optimizer that asks for it
    (``optim._base.in_place_in_graph``: ``adam(..., opaque=True)``). The optimizer then
    runs torch's fused CPU kernel on the state's own tensors, which divides out the
    factor the gradients carry (``GradOut.scale``): the window's mean is folded into
    that factor instead of being a pass over every gradient. A compiled step runs such
    an update outside its graphs, as the eager step runs it
    (``fasttorch._core.step.update_outside``), so both give the same bits; a graph
    that holds one (a function of your own over these phases) calls the kernel, the
    global norm and the clip's multiply (:func:`clipped`) as operators of
    :mod:`fasttorch._core.opaque` and ``fasttorch::adam_fused_``, with the same bits.
    The runner decides it where it sets ``GradOut.donated`` and fills
    ``GradOut.opaque``, which :func:`unscaled_norm`, :func:`clipped` and the default
    update phase read: a transform never names it. The window's own mean reads it here.
    Not under ``vmap``, whose members' steps do not donate (``vmapped``), and not on a
    GPU, where it was not measured.
    """
    return donated and state.device.type == "cpu" and in_place_in_graph(state.optimizer)


def outside_graphs(state: TrainState, donated: bool) -> bool:
    """Whether a compiled step runs its update outside its graphs, as eagerly.

    Where :func:`opaque_update` holds, and for an optimizer a compiler cannot trace
    (``optim._base.update_outside_graphs``: ``from_torch(..., fused=True)``), in a CPU
    step that donates its state.
    """
    return donated and state.device.type == "cpu" and update_outside_graphs(state.optimizer)


def unscaled_norm(
    g: GradOut, *, opaque: bool | None = None, inv: torch.Tensor | None = None
) -> torch.Tensor:
    """The global norm of ``g``'s true gradients: ``g.norm`` once known, else computed.

    Gradients that still carry a loss scale have their norm divided by it, as
    ``GradScaler.unscale_`` followed by ``clip_grad_norm_`` computes it (``inv``: the
    scale's :func:`reciprocal`, where the caller computed it already). ``opaque``: as in
    :func:`global_norm`; by default the runner's choice, ``g.opaque``.
    """
    if g.norm is not None:
        return g.norm
    norm = global_norm(g.grads, opaque=g.opaque if opaque is None else opaque)
    if g.scale is None:
        return norm
    return norm * (reciprocal(g.scale) if inv is None else inv)


def clipped(
    g: GradOut, coef: torch.Tensor, *, norm: torch.Tensor, inv: torch.Tensor | None = None
) -> GradOut:
    """``g`` with its true gradients times ``coef`` (0-d), ``norm`` known.

    ``g.grads / g.scale * coef``: multiplied now by ``coef`` times the scale's
    :func:`reciprocal` (``inv``, where the caller computed it already), in one pass,
    and unscaled. On the opaque path the runner chose (``g.opaque``: the optimizer's
    kernel divides out the factor the gradients carry) the gradients are multiplied by
    ``coef`` alone, in place as one operator, and keep their factor, which the
    optimizer's pass divides out: with a factor that is a power of two (a loss scale,
    a window of 2**k equal microbatches) the same bits as the hand-written loop's
    unscale, then ``clip_grad_norm_``'s multiply.
    """
    if g.opaque:
        return g.replace(grads=scale_grads(g.grads, coef, opaque=True), norm=norm)
    if g.scale is not None:
        coef = coef * (reciprocal(g.scale) if inv is None else inv)
    return g.replace(grads=scaled_grads(g, coef), scale=None, norm=norm)


def scaled_grads(g: GradOut, factor: torch.Tensor) -> Tensors:
    """``g``'s gradients times ``factor``, as :func:`scale_grads` computes them, on the
    fast path the runner chose for this update (``g.opaque``)."""
    return scale_grads(g.grads, factor, opaque=g.opaque)


def mark_skip(g: GradOut, skip: torch.Tensor) -> GradOut:
    """``g`` with its update also skipped where ``skip`` (a bool tensor) is true."""
    return g.replace(skip=skip if g.skip is None else g.skip | skip)


def skip_empty_window(g: GradOut) -> GradOut:
    """``g``, a window's mean gradient, skipped when its total weight is 0.

    Only when the loss function gave the weights (``g.counted``): a weight taken from
    the batch's size is never 0, and a window that cannot be empty pays nothing. An
    empty window's mean is 0/0; the update is skipped instead (a ``torch.where``).
    """
    return mark_skip(g, g.weight == 0) if g.counted else g
