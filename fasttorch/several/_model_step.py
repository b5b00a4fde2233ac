"""One member's step of a step over several models: :func:`model_step`.

Its loss function is ``loss_fn(apply, batch, models)``; ``models`` are the other members
(:class:`~fasttorch.several._peers.Peers`), which :func:`fasttorch.several` puts into the
member's state for the call. Its phases also run a shared forward for ``several``
(:mod:`fasttorch.several._shared_forward`) and, for the member that owns one, differentiate
through it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from fasttorch.phases import Batch, Loss, Tensors, grad_phase, loss_phase, update_phase
from fasttorch.several._peers import KEY, Peers
from fasttorch.several._shared_forward import FORWARD_KEY, PREFIX, Request, owner_grads
from fasttorch.state import TrainState
from fasttorch.steps import Step

__all__ = ["model_step"]


def model_step(
    loss_fn: Callable[[Callable[..., Any], Batch, Peers], Any], *, donate: bool = True
) -> Step:
    """A step for one model of several: ``loss_fn(apply, batch, models)``.

    As :func:`fasttorch.step`, with a third argument: ``models``, the other members of
    the :class:`Models` state (``models["d"](x)`` runs member ``"d"``, see
    :class:`Peers`). Transform it as any step, then give it to :func:`several` under its
    member's name. Called on its own (outside :func:`several`) it raises.

    Equivalent to the plain loop's body for one of several models (Lightning's
    ``toggle_model``: the others' parameters take no gradient)::

        loss = loss_fn(g, batch, {"d": d})  # d(x): d's parameters with requires_grad off
        loss.backward()
        g_opt.step()
        g_opt.zero_grad(set_to_none=True)

    Args:
        loss_fn: ``(apply, batch, models) -> loss | (loss, aux) | Loss``.
        donate: as for :func:`fasttorch.step`; every member of one :func:`several`
            step must agree.

    Raises:
        TypeError: ``loss_fn`` is not callable or cannot be called with three arguments.

    Example:
        >>> import torch, fasttorch
        >>> def g_loss(apply, z, models):
        ...     return -models["d"](apply(z)).mean()
        >>> fasttorch.model_step(g_loss)
        Step('g_loss', transforms=[], substates=[], donate=True)
    """
    if not callable(loss_fn):
        raise TypeError(f"model_step expects a loss function, got {type(loss_fn).__name__}")
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    _check_arity(loss_fn, name)
    if not isinstance(donate, bool):
        raise TypeError(f"model_step: donate must be a bool, got {donate!r}")

    def call(apply: Callable[..., Any], batch: Any) -> Any:
        data, models = batch
        return loss_fn(apply, data, models)

    call.__name__ = call.__qualname__ = name
    inner = loss_phase(call)
    # The owner of a shared output reaches its parameters through it, apply or not
    # (and in evaluation, where nothing is differentiated, may read it alone).
    owning = loss_phase(call, needs_apply=False)

    def loss(state: TrainState, params: Tensors, buffers: Tensors, batch: Batch) -> Loss:
        request: Request | None = state.substates.get(FORWARD_KEY)
        if request is not None:  # several runs a shared forward through this phase
            return request.run(state, params, buffers, batch)
        others = state.substates.get(KEY)
        if others is None:
            raise ValueError(
                f"model_step {name!r} reads the other models (its loss function takes "
                "models): run it inside fasttorch.several({...}) over a fasttorch.Models "
                "state, or build a one-model step with fasttorch.step(loss_fn)"
            )
        outputs = None
        phase = owning if len(others.outputs) > 0 and not torch.is_grad_enabled() else inner
        if others.mine:  # the outputs it owns are differentiated as extra "parameters"
            outputs = {**others.outputs}
            outputs.update((k[len(PREFIX) :], v) for k, v in params.items() if k[:1] == "\x00")
            params = {k: v for k, v in params.items() if k[:1] != "\x00"}
            phase = owning
        # The data first: the default sample count is its first tensor's leading size.
        return phase(state, params, buffers, (batch, Peers(others, outputs)))

    def grad(loss: Any, state: TrainState, batch: Batch, mult: Any) -> Any:
        others = state.substates.get(KEY)
        if others is None or not others.mine:
            return grad_phase(loss, state, batch, mult)
        return owner_grads(
            lambda s: grad_phase(loss, s, batch, mult),
            state,
            others.owner,
            others.mine,
            others.outputs,
        )

    return Step(
        loss=loss,
        grad=grad,
        update=update_phase,
        name=name,
        doc=getattr(loss_fn, "__doc__", None),
        donate=donate,
    )


def _check_arity(loss_fn: Callable[..., Any], name: str) -> None:
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, None, None)
    except TypeError as e:
        raise TypeError(
            f"model_step: the loss function {name}{sig} cannot be called as "
            f"{name}(apply, batch, models) ({e}). A member's loss function takes apply (its "
            "own forward), batch, and models (the other members: models['d'](x))"
        ) from None
