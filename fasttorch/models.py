"""The state of a step over several models: :class:`Models`, its members, :class:`Frozen`.

A :class:`Models` holds named members: a :class:`~fasttorch.TrainState` per model that
trains and a :class:`Frozen` per model that is only read (a distillation teacher).
:func:`fasttorch.several` steps it (docs/several_models.md).
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

import torch
from torch import nn
from torch.func import functional_call

from fasttorch import _checks, struct
from fasttorch.phases import Tensors
from fasttorch.state import (
    DonatedStateError,
    TrainState,
    check_alive,
    evaluating,
    failure_summary,
    mark_donated,
    mark_failed,
)

__all__ = ["Frozen", "Member", "Models", "consume"]

_DEAD = "_fasttorch_models_donated"
_FAILED = "_fasttorch_models_failed"

# What to do once a donating several-model call failed after a member's step wrote.
AFTER_FAILURE = (
    "continue from the last Models state a call returned successfully, or from a "
    "checkpoint; if no call has returned yet, create the models and their state again (a "
    "donated state shares the models' tensors, which may hold part of the results). Build "
    "the members' steps with donate=False (model_step(loss_fn, donate=False)) to keep "
    "input states intact when a call fails"
)


class Frozen(struct.Record):
    """A model that other members read and no optimizer trains: a distillation teacher,
    or a target network that follows a trained member (``follows=``, polyak averaging).

    No optimizer, no optimizer state, no gradients: it runs in evaluation mode (dropout
    off, BatchNorm reading its running statistics and never updating them), with every
    tensor detached. Build it with :meth:`create`.

    Attributes:
        tensors: the module's parameters and buffers by name (the module's own
            storage, detached: no copy).
        module: the template module (static), kept in evaluation mode.

    Example:
        >>> import torch, fasttorch
        >>> teacher = fasttorch.Frozen.create(torch.nn.Linear(3, 2))
        >>> sorted(teacher.tensors), teacher.module.training
        (['bias', 'weight'], False)
    """

    tensors: Tensors
    module: nn.Module = struct.field(static=True)
    follows: str | None = struct.field(static=True, default=None)
    tau: float = struct.field(static=True, default=1.0)
    every: int = struct.field(static=True, default=1)

    @classmethod
    def create(
        cls, module: nn.Module, *, follows: str | None = None, tau: float = 1.0, every: int = 1
    ) -> Frozen:
        """Freeze ``module``: put it in evaluation mode and read its tensors (no copy).

        ``follows="q"`` makes it a target network of the trained member ``"q"`` (build
        it from a copy of that member's model): after every ``every``-th update of
        ``"q"``, within the same step, its parameters move towards ``"q"``'s by polyak
        averaging, ``t = t * (1 - tau) + tau * p`` (``tau=1``: a copy), and its
        floating buffers (BatchNorm statistics) take ``"q"``'s. Equivalent to::

            q_opt.step()
            if q_updates % every == 0:
                for t, p in zip(target.parameters(), q.parameters()):
                    t.data.mul_(1 - tau).add_(tau * p.data)

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            ValueError: its tensors are on more than one device, or it has none; ``tau``
                not in (0, 1] or ``every`` not a positive int, or either without
                ``follows``.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"Frozen.create expects an nn.Module, got {type(module).__name__}")
        if follows is not None and not isinstance(follows, str):
            raise TypeError(f"Frozen.create: follows names a member, got {follows!r}")
        _checks.real(
            "Frozen.create",
            "tau",
            tau,
            low=0.0,
            low_open=True,
            high=1.0,
            rule="in (0, 1] (the polyak weight of the followed member's parameters; 1 copies)",
        )
        _checks.count(
            "Frozen.create", "every", every, hint="The followed member's updates per target update."
        )
        if follows is None and (tau != 1.0 or every != 1):
            raise ValueError(
                "Frozen.create: tau and every describe a target network; name the member "
                "it follows: Frozen.create(copy.deepcopy(q_net), follows='q', tau=...)"
            )
        tensors = {n: p.detach() for n, p in module.named_parameters()}
        tensors.update((n, b.detach()) for n, b in module.named_buffers())
        if not tensors:
            raise ValueError(f"Frozen.create: {type(module).__name__} has no tensors to read")
        devices = {t.device for t in tensors.values()}
        if len(devices) > 1:
            raise ValueError(
                f"Frozen.create: the module's tensors are on {sorted(map(str, devices))}; "
                "move the whole module to one device first (module.to(device))"
            )
        module.eval()
        return cls(tensors=tensors, module=module, follows=follows, tau=float(tau), every=every)

    def followed(self, source: TrainState, in_place: bool) -> Frozen:
        """This target network after an update of the member it follows (``source``).

        Polyak averaging of the parameters where ``source.step`` is a multiple of
        ``every`` (a ``torch.where``, no host read), the floating buffers taken from
        ``source``; ``in_place`` (a donating step) writes into this record's tensors.
        """
        due = None if self.every == 1 else (source.step % self.every) == 0
        out = dict(self.tensors)
        with torch.no_grad():
            for k, t in self.tensors.items():
                p = source.params.get(k)
                if p is None:  # a buffer: the followed member's, as SB3's polyak_update(1.0)
                    p = new = source.buffers[k]
                elif self.tau == 1:
                    new = p
                else:  # the plain loop's t.mul_(1 - tau).add_(tau * p), out of place
                    new = t.mul(1 - self.tau).add(p * self.tau)
                if due is not None:
                    new = torch.where(due, new, t)
                if in_place:
                    t.copy_(new)
                else:
                    out[k] = new.clone() if new is p else new
        return self if in_place else self.replace(tensors=out)

    @property
    def device(self) -> torch.device:
        """The device of the tensors."""
        return next(iter(self.tensors.values())).device

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module in evaluation mode with these tensors, recording no gradient."""
        with evaluating(self.module), torch.no_grad():
            return functional_call(self.module, self.tensors, args, kwargs)


Member = TrainState | Frozen


class Models(struct.Record):
    """The state of a step over several models: named members, each trained or frozen.

    A :class:`~fasttorch.TrainState` per trained model (its own optimizer, step counter,
    RNG and transform sub-states) and a :class:`Frozen` per model that is only read.
    A pytree like any state: ``torch.compile`` and checkpoints see every member's
    tensors. ``state["g"]`` is a member.

    Example:
        >>> import torch, fasttorch
        >>> opt = fasttorch.optim.adam(1e-3)
        >>> state = fasttorch.Models.create(
        ...     d=fasttorch.TrainState.create(torch.nn.Linear(4, 1), opt),
        ...     g=fasttorch.TrainState.create(torch.nn.Linear(2, 4), opt),
        ... )
        >>> list(state.members), int(state["g"].step)
        (['d', 'g'], 0)
    """

    members: dict[str, Member]

    # The members' tensors are written in place by donating steps, as a TrainState's.
    kept_across_calls: ClassVar[bool] = True

    @classmethod
    def create(cls, **members: Member) -> Models:
        """Name each member: ``Models.create(d=TrainState..., g=..., teacher=Frozen...)``.

        Raises:
            TypeError: a member is neither a ``TrainState`` nor a ``Frozen``.
            ValueError: no member trains, two members share a module, or members are on
                different devices.
        """
        if not members:
            raise ValueError("Models.create: name at least one member, e.g. Models.create(g=...)")
        for name, m in members.items():
            if not isinstance(m, (TrainState, Frozen)):
                raise TypeError(
                    f"Models.create: member {name!r} is a {type(m).__name__}; a member is a "
                    "fasttorch.TrainState (a model that trains, with its optimizer) or a "
                    "fasttorch.Frozen (a model that is only read: Frozen.create(teacher))"
                )
            if isinstance(m, TrainState):
                check_alive(m, f"Models.create (member {name!r})")
        if not any(isinstance(m, TrainState) for m in members.values()):
            raise ValueError(
                f"Models.create: every member ({', '.join(members)}) is Frozen: nothing "
                "trains. Give the model that learns as a TrainState.create(model, opt)"
            )
        owners: dict[int, str] = {}
        for name, m in members.items():
            other = owners.setdefault(id(m.module), name)
            if other != name:
                raise ValueError(
                    f"Models.create: members {other!r} and {name!r} share one module; each "
                    "member is its own model. For two optimizers over parts of one model "
                    "use fasttorch.optim.groups (docs/several_models.md)"
                )
        for name, m in members.items():
            if isinstance(m, Frozen) and m.follows is not None:
                _check_follows(name, m, members)
        devices = {str(m.device) for m in members.values()}
        if len(devices) > 1:
            raise ValueError(
                f"Models.create: the members are on {sorted(devices)}; put every model on "
                "one device"
            )
        return cls(members=dict(members))

    def __getitem__(self, name: str) -> Member:
        try:
            return self.members[name]
        except KeyError:
            raise KeyError(
                f"Models has no member {name!r}; its members are {list(self.members)}"
            ) from None

    @property
    def device(self) -> torch.device:
        """The device of the members."""
        return next(iter(self.members.values())).device

    @property
    def module(self) -> nn.ModuleDict:
        """The members' modules as one ``nn.ModuleDict`` (a reference loop trains a copy)."""
        return nn.ModuleDict({n: m.module for n, m in self.members.items()})

    @property
    def params(self) -> Tensors:
        """The trained members' parameters, named as in :attr:`module` (``"g.0.weight"``)."""
        return {
            f"{n}.{k}": p
            for n, m in self.members.items()
            if isinstance(m, TrainState)
            for k, p in m.params.items()
        }

    def __getattr__(self, name: str) -> NoReturn:
        # Only reached when normal lookup fails: the fields of a donated state are gone.
        d = object.__getattribute__(self, "__dict__")
        if not name.startswith("__") and _FAILED in d:
            raise DonatedStateError(
                f"this Models state was donated to {d[_DEAD]}, which failed part-way "
                f"({d[_FAILED]}) after a member's step had updated its tensors in place, "
                f"or may have: the state is no longer consistent and cannot be used: "
                f"{AFTER_FAILURE}"
            )
        if not name.startswith("__") and _DEAD in d:
            raise DonatedStateError(
                f"this Models state was donated to {self.__dict__[_DEAD]}: its members' "
                "tensors were updated in place and now belong to the state that call "
                "returned. Use the returned state (state, metrics = step(state, batch)), "
                "or build the members' steps with donate=False"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        if _DEAD in self.__dict__:
            return "Models(<donated>)"
        kinds = {n: type(m).__name__ for n, m in self.members.items()}
        return f"Models({kinds})"


def _check_follows(name: str, target: Frozen, members: dict[str, Member]) -> None:
    source = members.get(target.follows or "")
    if not isinstance(source, TrainState):
        kind = "missing" if source is None else "a Frozen"
        raise ValueError(
            f"Models.create: member {name!r} follows {target.follows!r}, which is {kind}; "
            f"a target network follows a trained member (the members: {list(members)})"
        )
    mine = {k: (tuple(t.shape), t.dtype) for k, t in target.tensors.items()}
    theirs = {k: (tuple(t.shape), t.dtype) for k, t in {**source.params, **source.buffers}.items()}
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise ValueError(
            f"Models.create: member {name!r} follows {target.follows!r}, but their tensors "
            f"differ ({diff} ...); build the target from a copy of that member's model: "
            f"Frozen.create(copy.deepcopy(model), follows={target.follows!r})"
        )


def consume(
    state: Models, consumed: list[TrainState], by: str, error: BaseException | None = None
) -> None:
    """Mark the donated input and its consumed members dead (``error``: ``by`` failed
    part-way with it, after a member's step may have written)."""
    for m in consumed:
        if error is None:
            mark_donated(m, by)
        else:
            mark_failed(m, by, error)
    d = object.__getattribute__(state, "__dict__")
    d.clear()
    d[_DEAD] = by
    if error is not None:
        d[_FAILED] = failure_summary(error)


def failure_note(name: str, state: Models, *, wrote: bool, eager: bool) -> str:
    """The note on an error of step ``name`` over ``state``: after a member's step may
    have written its donated tensors (``wrote``), or before any did."""
    if wrote:
        return (
            f"fasttorch: the Models state passed to {name} was donated and is now "
            "unusable (DonatedStateError): a member's step had updated its tensors in place, "
            f"or may have, before the error: {AFTER_FAILURE}"
        )
    note = (
        f"fasttorch: the Models state passed to {name} is still usable: the call "
        "failed before any member's step wrote into it"
    )
    buffers = any(isinstance(m, TrainState) and m.buffers for m in state.members.values())
    if not (eager and buffers):
        return note
    # Not told apart by version counters: BatchNorm's kernels write its running
    # statistics without bumping them.
    return (
        f"{note}, except that the forwards may have updated buffers in place before the "
        "error (BatchNorm running statistics), as model(x) does in a plain loop. Build the "
        "members' steps with donate=False to keep them too"
    )
