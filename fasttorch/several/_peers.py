"""The other members, as a member of a several-model step sees them (:mod:`fasttorch.several`).

A member's loss function gets them as ``models``: ``models["d"](x)`` runs member ``"d"``
forward with its current parameters detached, so a gradient flows through it to ``x``
and never into its parameters. They travel into the member's step in its own state,
under the sub-state :data:`KEY`, so that under ``compiled`` they are graph inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from fasttorch import _compat, struct
from fasttorch._checks import warn_once
from fasttorch.models import Frozen, Member
from fasttorch.phases import Batch, Tensors
from fasttorch.state import TrainState
from fasttorch.steps import Step

KEY = "several.models"
"""The sub-state under which a member's step sees the other members during one call."""


class View(struct.Record):
    """What a member's step reads of another member: its tensors and its module."""

    params: Tensors
    buffers: Tensors
    module: nn.Module = struct.field(static=True)


class Others(struct.Record):
    """The sub-state (:data:`KEY`) that carries the other members into a member's step.

    ``outputs``: the shared forwards' outputs of this call, by name (detached);
    ``mine``: the names of those this member owns (its gradient flows through them).
    """

    views: dict[str, View]
    owner: str = struct.field(static=True)
    outputs: dict[str, torch.Tensor] = struct.field(default_factory=dict)
    mine: tuple[str, ...] = struct.field(static=True, default=())


class UnknownMemberError(KeyError):
    """A member's loss function asked ``models`` for a name the state does not have."""


class Peers:
    """The other members, as a member's loss function sees them (``models``).

    ``models["d"](x)`` runs member ``"d"``'s forward with its current parameters, in
    its own modes (a trained member in training mode updates its BatchNorm statistics,
    as the plain loop's ``d(g(z))`` does; a ``Frozen`` one never does). Its parameters
    are detached: a gradient flows through the forward to ``x``, never into them.
    """

    def __init__(self, others: Others, outputs: Tensors | None = None) -> None:
        self._others = others
        self._outputs = others.outputs if outputs is None else outputs

    @property
    def outputs(self) -> Mapping[str, torch.Tensor]:
        """The outputs of this call's shared forwards (``several(outputs=...)``), by name.

        Computed once at the start of the call. The member that owns one gets it with
        its gradient path into its own parameters; the others read it as a constant.
        """
        return _Outputs(self._outputs, self._others.owner)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        views = self._others.views
        if name not in views:
            owner = self._others.owner
            hint = (
                "its own forward is apply(x)"
                if name == owner
                else "add it to Models.create(...), or fix the name"
            )
            raise UnknownMemberError(
                f"member {owner!r}'s loss function asked for models[{name!r}], but the other "
                f"members are {sorted(views)}: {hint}"
            )
        return Peer(views[name])

    def __contains__(self, name: str) -> bool:
        return name in self._others.views

    def __iter__(self) -> Iterator[str]:
        return iter(self._others.views)


class Peer:
    """Another member as a loss function reads it: ``peer(x)`` runs it, ``peer.params``.

    ``params`` and ``buffers`` are its current tensors, detached (read-only for this
    loss: no gradient flows into another member's parameters); for a ``Frozen``
    member, ``params`` are its parameters and ``buffers`` its buffers.
    """

    def __init__(self, view: View) -> None:
        self._view = view

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _forward(self._view, *args, **kwargs)

    @property
    def params(self) -> Tensors:
        """The member's parameters by name, detached."""
        v = self._view
        if not v.params:  # a Frozen member: its parameters among its tensors
            names = {n for n, _ in v.module.named_parameters()}
            return {k: t.detach() for k, t in v.buffers.items() if k in names}
        return {k: p.detach() for k, p in v.params.items()}

    @property
    def buffers(self) -> Tensors:
        """The member's buffers by name (BatchNorm statistics), detached."""
        v = self._view
        if not v.params:
            names = {n for n, _ in v.module.named_parameters()}
            return {k: t.detach() for k, t in v.buffers.items() if k not in names}
        return {k: b.detach() for k, b in v.buffers.items()}


class _Outputs(Mapping[str, torch.Tensor]):
    def __init__(self, outputs: Tensors, owner: str) -> None:
        self._outputs, self._owner = outputs, owner

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._outputs:
            raise UnknownMemberError(
                f"member {self._owner!r}'s loss function asked for models.outputs[{name!r}], "
                f"but this call's shared forwards are {sorted(self._outputs)}: declare it "
                "as several({...}, outputs={name: (member, forward_fn)})"
            )
        return self._outputs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)


def _forward(view: View, *args: Any, **kwargs: Any) -> Any:
    params = {k: p.detach() for k, p in view.params.items()}
    buffers = view.buffers
    if buffers and view.module.training and BUFFERS_CAPTURED and torch.compiler.is_compiling():
        # torch.func.grad (the graph's gradient on torch < 2.12) refuses in-place writes
        # into a tensor it did not get as an argument: the other model's BatchNorm
        # statistics are computed on copies and not kept (several warns once, host-side).
        buffers = {k: b.clone() for k, b in buffers.items()}
    return functional_call(view.module, (params, buffers), args, kwargs)


BUFFERS_CAPTURED = not _compat.AUTOGRAD_GRAD_IN_GRAPH


def warn_captured(step: Step, name: str, members: Mapping[str, Member]) -> None:
    """Warn once when a compiled member's step cannot update another's buffers."""
    if not BUFFERS_CAPTURED or step.is_eager:
        return
    hit = [
        n
        for n, m in members.items()
        if n != name and isinstance(m, TrainState) and m.buffers and m.module.training
    ]
    if hit:
        warn_once(
            f"several: under compiled on torch {torch.__version__} (before 2.12) the "
            f"gradient of member {name!r} is taken by torch.func.grad, which cannot update "
            f"the buffers of {hit} in place: their forward in {name!r}'s loss uses its "
            "BatchNorm statistics without updating them (their own steps still do). "
            "torch 2.12 or later, or an eager step, updates them as the plain loop does"
        )


def view(member: Member, copy_buffers: bool) -> View:
    if isinstance(member, Frozen):
        return View(params={}, buffers=member.tensors, module=member.module)
    buffers = member.buffers
    if copy_buffers:  # copying semantics: a training forward updates BatchNorm statistics
        buffers = {k: b.clone() for k, b in buffers.items()}
    return View(params=member.params, buffers=buffers, module=member.module)


def eager_error(
    step: Step, own: TrainState, others: Others, batch: Batch, error: Exception
) -> UnknownMemberError | None:
    """The :class:`UnknownMemberError` that a compiler's trace wrapped in its own, if any.

    Raised while a graph is traced, it reaches the caller as the compiler's "observed
    exception", without its message: the member's loss phase runs once more, eagerly
    and without gradients, to raise it as eager does.
    """
    if step.is_eager or isinstance(error, UnknownMemberError):
        return None
    if "observed exception" not in str(error).lower():
        return None
    probe = own.with_substate(KEY, others).replace(
        buffers={k: b.clone() for k, b in own.buffers.items()},
    )
    try:
        with torch.no_grad():
            step.loss(probe, probe.params, probe.buffers, batch)
    except UnknownMemberError as e:
        return e
    except Exception:
        return None
    return None
