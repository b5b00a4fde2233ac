"""Steps over several models: a GAN, a student and its frozen teacher, an actor and a critic.

A :class:`Models` state holds named members: a :class:`~fasttorch.TrainState` per model
that trains (each with its own optimizer and transform sub-states) and a :class:`Frozen`
per model that is only read (a teacher). :func:`several` runs one step per trained
member, in order, within one call. Each member's step is an ordinary fasttorch step
built by :func:`model_step`, so every transform wraps it as it wraps any step
(``with_amp``, ``grad_accumulate``, ``clip_scaled``, ``sync_on_last``, ``ema``, ...),
and ``compiled`` of the whole compiles each member's step.

A member's loss function is ``loss_fn(apply, batch, models)``: ``models["d"](x)`` runs
the member ``"d"`` forward with its current parameters, which get no gradient
(Lightning's ``toggle_model``): a gradient flows through it to ``x``, never into its
parameters. The other members are given to the loss function through the member's own
state (a sub-state under :data:`KEY`, put in by :func:`several` and taken out again), so
under ``compiled`` they are inputs of the member's graphs, never constants.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from fasttorch._core import state as _scope
from fasttorch.evaluation import eval_step as _eval_step
from fasttorch.models import Frozen, Member, Models, consume, failure_note
from fasttorch.phases import Batch, Metrics, Tensors
from fasttorch.several._model_step import model_step
from fasttorch.several._peers import (
    KEY,
    Others,
    Peers,
    UnknownMemberError,
    eager_error,
    view,
    warn_captured,
)
from fasttorch.several._shared_forward import (
    Forward,
    Pending,
    check_outputs,
    check_owner_step,
    run_forwards,
)
from fasttorch.several._shared_scale import SharedScale
from fasttorch.state import (
    TrainState,
    check_alive,
    evaluating,
    is_sharded,
)
from fasttorch.steps import Step
from fasttorch.transforms.with_amp import KEY as AMP_KEY

__all__ = [
    "KEY",
    "Peers",
    "Several",
    "UnknownMemberError",
    "model_step",
    "several",
]


# --------------------------------------------------------------------------- the step


@attrs.frozen(slots=False)
class Several:
    """A step over a :class:`Models` state: each member's step in turn. See :func:`several`."""

    steps: tuple[tuple[str, Step], ...]
    name: str
    share_loss_scale: bool = False
    outputs: tuple[tuple[str, Forward], ...] = ()
    idle: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        self.__dict__["__name__"] = self.__dict__["__qualname__"] = self.name
        steps = dict(self.steps)
        for out, f in self.outputs:  # also after map_steps: a transform added later
            check_owner_step(out, f.owner, steps[f.owner])
        split = [n for n, s in self.steps if s.window.n > 1 and not s.window.across_calls]
        if self.outputs and split:
            raise ValueError(
                f"several: the steps of {split} split each call's batch (grad_accumulate "
                "without across_calls), but a shared output is computed from the whole "
                "call's batch; accumulate across calls instead: grad_accumulate(step, n, "
                "across_calls=True), each call one microbatch"
            )

    @property
    def donate(self) -> bool:
        """Whether the members' steps donate their input state (all agree)."""
        return self.steps[0][1].donate

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {s!r}" for n, s in self.steps)
        return f"Several({{{parts}}})"

    def __call__(self, state: Models, batch: Batch) -> tuple[Models, Metrics]:
        return _run(self, state, batch)

    def init(self, state: Models) -> Models:
        """``state`` with every sub-state its members' steps need (existing ones kept)."""
        _check_state(self, state)
        members = dict(state.members)
        for name, s in self.steps:
            members[name] = s.init(members[name])  # type: ignore[arg-type]
        return Models(members=members)

    def only(self, *names: str) -> Several:
        """The same step, stepping only the members ``names`` (the others stay as they are).

        Members at their own rates: a WGAN-GP critic's five updates per generator update
        are four calls of ``gan.only("d")`` and one of ``gan``. The idle members' steps
        do not run (no forward of their losses, no gradient, no update); a shared
        forward of an idle member still runs, without gradient, for the members that
        read it. The steps are the same objects: under ``compiled`` the subsets share
        the members' graphs, so no pattern of calls compiles anything more than each
        member's own graphs.

        Equivalent to::

            for i, batch in enumerate(loader):
                d_step(batch)                  # every call
                if (i + 1) % 5 == 0:
                    g_step(batch)              # gan instead of gan.only("d")

        Raises:
            ValueError: a name that has no step here, or no name.
        """
        unknown = [n for n in names if n not in self.names]
        if unknown or not names:
            raise ValueError(
                f"{self.name}.only{names}: give one or more of the members it steps, "
                f"{self.names}" + (f"; {unknown} are not among them" if unknown else "")
            )
        idle = tuple(n for n in self.names if n not in names)
        label = f"{self.name}.only({', '.join(map(repr, names))})"
        return attrs.evolve(self, idle=idle, name=label)

    def map_steps(self, fn: Callable[[Step], Step]) -> Several:
        """The same step with ``fn`` applied to each member's step (how ``compiled`` wraps)."""
        return attrs.evolve(self, steps=tuple((n, fn(s)) for n, s in self.steps))

    def step(self, name: str) -> Step:
        """The step of member ``name``."""
        for n, s in self.steps:
            if n == name:
                return s
        raise KeyError(f"{self.name}: no step for member {name!r}; members: {self.names}")

    @property
    def names(self) -> list[str]:
        """The trained members, in the order their steps run."""
        return [n for n, _ in self.steps]

    def eval_step(self, name: str, *, use_ema: bool = False) -> Callable[[Models, Batch], Metrics]:
        """``(state, batch) -> metrics``: member ``name``'s loss, evaluated, no update.

        As :func:`fasttorch.eval_step` of that member's step (``use_ema`` included),
        with every member in evaluation mode.
        """
        inner = _eval_step(self.step(name), use_ema=use_ema)

        def evaluate(state: Models, batch: Batch) -> Metrics:
            _check_state(self, state)
            own = state.members[name]
            assert isinstance(own, TrainState)
            with _all_evaluating(state):
                # Shared outputs in evaluation mode, without gradient, read as constants.
                outputs = run_forwards(
                    dict(self.outputs),
                    dict(self.steps),
                    dict(state.members),
                    batch,
                    True,
                    Pending(),
                    idle=tuple(self.names),
                )
                others = Others(
                    views={n: view(m, False) for n, m in state.members.items() if n != name},
                    owner=name,
                    outputs=outputs,
                )
                return inner(own.with_substate(KEY, others), batch)

        evaluate.__name__ = evaluate.__qualname__ = f"{self.name}.{name}"
        return evaluate


def several(
    steps: Mapping[str, Step],
    *,
    share_loss_scale: bool = False,
    outputs: Mapping[str, tuple[str, Callable[[Callable[..., Any], Batch], Any]]] | None = None,
) -> Several:
    """One step over several models: each member's step in turn, within one call.

    ``steps`` maps each trained member of a :class:`Models` state to its step (from
    :func:`model_step`, or :func:`fasttorch.step` for a member that reads no other),
    transformed as any step. The steps run in the mapping's order, each seeing the
    others as they are at that moment: in ``several({"d": d_step, "g": g_step})`` the
    generator's loss reads the discriminator ``d_step`` just updated, as in the plain
    loop. Metrics come back per member (``metrics["d"]["loss"]``). ``compiled`` of the
    result compiles each member's step (its graphs are its own); ``Frozen`` members
    have no step. Accumulating across calls (``grad_accumulate(..., across_calls=True)``
    on each member) gives the loop where each call is one microbatch of every model.

    Equivalent to the plain loop (the GAN of the guide, one microbatch per call)::

        d_loss = d_loss_fn(d, batch, {"g": g})   # reads g(z).detach()
        d_loss.backward(); d_opt.step(); d_opt.zero_grad()
        with toggle(d):                          # d's parameters take no gradient
            g_loss = g_loss_fn(g, batch, {"d": d})
        g_loss.backward(); g_opt.step(); g_opt.zero_grad()

    ``outputs={"fake": ("g", make_fake)}`` runs a forward that several members read once
    per call, as the plain loop's ``fake = G(z)``: at the start of the call
    ``make_fake(apply, batch)`` runs member ``"g"``'s forward (its BatchNorm statistics
    updated once, under its step's autocast), and every member's loss reads the result
    as ``models.outputs["fake"]``. The owner's loss gets it with its gradient path: the
    backward of its loss goes through ``fake`` into its parameters, through the graph of
    that one forward (``errG.backward()`` in the plain loop), not a second forward. The
    others get it as a constant (``fake.detach()``).

    With ``with_amp(step, "fp16")`` each member keeps its own loss scale (the loop with a
    ``GradScaler`` per optimizer); ``share_loss_scale=True`` gives them one, as one
    ``GradScaler`` for both optimizers: every member's step in a call uses the scale as
    it was before the call, and the scale is adjusted once after all of them, backing
    off if any member's gradients overflowed (that member skips its update, the others
    do not).

    Args:
        steps: member name -> step, in the order they run.
        share_loss_scale: one fp16 loss scale for all members (each needs ``with_amp``).
        outputs: name -> ``(member, fn)``: shared forwards, ``fn(apply, batch)`` with
            ``apply`` the member's forward; its step must be a :func:`model_step`
            without ``grad_accumulate`` or ``sync_on_last`` (their windows backpropagate
            each microbatch on their own), and it returns one floating tensor.

    Returns:
        A :class:`Several`: ``(Models, batch) -> (Models, metrics)``.

    Raises:
        TypeError: ``steps`` is not a mapping of names to fasttorch steps.
        ValueError: no steps, one step object under two names, members that
            disagree on donation, or an output whose member has no step here.

    Example:
        >>> import torch, fasttorch
        >>> torch.manual_seed(0) and None
        >>> def d_loss(apply, batch, models):
        ...     real, z = batch
        ...     fake = models["g"](z).detach()
        ...     return apply(fake).mean() - apply(real).mean()
        >>> def g_loss(apply, batch, models):
        ...     real, z = batch
        ...     return -models["d"](apply(z)).mean()
        >>> opt = fasttorch.optim.sgd(0.01)
        >>> state = fasttorch.Models.create(
        ...     d=fasttorch.TrainState.create(torch.nn.Linear(4, 1), opt),
        ...     g=fasttorch.TrainState.create(torch.nn.Linear(2, 4), opt),
        ... )
        >>> gan = fasttorch.several(
        ...     {"d": fasttorch.model_step(d_loss), "g": fasttorch.model_step(g_loss)}
        ... )
        >>> state, metrics = gan(state, (torch.randn(8, 4), torch.randn(8, 2)))
        >>> sorted(metrics), int(state["d"].step), int(state["g"].step)
        (['d', 'g'], 1, 1)
    """
    if not isinstance(steps, Mapping):
        raise TypeError(
            f"several expects a mapping of member names to steps, got {type(steps).__name__}; "
            "write several({'d': d_step, 'g': g_step})"
        )
    if not steps:
        raise ValueError(
            f"several: give at least one member's step, got {dict(steps)!r}; write "
            "several({'d': fasttorch.model_step(d_loss), 'g': fasttorch.model_step(g_loss)})"
        )
    seen: dict[int, str] = {}
    for name, s in steps.items():
        if not isinstance(name, str):
            raise TypeError(f"several: member names are strings, got {name!r}")
        if isinstance(s, Several):
            raise TypeError(
                f"several: member {name!r} is itself a several step; give its members' "
                "steps here instead, one per model"
            )
        if not isinstance(s, Step):
            kind = getattr(s, "__name__", type(s).__name__)
            raise TypeError(
                f"several: member {name!r} is {kind!r}, not a fasttorch step. Build each "
                "member's step with fasttorch.model_step(loss_fn) (or fasttorch.step), "
                "apply its transforms, and compile the whole: compiled(several({...}))"
            )
        other = seen.setdefault(id(s), name)
        if other != name:
            raise ValueError(
                f"several: members {other!r} and {name!r} are given the same step object; "
                "build one step per member (its compiled graphs and buffers are its own)"
            )
    donates = {n: s.donate for n, s in steps.items()}
    if len(set(donates.values())) > 1:
        raise ValueError(
            f"several: the members' steps disagree on donation ({donates}); build them all "
            "with the same donate=..."
        )
    names = "+".join(steps)
    if not isinstance(share_loss_scale, bool):
        raise TypeError(f"several: share_loss_scale must be a bool, got {share_loss_scale!r}")
    if share_loss_scale:
        # An fp16 with_amp declares its loss-scale sub-state among the step's inits.
        plain = [n for n, s in steps.items() if AMP_KEY not in {d.key for d in s.inits}]
        if plain:
            raise ValueError(
                f"several: share_loss_scale=True, but the steps of {plain} keep no loss "
                "scale; a shared loss scale is fp16's: wrap each member's step with "
                "fasttorch.with_amp(step, 'fp16')"
            )
    return Several(
        steps=tuple(steps.items()),
        name=f"several({names})",
        share_loss_scale=share_loss_scale,
        outputs=check_outputs(steps, outputs),
    )


# --------------------------------------------------------------------------- driver


def _check_state(step: Several, state: Any) -> None:
    if not isinstance(state, Models):
        raise TypeError(
            f"{step.name} expects a fasttorch.Models state (its members by name), got "
            f"{type(state).__name__}: build it with fasttorch.Models.create(d=..., g=...)"
        )
    members = state.members  # raises DonatedStateError for a donated state
    for name, _ in step.steps:
        m = members.get(name)
        if m is None:
            raise ValueError(
                f"{step.name}: there is a step for member {name!r}, but the state's members "
                f"are {list(members)}; name the members as the steps are named"
            )
        if isinstance(m, Frozen):
            raise ValueError(
                f"{step.name}: member {name!r} is Frozen (no optimizer) but has a step; "
                "train it as a TrainState.create(model, opt), or drop its step"
            )
    stepped = dict(step.steps)
    untrained = [
        n
        for n, m in members.items()
        if isinstance(m, TrainState) and n not in stepped and n not in step.idle
    ]
    if untrained:
        raise ValueError(
            f"{step.name}: members {untrained} are TrainStates that no step trains; give "
            "each a step, or make it a fasttorch.Frozen if it only is read"
        )
    for name, m in members.items():
        if isinstance(m, TrainState):
            check_alive(m, f"{step.name} (member {name!r})")
        if is_sharded(m.module):
            raise ValueError(
                f"{step.name}: member {name!r} is sharded with FSDP2, which a step over "
                "several models does not drive; train replicated members with sync_on_last"
            )


def _all_evaluating(state: Models) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for m in state.members.values():
        stack.enter_context(evaluating(m.module))
    return stack


def _run(step: Several, state: Models, batch: Batch) -> tuple[Models, Metrics]:
    _check_state(step, state)
    members: dict[str, Member] = dict(state.members)
    for m in members.values():
        if isinstance(m, Frozen) and m.module.training:
            m.module.eval()  # put back in the mode a Frozen runs in (a user's .train())
    metrics: Metrics = {}
    consumed: list[TrainState] = []
    scale = SharedScale() if step.share_loss_scale else None
    pending = Pending()
    progress = _scope.Progress()  # whether a member's step may have written yet
    try:
        outputs = (
            run_forwards(
                dict(step.outputs),
                dict(step.steps),
                members,
                batch,
                not step.donate,
                pending,
                idle=step.idle,
            )
            if step.outputs
            else {}
        )
        for name, s in step.steps:
            if name in step.idle:
                continue
            before = members[name]
            assert isinstance(before, TrainState)
            consumed.append(before)
            # The member's own sub-states first, then the others, in the same order on
            # every call: a compiled graph guards on the order of the keys.
            own = s.init(before)
            if own is not before:
                consumed.append(own)
            if scale is not None:
                own = scale.give(step.name, name, own)
            warn_captured(s, name, members)
            mine = tuple(n for n, f in step.outputs if f.owner == name)
            with _scope.scope(progress=progress, shared=pending):
                new, metrics[name] = _run_member(s, name, own, members, batch, outputs, mine)
            progress.began = True  # a donating step's results are in its input's tensors
            members[name] = new
            for n, m in members.items():  # target networks that follow this member
                if isinstance(m, Frozen) and m.follows == name:
                    members[n] = m.followed(new, in_place=step.donate)
            if scale is not None:
                scale.took(name, new, metrics[name])
        if scale is not None:
            members = scale.combine(step.name, members)
    except BaseException as e:
        if step.donate and progress.began:
            # A member's step may have written into the members' tensors (an earlier
            # member's update, a compiled kernel that ran): no longer a consistent state.
            consume(state, consumed, step.name, error=e)
            e.add_note(failure_note(step.name, state, wrote=True, eager=False))
        elif step.donate:  # raised before any member's step wrote: nothing consumed
            eager = bool(step.outputs) or any(s.is_eager for _, s in step.steps)
            e.add_note(failure_note(step.name, state, wrote=False, eager=eager))
        raise
    finally:
        pending.__exit__()
    if step.donate:
        consume(state, consumed, step.name)
    return Models(members=members), metrics


def _run_member(
    s: Step,
    name: str,
    own: TrainState,
    members: dict[str, Member],
    batch: Batch,
    outputs: Tensors | None = None,
    mine: tuple[str, ...] = (),
) -> tuple[TrainState, Metrics]:
    """Member ``name``'s step on ``own``, the others given through its sub-state ``KEY``.

    Copying steps give the others' buffers as copies (a training forward updates
    BatchNorm statistics in place); their updated values go back into ``members``.
    """
    others = Others(
        views={n: view(m, not s.donate) for n, m in members.items() if n != name},
        owner=name,
        outputs=dict(outputs or {}),
        mine=mine,
    )
    given = own.with_substate(KEY, others)
    try:
        new, metrics = s(given, batch)
    except Exception as e:
        clear = eager_error(s, own, others, batch, e)
        if clear is not None:  # raised while tracing a graph: as eager raises it
            raise clear from e
        raise
    seen: Others = new.substates[KEY]
    if not s.donate:  # the BatchNorm statistics the others' forwards updated
        for n, v in seen.views.items():
            m = members[n]
            if isinstance(m, TrainState) and v.buffers:
                members[n] = m.replace(buffers=v.buffers)
    return new.without_substate(KEY), metrics
