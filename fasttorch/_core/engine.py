"""How the default phases compute: the gradients' four paths, the optimizer's update.

:func:`gradients` is :func:`fasttorch.phases.grad_phase`'s work, on one of four paths:

* in a graph, ``torch.autograd.grad`` on detached leaves (torch 2.12 and later) or
  ``torch.func.grad`` (earlier releases, and a population's members under vmap);
* eagerly over a donated state, the module's own parameters (:func:`module_tensors`),
  differentiated as they are, with no ``functional_call`` swapping tensors in and out;
* inside an eager accumulation window (an :class:`IntoGrad` in the call scope), a
  backward that adds into the module's ``.grad`` as ``loss.backward()`` does, also
  over a module sharded with FSDP2;
* otherwise ``torch.autograd.grad`` on detached copies of the state's parameters.

Each returns the gradients (none on the ``.grad`` path), the loss phase's
:class:`~fasttorch.phases.Loss` and the names of the parameters it did not reach.

The engine differentiates a function of a module's tensors (a :class:`Target`), as
``torch.func.grad`` does: it never sees the train state, which the gradient phase
closes over. :func:`apply_optimizer` is the update phase's work: the optimizer over
the gradients, fused on a GPU, in place when donating eagerly, skipped where asked.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar

import torch
import torch.utils._pytree as pytree

from fasttorch import _compat, _scope
from fasttorch._module import is_sharded
from fasttorch._reached import backward_leaves, check_reached
from fasttorch._tree import constant, reciprocal, scale_grads
from fasttorch.optim._base import Optimizer, OptState, update_used

__all__ = [
    "IntoGrad",
    "ModuleTensors",
    "Target",
    "apply_optimizer",
    "gradients",
    "module_tensors",
]

Batch: TypeAlias = Any
Tensors: TypeAlias = dict[str, torch.Tensor]


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
    into = None if compiling else _scope.current().into
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
    if not _scope.current().in_place:
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
    fused = (
        getattr(opt, "fused_update", None)
        if in_place and g.skip is not None and not g.unused
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
        lambda old, new: new if new is old else torch.where(keep, old, new),
        (params, opt_state),
        new,
    )
