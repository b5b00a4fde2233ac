"""The phases of a step and the contract between them.

A :class:`fasttorch.Step` runs three phases, pure functions that transforms replace one
at a time:

* ``loss(state, params, buffers, batch) -> Loss``: the forward pass through the user's
  loss function (``with_amp`` wraps it in autocast);
* ``grad(loss, state, batch, mult) -> GradOut``: gradients of ``loss * mult`` for one
  (micro)batch (``with_amp`` multiplies in the loss scale);
* ``update(state, grads) -> (state, metrics)``: optimizer update (``clip_scaled`` and
  ``with_amp`` act before it).

:class:`GradOut` carries the gradients from one to the next with what the transforms in
between learned about them (the loss scale they still carry, their true norm, whether
to skip the update); :func:`unscaled_norm` and :func:`mark_skip` are the two things
every transform that inspects gradients does with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch
import torch.utils._pytree as pytree
from torch.func import functional_call

from fasttorch import _checks, _compat, _scope, struct
from fasttorch.optim._base import computed_once, in_cpu_graph, update_used
from fasttorch.state import TrainState, is_sharded, reshard

__all__ = [
    "BUFFERS_KEY",
    "GradOut",
    "IntoGrad",
    "Loss",
    "ModuleTensors",
    "add_weighted_aux",
    "as_loss",
    "batch_size",
    "constant",
    "describe",
    "divide_aux",
    "global_norm",
    "grad_phase",
    "keep_buffers",
    "loss_phase",
    "mark_skip",
    "module_tensors",
    "reciprocal",
    "scale_grads",
    "skip_empty_window",
    "unscaled_norm",
    "update_phase",
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


LossFn: TypeAlias = Callable[[Callable[..., Any], Batch], Any]
LossPhase: TypeAlias = Callable[[TrainState, Tensors, Tensors, Batch], Loss]
GradPhase: TypeAlias = Callable[[LossPhase, TrainState, Batch, Any], GradOut]
UpdatePhase: TypeAlias = Callable[[TrainState, GradOut], "tuple[TrainState, Metrics]"]


def loss_phase(loss_fn: LossFn) -> LossPhase:
    """The loss phase of ``fasttorch.step(loss_fn)``: ``loss_fn(apply, batch)`` as a ``Loss``."""
    name = getattr(loss_fn, "__name__", repr(loss_fn))

    def loss(state: TrainState, params: Tensors, buffers: Tensors, batch: Batch) -> Loss:
        def apply(*args: Any, **kwargs: Any) -> Any:
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
            return functional_call(state.module, (params, buffers), args, kwargs)

        if torch.compiler.is_compiling():
            out = loss_fn(apply, batch)
        else:
            _scope.begin()  # the forward may update buffers in place from here on
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
    compiling = torch.compiler.is_compiling()
    into = None if compiling else _scope.current().into
    if into is not None and is_sharded(state.module):  # FSDP2: sync_on_last's window
        return _grad_into_module(loss, state, _SHARDED, batch, mult, into)
    direct = None if compiling else module_tensors(state)
    if into is not None and direct is not None:
        return _grad_into_module(loss, state, direct, batch, mult, into)
    if (compiling and not _compat.AUTOGRAD_GRAD_IN_GRAPH) or _functional_grads(state):
        return _grad_functional(loss, state, batch, mult)
    params: Tensors = (
        direct
        if direct is not None
        else {k: p.detach().requires_grad_() for k, p in state.params.items()}
    )
    with torch.enable_grad():
        out = loss(state, params, state.buffers, batch)
        found = torch.autograd.grad(out.value * mult, list(params.values()), allow_unused=True)
    # None marks a parameter the loss's graph does not reach: a fact about the graph,
    # known while it is traced, so the update skips it with no tensor read or branch.
    unused = frozenset(k for k, gi in zip(params, found) if gi is None)
    if direct is None and (unused or not compiling):
        check_reached(out.value, state, unused, loss)
    grads = [torch.zeros_like(p) if gi is None else gi for p, gi in zip(params.values(), found)]
    aux = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out.aux)
    return GradOut(
        grads=dict(zip(params, grads)),
        value=out.value.detach(),
        weight=out.weight,
        aux=aux,
        counted=out.counted,
        unused=unused,
    )


def _functional_grads(state: TrainState) -> bool:
    """Whether a sub-state asks for ``torch.func.grad`` (a record's ``functional_grads``).

    A population's members run under ``torch.func.vmap``, where ``torch.autograd.grad``
    cannot run (it needs ``requires_grad_()`` on batched tensors).
    """
    return any(getattr(s, "functional_grads", False) for s in state.substates.values())


def _grad_functional(loss: LossPhase, state: TrainState, batch: Batch, mult: Any) -> GradOut:
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

    def value(params: Tensors, buffers: Tensors) -> tuple[torch.Tensor, Any]:
        out = loss(state, params, buffers, batch)
        leaves, spec = pytree.tree_flatten(out.aux)
        is_t = [isinstance(x, torch.Tensor) for x in leaves]
        rest.append((spec, is_t, [None if t else x for x, t in zip(leaves, is_t)]))
        tensors = [x for x, t in zip(leaves, is_t) if t]
        return out.value * mult, (out.value, out.weight, tensors)

    grads, (v, weight, tensors) = torch.func.grad(value, has_aux=True)(
        dict(state.params), state.buffers
    )
    spec, is_t, others = rest[0]
    it = iter(tensors)
    aux = pytree.tree_unflatten([next(it) if t else x for x, t in zip(others, is_t)], spec)
    return GradOut(grads=dict(grads), value=v.detach(), weight=weight, aux=aux)


NO_PARAMETER_REACHED = "the loss function reached none of the state's parameters"
_USE_APPLY = (
    "the step would train nothing. If it calls the model itself (model(x), "
    "model.head(h)), call apply(x) instead: apply runs the model with the state's "
    "parameters, which are not the model's own tensors under compiled or donate=False. "
    "A loss that uses no parameter cannot be trained"
)


def unreached_error(error: BaseException) -> ValueError | None:
    """The :func:`check_reached` error that a compiler's trace wrapped in its own, if any.

    Raised while a graph is traced, the ``ValueError`` reaches the caller as the
    compiler's "unsupported: observed exception" with the message inside its text.
    """
    if isinstance(error, ValueError) or NO_PARAMETER_REACHED not in str(error):
        return None
    return ValueError(f"{NO_PARAMETER_REACHED}: {_USE_APPLY}")


# Per module: the (loss phase, unused parameters) pairs whose graph was found clean.
_CHECKED: weakref.WeakKeyDictionary[Any, set[tuple[Any, frozenset[str]]]] = (
    weakref.WeakKeyDictionary()
)


def check_reached(
    value: torch.Tensor, state: TrainState, unused: frozenset[str], loss: Any = None
) -> None:
    """Raise if the loss trained the module's own tensors instead of the state's.

    ``apply`` runs the module with the state's parameters (``functional_call``); a loss
    that calls the module itself (``model(x)``) reaches the module's own parameters,
    which only a donated eager state shares: under ``compiled`` or ``donate=False``
    nothing would train, silently. Two signs, both read from the graph, not from
    values: no parameter of the state reached (checked in a graph too), or one of the
    module's own parameters in the backward's graph (eager; once per module, loss
    phase and set of unused parameters).
    """
    if len(unused) == len(state.params):
        raise ValueError(f"{NO_PARAMETER_REACHED} ({len(state.params)}): {_USE_APPLY}")
    if torch.compiler.is_compiling():
        return
    seen = _CHECKED.setdefault(state.module, set())
    if (loss, unused) in seen:
        return
    own = {id(p): n for n, p in state.module.named_parameters() if n in state.params}
    hit = _reached_leaf(value, own)
    if hit is not None:
        raise ValueError(
            f"the loss function used the model's own parameter {hit!r} instead of the "
            "state's: it calls the model (or a part of it) directly, as model(x) or "
            "model.head(h). Those tensors are not trained under compiled or donate=False "
            "(the state's parameters are). Call the forward through apply: apply(x) for "
            "the whole model; for a part, return it from the model's forward"
        )
    seen.add((loss, unused))


def _reached_leaf(value: torch.Tensor, leaves: dict[int, str]) -> str | None:
    """The name of a leaf in ``leaves`` (by id) the backward of ``value`` reaches, if any."""
    seen: set[Any] = set()
    stack = [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None and id(variable) in leaves:
            return leaves[id(variable)]
        stack.extend(fn for fn, _ in node.next_functions)
    return None


class IntoGrad:
    """An eager window accumulating in the module's ``.grad`` (see ``_grad_into_module``).

    ``grad_accumulate`` puts one in the call scope (``_scope``) for the window
    (``sync_on_last`` too, for a sharded state).
    """

    first: torch.Tensor | None = None  # the weight each microbatch's seed is relative to
    same: bool = True  # every microbatch's weight is that same tensor (factors exactly 1)

    def reference(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight seeds are relative to, given the first microbatch's: that one.

        A sharded window (``sync_on_last``) takes the mean over ranks instead, so that
        every rank's gradients carry the same factor when FSDP2 reduces them.
        """
        return weight


def _grad_into_module(
    loss: LossPhase,
    state: TrainState,
    params: ModuleTensors,
    batch: Batch,
    mult: Any,
    into: IntoGrad,
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
            else constant(float(mult), device=v.device, dtype=v.dtype)
        )
        if into.first is None:
            into.first = into.reference(out.weight)
        if out.weight is not into.first:
            into.same = False
            seed = seed * (out.weight / into.first)
        inputs = _backward_inputs(params, state.module, v, batch)
        torch.autograd.backward(v, grad_tensors=seed, inputs=inputs)
    aux = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out.aux)
    return GradOut(
        grads={}, value=out.value.detach(), weight=out.weight, aux=aux, counted=out.counted
    )


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
    ``sharded``: empty, standing for a module sharded with FSDP2, whose forward
    all-gathers the state's shards itself.
    """

    complete: bool = False
    sharded: bool = False


_SHARDED = ModuleTensors()
_SHARDED.sharded = True


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
    if not _scope.current().in_place:
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


def update_phase(state: TrainState, g: GradOut) -> tuple[TrainState, Metrics]:
    """Unscale if needed, apply the optimizer, honour ``g.skip``; pure.

    Metrics: ``loss``, ``grad_norm`` (unscaled), ``lr``, ``aux`` if any, and ``skipped``
    whenever a transform marked the update skippable (:func:`mark_skip`), so a
    transform wrapping this phase reads the final skip flag from the metrics whatever
    the order it was applied in.
    """
    grads, norm = g.grads, unscaled_norm(g)
    opt = state.optimizer
    eager_in_place = not torch.compiler.is_compiling() and _scope.current().in_place
    # A fused kernel (fasttorch.optim's on a GPU) takes the loss scale and the skip flag
    # itself, as with GradScaler: no copy of the old state, no select per tensor.
    # Parameters the loss did not reach go through update_used's filter instead.
    fused = (
        getattr(opt, "fused_update", None)
        if eager_in_place and g.skip is not None and not g.unused
        else None
    )
    done = None
    if fused is not None:
        done = fused(
            state.params, grads, state.opt_state, state.step, grad_scale=g.scale, found_inf=g.skip
        )
    if done is None and g.scale is not None:
        grads = scale_grads(grads, reciprocal(g.scale))
    lr = opt.learning_rate(state.opt_state, state.step)
    # Eager and donating: update the state's tensors in place (fresh tensors cost more
    # than the arithmetic on CPU). Not when a skip must keep the old values around.
    inplace = g.skip is None and eager_in_place
    if done is None:
        params, opt_state = update_used(
            opt,
            state.params,
            grads,
            state.opt_state,
            state.step,
            unused=g.unused,
            inplace=inplace,
            reached=g.reached,
        )
    else:
        params, opt_state = done
    buffers, substates = state.buffers, state.substates
    if g.skip is not None:
        keep = g.skip
        if done is None:
            params, opt_state = pytree.tree_map(
                # A tensor the update returned as it was (a hyperparameter) is kept,
                # not copied: the fused GPU kernels know it by identity (no host read).
                lambda old, new: new if new is old else torch.where(keep, old, new),
                (state.params, state.opt_state),
                (params, opt_state),
            )
        buffers, substates = _restore_buffers(state, keep)
    metrics: Metrics = {
        "loss": g.value,
        "grad_norm": norm,
        # A copy: a constant lr is a state tensor, overwritten in place under donation.
        "lr": lr.clone(),
    }
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


BUFFERS_KEY = "skip_buffers"
"""The sub-state key of the module's buffers as they were when the window began."""


def keep_buffers(inits: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """``inits`` plus the buffer snapshot a transform that marks skips needs (once).

    The forward updates buffers (BatchNorm's running statistics) in place before the
    update phase learns whether to skip; a skipped update puts back the values they had
    when the window began, which this sub-state keeps: a copy of the module's buffers
    (not of frozen parameters), refreshed by every update.
    """
    if any(k == BUFFERS_KEY for k, _ in inits):
        return inits
    return (*inits, (BUFFERS_KEY, _snapshot_buffers))


def _snapshot_buffers(state: TrainState) -> Tensors:
    names = {n for n, _ in state.module.named_buffers()}
    return {k: b.clone() for k, b in state.buffers.items() if k in names}


def _restore_buffers(state: TrainState, skip: torch.Tensor) -> tuple[Tensors, dict[str, Any]]:
    """Buffers as they were when the window began where ``skip``, and the next snapshot."""
    kept: Tensors | None = state.substates.get(BUFFERS_KEY)
    if not kept:
        return state.buffers, state.substates
    buffers = dict(state.buffers)
    for k, old in kept.items():
        buffers[k] = torch.where(skip, old, buffers[k])
    # A copy, not the buffer itself: the next forward may update the buffer in place.
    snapshot = {k: buffers[k].clone() for k in kept}
    return buffers, {**state.substates, BUFFERS_KEY: snapshot}


def unscaled_norm(g: GradOut) -> torch.Tensor:
    """The global norm of ``g``'s true gradients: ``g.norm`` once known, else computed.

    Gradients that still carry a loss scale have their norm divided by it, as
    ``GradScaler.unscale_`` followed by ``clip_grad_norm_`` computes it.
    """
    if g.norm is not None:
        return g.norm
    norm = global_norm(g.grads)
    return norm if g.scale is None else norm * reciprocal(g.scale)


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
        # by a factor computed once (computed_once); one traced call for all tensors
        (factor,) = computed_once(factor)
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
