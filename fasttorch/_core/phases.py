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
every transform that inspects gradients does with it. This module is the whole contract
a transform author needs; how the default phases compute (the gradients' paths, the
optimizer's update) is :mod:`fasttorch._engine`'s, and the shared arithmetic
(:func:`global_norm`, :func:`scale_grads`, ...), re-exported here, :mod:`fasttorch._tree`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
import torch.utils._pytree as pytree

from fasttorch import _checks, _engine, _scope, struct
from fasttorch._buffers import BUFFERS_KEY as BUFFERS_KEY
from fasttorch._buffers import SKIP_BUFFERS as SKIP_BUFFERS
from fasttorch._buffers import restore_buffers
from fasttorch._engine import ModuleTensors
from fasttorch._module import call_with
from fasttorch._reached import unreached
from fasttorch._tree import add_weighted_aux as add_weighted_aux
from fasttorch._tree import batch_size, constant, describe
from fasttorch._tree import divide_aux as divide_aux
from fasttorch._tree import global_norm as global_norm
from fasttorch._tree import reciprocal as reciprocal
from fasttorch._tree import scale_grads as scale_grads
from fasttorch.optim._base import in_place_in_graph
from fasttorch.state import TrainState, is_sharded, reshard
from fasttorch.substates import any_declares

__all__ = [
    "BUFFERS_KEY",
    "SKIP_BUFFERS",
    "GradOut",
    "Loss",
    "add_weighted_aux",
    "as_loss",
    "batch_size",
    "describe",
    "divide_aux",
    "global_norm",
    "grad_phase",
    "loss_phase",
    "mark_skip",
    "no_state_read_after_inner",
    "opaque_update",
    "reads_no_state_after_inner",
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
        donated: the step donates the state (``step.donate``), set by the runner
            before the update phase. Static, so that a compiled step knows it while
            tracing: on a CPU an opaque optimizer then updates in place as the eager
            step does (:func:`opaque_update`).
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
    target = _engine.Target(state.module, state.params, state.buffers, functional, loss)
    grads, out, unused = _engine.gradients(functools.partial(loss, state), target, batch, mult)
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
    opaque = opaque_update(state, g.donated)
    norm = unscaled_norm(g, opaque=opaque)
    lr = state.optimizer.learning_rate(state.opt_state, state.step)
    eager_in_place = not torch.compiler.is_compiling() and _scope.current().in_place
    if eager_in_place:
        _scope.begin()  # the optimizer writes the donated state's tensors from here on
    params, opt_state = _engine.apply_optimizer(
        state.optimizer,
        state.params,
        state.opt_state,
        state.step,
        g,
        in_place=eager_in_place or opaque,
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
    """Whether a compiled step's update runs opaque, in place on the donated state.

    On a CPU, in a step that donates its state (``donated``: ``GradOut.donated``, or
    ``step.donate`` before the update phase), for an optimizer that asks for it
    (``optim._base.in_place_in_graph``: ``adam(..., opaque=True)``). The optimizer then
    runs as one operator on the state's own tensors, and the arithmetic over the
    gradients before it (the window's mean, the global norm, the clip's scaling) as
    operators of :mod:`fasttorch._opaque` on the gradients the update owns: pass it as
    ``opaque=`` to :func:`global_norm`, :func:`scale_grads` and :func:`unscaled_norm`.
    Not under ``vmap``, whose members' steps do not donate (``vmapped``), and not on a
    GPU, where it was not measured.
    """
    return (
        torch.compiler.is_compiling()
        and donated
        and state.device.type == "cpu"
        and in_place_in_graph(state.optimizer)
    )


def unscaled_norm(g: GradOut, *, opaque: bool = False) -> torch.Tensor:
    """The global norm of ``g``'s true gradients: ``g.norm`` once known, else computed.

    Gradients that still carry a loss scale have their norm divided by it, as
    ``GradScaler.unscale_`` followed by ``clip_grad_norm_`` computes it. ``opaque``: as
    in :func:`global_norm` (:func:`opaque_update`).
    """
    if g.norm is not None:
        return g.norm
    norm = global_norm(g.grads, opaque=opaque)
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
