"""Sub-states: the state a transform keeps, declared once by that transform.

A transform that keeps state between calls (a loss scale, an open accumulation
window, a moving average) declares it once, beside its record, as a :class:`SubState`
(its key in ``state.substates``, its record class, and how to build it from the
state), and installs it with ``step.with_phases(..., substate=declaration)``. The step
then adds it before its first call (``step.init``), so nothing is created inside a
compiled graph; the transform's phases read it as ``state.substates[KEY]`` and return
it with ``new.with_substate(KEY, value)``.

The record says, as class attributes, the properties the layers below the transforms
need; ``fasttorch.checkpoint``, ``fasttorch.evaluation``, the gradient phase and the
template check read them here and never name a transform or its key:

========================  ===========  ==================================================
class attribute           default      meaning
========================  ===========  ==================================================
``per_rank``              ``False``    its values differ between data-parallel ranks (a
                                       window of each rank's own microbatches): a
                                       checkpoint keeps each rank's own, under
                                       ``rank<r>/``, instead of one replicated copy
``window_position``       ``None``     the name of its static ``int`` field that counts
                                       the microbatches of an open window: a checkpoint
                                       saved inside a window is named ``..._micro<k>``,
                                       records ``micro`` and resumes on as many ranks
``eval_params``           ``None``     the name of its field holding parameters (same
                                       names as ``state.params``) that
                                       ``eval_step(step, use_ema=True)`` evaluates in
                                       place of ``state.params``
``eval_buffers``          ``None``     the name of its field holding buffers (names of
                                       ``state.buffers``) that evaluation with
                                       ``use_ema=True`` reads in place of the live ones
``stacks_members``        ``False``    every leaf of the state has one leading dimension,
                                       a population's members
``functional_grads``      ``False``    gradients come from ``torch.func.grad``
                                       (``torch.autograd.grad`` cannot run under
                                       ``torch.func.vmap``)
``kept_across_calls``     ``False``    a donating step writes into the same tensors on
                                       every call (``fasttorch.state.kept_leaves``)
``restores_buffers``     ``False``    it keeps the module's buffers as the window began:
                                       where an update is skipped the default update
                                       phase calls its ``restore(buffers, skip)``
                                       (``skip_nonfinite``'s ``SkipBuffers``)
========================  ===========  ==================================================

Everything else a checkpoint keeps follows from the record's shape: every tensor leaf,
under ``substates/<key>/<field>/...``, and its plain static fields (``int``, ``float``,
``str``, ``bool``, ``None``) in the manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs


class _State(Protocol):
    # What a declaration reads of a ``TrainState``: its sub-states. A protocol rather
    # than the class, because ``state`` imports this module (no import circle, even for
    # annotations: tests/test_import_cycles.py).
    @property
    def substates(self) -> dict[str, Any]: ...


__all__ = [
    "SubState",
    "any_declares",
    "declares",
    "eval_params",
    "merge",
    "per_rank_keys",
    "window_position",
]


@attrs.frozen
class SubState:
    """A transform's sub-state: its key, its record class, and how to build it.

    Declared once by the transform that owns it and installed with
    ``step.with_phases(name, ..., substate=declaration)``; ``step.init(state)`` (run by
    the step's first call too) adds ``init(state)`` under ``key`` when the state has
    none, and checks that it is a ``record``.

    Attributes:
        key: the key in ``state.substates``; the checkpoint's entries are
            ``substates/<key>/...``, so it never changes once released.
        record: the class of the value (a :class:`fasttorch.struct.Record` whose class
            attributes say its properties, see this module; or ``dict`` for a plain
            dict of tensors, which has none).
        init: ``init(state)`` builds the value from the ``TrainState`` it is added to.

    Example:
        >>> import torch, fasttorch
        >>> from fasttorch import struct
        >>> from fasttorch.substates import SubState
        >>> class Calls(struct.Record):
        ...     count: torch.Tensor
        >>> CALLS = SubState("calls", Calls, lambda s: Calls(torch.zeros((), dtype=torch.int64)))
        >>> def counted(step):
        ...     inner = step.update
        ...     def update(state, g):
        ...         new, metrics = inner(state, g)
        ...         old = state.substates["calls"]
        ...         return new.with_substate("calls", Calls(old.count + 1)), metrics
        ...     return step.with_phases("counted", update=update, substate=CALLS)
        >>> step = counted(fasttorch.step(lambda apply, x: apply(x).pow(2).mean()))
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 2), fasttorch.optim.sgd(0.1))
        >>> state, _ = step(state, torch.randn(4, 2))
        >>> int(state.substates["calls"].count)
        1
    """

    key: str = attrs.field(validator=attrs.validators.instance_of(str))
    record: type = attrs.field(validator=attrs.validators.instance_of(type))
    init: Callable[[Any], Any] = attrs.field(validator=attrs.validators.is_callable())

    def build(self, state: _State, owner: str) -> Any:
        """``init(state)``, checked to be a ``record`` (``owner``: the step, for errors)."""
        value = self.init(state)
        if not isinstance(value, self.record):
            raise TypeError(
                f"{owner}: the init of sub-state {self.key!r} returned a "
                f"{type(value).__name__}, but its declaration says {self.record.__name__}; "
                "return the declared record (or declare the class init returns)"
            )
        return value


def merge(
    declared: tuple[SubState, ...], new: SubState | tuple[SubState, ...], owner: str
) -> tuple[SubState, ...]:
    """``declared`` plus ``new``: each key once, so two transforms may share one declaration.

    Two different declarations under one key would overwrite each other's state: that
    raises, naming ``owner`` (the transform being applied).
    """
    out = list(declared)
    for d in (new,) if isinstance(new, SubState) else new:
        if not isinstance(d, SubState):
            raise TypeError(
                f"{owner}: substate= takes fasttorch.substates.SubState declarations, got "
                f"{type(d).__name__}"
            )
        same = [e for e in out if e.key == d.key]
        if not same:
            out.append(d)
        elif same[0] != d:
            raise ValueError(
                f"{owner}: sub-state {d.key!r} is already declared by another transform of "
                f"this step (a {same[0].record.__name__}); give each transform's sub-state "
                "a key of its own"
            )
    return tuple(out)


def declares(value: Any, name: str) -> Any:
    """The property ``name`` that ``value``'s record (or record class) declares, else
    its default here."""
    cls = value if isinstance(value, type) else type(value)
    return getattr(cls, name, _DEFAULTS[name])


_DEFAULTS: dict[str, Any] = {
    "per_rank": False,
    "window_position": None,
    "eval_params": None,
    "eval_buffers": None,
    "stacks_members": False,
    "functional_grads": False,
    "kept_across_calls": False,
}


def any_declares(substates: Mapping[str, Any], name: str) -> bool:
    """Whether a sub-state in ``substates`` declares the flag ``name`` (``stacks_members``)."""
    return any(declares(v, name) for v in substates.values())


def per_rank_keys(substates: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of the sub-states whose values differ between ranks (``per_rank``)."""
    return tuple(k for k, v in substates.items() if declares(v, "per_rank"))


def window_position(substates: Mapping[str, Any]) -> int | None:
    """Microbatches into the open window a sub-state keeps, ``None`` if none keeps one."""
    for v in substates.values():
        field = declares(v, "window_position")
        if field is not None:
            position: int = getattr(v, field)
            return position
    return None


def eval_params(substates: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(key, parameters)`` of each sub-state that declares parameters for evaluation."""
    out = []
    for k, v in substates.items():
        field = declares(v, "eval_params")
        if field is not None:
            out.append((k, getattr(v, field)))
    return out
