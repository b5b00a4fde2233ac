"""Checkpoints of a :class:`fasttorch.Models` state: one checkpoint per trained member.

Each trained member is saved by :func:`save` into ``directory/<member>/<name>``, under
the same name, so every member's checkpoint is as crash-safe as a one-model one. A
crash between two members' saves leaves the newest name in some members only:
:func:`latest_models` returns the newest name that every member has. ``Frozen``
members (a teacher, a target network) are saved with the first trained member, as its
sub-state :data:`FROZEN_KEY`: a target network that the step updates resumes where it
was, and a teacher is restored with the weights it was saved with.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fasttorch import struct
from fasttorch._checks import warn_once
from fasttorch.checkpoint._directory import latest
from fasttorch.checkpoint._errors import CheckpointError
from fasttorch.checkpoint._load import load
from fasttorch.checkpoint._manifest import _read_manifest
from fasttorch.checkpoint._save import save
from fasttorch.models import Frozen, Models
from fasttorch.state import TrainState
from fasttorch.substates import window_position

__all__ = ["FROZEN_KEY", "latest_models", "load_models", "save_models"]

FROZEN_KEY = "several.frozen"
"""The sub-state of the first trained member's checkpoint that holds the Frozen members."""


class FrozenTensors(struct.Record):
    """The tensors of a state's ``Frozen`` members, by member, saved with a trained one."""

    members: dict[str, dict[str, torch.Tensor]]


def _trained(state: Models, api: str) -> dict[str, TrainState]:
    if not isinstance(state, Models):
        raise TypeError(f"{api} expects a fasttorch.Models state, got {type(state).__name__}")
    members = state.members  # raises DonatedStateError for a donated state
    for n, m in members.items():
        if not isinstance(m, (TrainState, Frozen)):
            raise CheckpointError(
                f"{api}: member {n!r} is a {type(m).__name__}, which a checkpoint cannot "
                "hold; a member is a fasttorch.TrainState or a fasttorch.Frozen"
            )
    return {n: m for n, m in members.items() if isinstance(m, TrainState)}


def _frozen(state: Models) -> dict[str, Frozen]:
    return {n: m for n, m in state.members.items() if isinstance(m, Frozen)}


def _carrying(members: dict[str, TrainState], frozen: dict[str, Frozen]) -> dict[str, TrainState]:
    """``members`` with the first one carrying the Frozen members' tensors (if any)."""
    if not frozen:
        return members
    first = next(iter(members))
    carried = FrozenTensors(members={n: dict(f.tensors) for n, f in frozen.items()})
    return {**members, first: members[first].with_substate(FROZEN_KEY, carried)}


def save_models(
    directory: str | os.PathLike[str],
    state: Models,
    *,
    data: Any = None,
    name: str | None = None,
    keep_last: int | None = None,
    metric: float | torch.Tensor | None = None,
    keep_best: int | None = None,
    mode: str = "min",
) -> str:
    """Save every trained member of ``state`` as ``directory/<member>/<name>``.

    As :func:`save` for each member (atomic, verified; ``data``, ``metric`` and the
    pruning options apply to each), all under one name: by default the first
    member's ``step_<step>`` (``_micro<k>`` inside an accumulation window). Returns
    that name. ``checkpoint.save(directory, state)`` does the same and returns
    ``directory/<name>``.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> from fasttorch.checkpoint import latest_models, load_models, save_models
        >>> def make():
        ...     torch.manual_seed(0)
        ...     return fasttorch.Models.create(
        ...         g=fasttorch.TrainState.create(torch.nn.Linear(2, 2), fasttorch.optim.sgd(0.1)),
        ...         teacher=fasttorch.Frozen.create(torch.nn.Linear(2, 2)))
        >>> root = tempfile.mkdtemp()
        >>> save_models(root, make(), data={"epoch": 1})
        'step_000000000'
        >>> state, data = load_models(root, latest_models(root), make())
        >>> data, int(state["g"].step)
        ({'epoch': 1}, 0)
    """
    members = _carrying(_trained(state, "checkpoint.save_models"), _frozen(state))
    if name is None:
        first = next(iter(members.values()))
        micro = window_position(first.substates)
        name = f"step_{int(first.step):09d}" + (f"_micro{micro}" if micro else "")
    for member, s in members.items():
        save(
            Path(directory) / member,
            s,
            data=data,
            name=name,
            keep_last=keep_last,
            metric=metric,
            keep_best=keep_best,
            mode=mode,
        )
    return name


def latest_models(directory: str | os.PathLike[str]) -> str | None:
    """The newest checkpoint name that every member saved in ``directory`` (or ``None``).

    Members' directories are compared by name: a save interrupted after some members
    leaves a newer name in those only, which is passed over.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not dirs:
        return None
    names: set[str] | None = None
    for d in dirs:
        here = {p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")}
        names = here if names is None else names & here
    newest = [latest(d) for d in dirs]
    # The oldest of the members' newest: every member has it unless a save is missing.
    candidates = sorted(n.name for n in newest if n is not None and names and n.name in names)
    return candidates[0] if candidates else None


def load_models(
    directory: str | os.PathLike[str],
    name: str | None,
    template: Models,
    *,
    inplace: bool = False,
    verify_hashes: bool = True,
    trust_pickled: bool = False,
) -> tuple[Models, Any]:
    """Load checkpoint ``name`` of every member into a state shaped like ``template``.

    ``template`` is built as the saved state was (same members, models, optimizers,
    ``step.init`` for the same transforms); its ``Frozen`` members get the tensors
    saved for them (a checkpoint written before Frozen members were saved has none:
    the template's are kept, with a warning). Returns ``(state, data)``, ``data`` as
    saved with the first member. The
    options are :func:`load`'s, for each member. ``checkpoint.load(directory / name,
    template)`` does the same.

    Raises:
        CheckpointError: ``name`` is ``None`` (nothing saved) or a member's
            checkpoint is missing or damaged (see :func:`load`).
    """
    members = _trained(template, "checkpoint.load_models")
    if name is None:
        raise CheckpointError(
            f"checkpoint.load_models: no checkpoint that every member "
            f"({', '.join(members)}) saved in {str(directory)!r}"
        )
    out: dict[str, Any] = dict(template.members)
    frozen = _frozen(template)
    first = next(iter(members))
    if frozen and not _has_frozen(Path(directory) / first / name):
        warn_once(
            f"checkpoint.load_models: {str(Path(directory) / name)!r} holds no Frozen "
            f"members (it was saved before they were saved): {sorted(frozen)} keep the "
            "template's tensors"
        )
        frozen = {}
    data: Any = None
    for i, (member, s) in enumerate(_carrying(members, frozen).items()):
        out[member], d = load(
            Path(directory) / member / name,
            s,
            inplace=inplace,
            verify_hashes=verify_hashes,
            trust_pickled=trust_pickled,
        )
        if i == 0:
            data = d
    if frozen:
        carried: FrozenTensors = out[first].substates[FROZEN_KEY]
        out[first] = out[first].without_substate(FROZEN_KEY)
        for n, f in frozen.items():
            out[n] = f.replace(tensors=carried.members[n])
    return Models(members=out), data


def _has_frozen(path: Path) -> bool:
    prefix = f"substates/{FROZEN_KEY}/"
    return any(k.startswith(prefix) for k in _read_manifest(path)["entries"])
