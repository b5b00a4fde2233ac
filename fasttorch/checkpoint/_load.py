""":func:`load` a checkpoint into a template state, and :func:`resume` from the newest."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path
from typing import Any, overload

import torch
import torch.utils._pytree as pytree
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.tensor import DTensor

from fasttorch._checks import warn_once
from fasttorch.checkpoint import _subclasses as subclasses
from fasttorch.checkpoint._directory import latest
from fasttorch.checkpoint._errors import (
    CheckpointError,
    CheckpointMismatchError,
    _as_checkpoint_error,
    check_state_kind,
)
from fasttorch.checkpoint._group import _agree, _distributed, _rank_world
from fasttorch.checkpoint._json import _Box, _decode_data
from fasttorch.checkpoint._keys import (
    _DATA,
    _class_name,
    _describe,
    _flatten,
    _is_per_rank,
    _optimizer_name,
    _per_rank,
    _restore_statics,
    _shards,
)
from fasttorch.checkpoint._manifest import _read_manifest, verify
from fasttorch.checkpoint._models import FROZEN_KEY, FrozenTensors, _carrying, _frozen, _trained
from fasttorch.checkpoint._paths import _dir_arg, _path_arg
from fasttorch.checkpoint._read import (
    _read,
    _reader,
    _unsafe,
)
from fasttorch.distributed.fsdp import as_dtensor
from fasttorch.models import Models
from fasttorch.state import TrainState, check_alive, is_sharded, mark_donated


def _shape(info: dict[str, Any]) -> str:
    return f"{tuple(info['shape'])} {info['dtype']}"


def _check_fit(
    manifest: dict[str, Any],
    keys: list[str],
    leaves: list[Any],
    where: str,
    shards: dict[int, DTensor],
    template: TrainState,
) -> None:
    """Every entry of the template in the checkpoint, with its (global) shape and dtype."""
    saved: dict[str, Any] = manifest["entries"]
    origin = (
        f"(the checkpoint holds a {manifest['module']} trained by {manifest['optimizer']}, "
        f"the template a {_class_name(template.module)} trained by "
        f"{_optimizer_name(template.optimizer)}; build the template the same way: model, "
        "optimizer, and step.init(...) of the same transforms)"
    )
    was_sharded = set(manifest.get("sharded", ()))
    for i, (key, leaf) in enumerate(zip(keys, leaves)):
        mine = _describe(leaf, shards.get(i))
        if key not in saved:
            raise CheckpointMismatchError(
                f"checkpoint {where} does not fit the template: the template's entry "
                f"{key!r} ({_shape(mine)}) is not in the checkpoint {origin}"
            )
        if saved[key] != mine:
            whole = (
                " (whole-tensor shapes: the entry is sharded there, here, or both)"
                if i in shards or key in was_sharded
                else ""
            )
            raise CheckpointMismatchError(
                f"checkpoint {where} does not fit the template: entry {key!r} has "
                f"{_shape(saved[key])} in the checkpoint but {_shape(mine)} in the "
                f"template{whole} {origin}"
            )
    extra = [k for k in saved if k not in set(keys)]
    if extra:
        raise CheckpointMismatchError(
            f"checkpoint {where} does not fit the template: its entry {extra[0]!r} "
            f"({_shape(saved[extra[0]])}) has no place in the template "
            f"({len(extra)} such entries) {origin}"
        )


@overload
def load(
    path: str | os.PathLike[str],
    template: TrainState,
    *,
    inplace: bool = False,
    verify_hashes: bool = True,
    trust_pickled: bool = False,
) -> tuple[TrainState, Any]: ...


@overload
def load(
    path: str | os.PathLike[str],
    template: Models,
    *,
    inplace: bool = False,
    verify_hashes: bool = True,
    trust_pickled: bool = False,
) -> tuple[Models, Any]: ...


def load(
    path: str | os.PathLike[str],
    template: TrainState | Models,
    *,
    inplace: bool = False,
    verify_hashes: bool = True,
    trust_pickled: bool = False,
) -> tuple[TrainState | Models, Any]:
    """Load the checkpoint at ``path`` into a state shaped like ``template``.

    ``template`` is a state built the same way as the saved one (same model and
    optimizer, and ``step.init(...)`` for the same transforms); its values do not
    matter. Each rank gets its own RNG, accumulation window and ``data`` back. Files
    are checked against the manifest first; the entries must match the template's
    one for one, in shape and dtype. Resharding works: a checkpoint saved by ``W``
    ranks loads on any number of ranks; a rank that did not exist at save time keeps
    the template's RNG (with a warning), and a window left open mid-accumulation
    cannot be split across a new number of ranks. Loading never runs code from the
    checkpoint (see the module's notes), unless ``trust_pickled``.

    With a :class:`fasttorch.Models` template (several models), ``path`` is the one
    :func:`save` returned for a ``Models`` state, ``directory/<name>``: each trained
    member is loaded from ``directory/<member>/<name>`` as :func:`load_models` does,
    and the ``Frozen`` members get the tensors saved with the first trained member.

    A template sharded with FSDP2 (``fully_shard``) gets this rank's part of each
    saved tensor, whether the checkpoint was saved by one process or by any number
    of sharded ranks (shapes are compared whole), and needs ``inplace=True``: FSDP2
    all-gathers the module's own shards, so the values must land there.

    Args:
        path: a checkpoint directory (see :func:`latest`).
        template: the state to fill; left untouched unless ``inplace``.
        inplace: copy the loaded values into the template's own tensors (which the
            module shares, so the module follows) and mark the template donated, as
            a step does. The values are read into CPU memory first (a sharded
            state's shards: into scratch on their own device) and copied only once
            all of them were read: a failed load leaves the template as it was.
            Required for a sharded template.
        verify_hashes: also check each file's SHA-256 (sizes are always checked).
        trust_pickled: read DCP's ``.metadata`` with plain ``pickle`` and, in a
            format-1 checkpoint (fasttorch before JSON ``data``), unpickle ``data``.
            This can run code from the checkpoint; it warns. Only for checkpoints
            you wrote yourself.

    Returns:
        ``(state, data)``: the restored state and this rank's saved ``data``.

    Raises:
        CheckpointError: missing, incomplete, truncated, corrupted or unsafe
            checkpoint, or a failed read (on any rank).
        CheckpointMismatchError: it does not fit ``template`` (names the first entry
            that differs, with both shapes; whole-tensor shapes for shards).
        ValueError: ``template`` is sharded and ``inplace`` is False.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> def make():
        ...     return fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> path = fasttorch.checkpoint.save(tempfile.mkdtemp(), make(), data=7)
        >>> state, data = fasttorch.checkpoint.load(path, make())
        >>> int(state.step), data
        (0, 7)
    """
    p = _path_arg(path, "checkpoint.load")
    check_state_kind(template, "checkpoint.load", "template")
    if isinstance(template, Models):
        options = {"inplace": inplace, "verify_hashes": verify_hashes}
        return load_models(p.parent, p.name, template, trust_pickled=trust_pickled, **options)
    check_alive(template, "checkpoint.load")
    keys, leaves, spec = _flatten(template)
    if is_sharded(template.module) and not inplace:
        raise ValueError(
            f"checkpoint.load of {str(p)!r}: the template is sharded with FSDP2 "
            "(fully_shard), and inplace=False would return a state over new tensors. "
            "FSDP2 all-gathers the module's own shards for every forward, so training "
            "such a state would update tensors the module never reads. Pass "
            "inplace=True: the checkpoint is read into the module's own shards"
        )
    shards = _shards(template, keys)
    src: _Source | None = None
    problem: CheckpointError | None = None
    try:
        src = _open(p, template, keys, leaves, shards, verify_hashes, trust_pickled)
    except CheckpointError as e:
        problem = e
    except (OSError, RuntimeError, ValueError, KeyError, EOFError) as e:
        problem = CheckpointError(f"loading {str(p)!r} failed: {e!r}")
    with _as_checkpoint_error(f"checkpoint.load of {str(p)!r}"):
        _agree(problem, "checkpoint.load")  # every rank reads, or none does
    assert src is not None
    if src.kept:
        warnings.warn(
            f"checkpoint {str(p)!r} was saved by {src.manifest['world_size']} ranks; rank "
            f"{_rank_world()[0]} keeps the template's value for {src.kept} (its RNG seeds it)",
            UserWarning,
            stacklevel=2,
        )
    scratch, request = _request(src, keys, leaves, shards, inplace)
    with _as_checkpoint_error(f"checkpoint.load of {str(p)!r}"):
        side = subclasses.request_inner(
            src.manifest, src.reader.read_metadata(), keys, leaves, shards, src.names,
            scratch, request, _rank_world(), repr(str(p)),
        )  # fmt: skip
    _read(p, request, src.reader, trusted=trust_pickled, collective=_distributed())
    statics = src.manifest["statics"]
    state = _place(template, keys, leaves, spec, scratch, statics, inplace=inplace, side=side)
    return state, _data(src, request, p)


@dataclasses.dataclass
class _Source:
    """What this rank reads from a verified checkpoint that fits the template."""

    manifest: dict[str, Any]
    reader: FileSystemReader
    names: dict[str, str]  # template key -> checkpoint key, for the entries read
    data_key: str  # this rank's data entry
    data_shape: list[int] | None  # None: none saved for this rank, or format 1 (pickled)
    kept: list[str]  # entries this rank keeps from the template (a rank new since the save)


def _open(
    p: Path,
    template: TrainState,
    keys: list[str],
    leaves: list[Any],
    shards: dict[int, DTensor],
    verify_hashes: bool,
    trust_pickled: bool,
) -> _Source:
    """Verify the checkpoint, check it fits the template, and find this rank's entries."""
    manifest = verify(p, hashes=verify_hashes)
    _check_fit(manifest, keys, leaves, repr(str(p)), shards, template)
    rank, world = _rank_world()
    saved_world = int(manifest["world_size"])
    fresh_rank = rank >= saved_world
    if fresh_rank and manifest["micro"]:
        raise CheckpointError(
            f"checkpoint {str(p)!r} was saved by {saved_world} ranks in the middle of "
            f"an accumulation window ({manifest['micro']} microbatches in); rank "
            f"{rank} of {world} has no window to resume. Resume on {saved_world} "
            "ranks, or from a checkpoint saved at a window boundary"
        )
    names: dict[str, str] = {}
    per_rank = _per_rank(template)
    for key in keys:
        if not _is_per_rank(key, per_rank):
            names[key] = key
        elif not fresh_rank:
            names[key] = f"rank{rank}/{key}"
    kept = [k for k in keys if k not in names]
    data_key = f"rank{rank}/{_DATA}"
    if manifest["format"] == 1 and not trust_pickled:
        raise _unsafe(p, "it is a format-1 checkpoint, whose data= is pickled")
    wanted = [*names.values(), *([] if fresh_rank else [data_key])]
    reader, data_shape = _data_shape(p, manifest, wanted, data_key, trust_pickled, fresh_rank)
    return _Source(manifest, reader, names, data_key, data_shape, kept)


def _data_shape(
    p: Path,
    manifest: dict[str, Any],
    wanted: list[str],
    data_key: str,
    trust_pickled: bool,
    fresh_rank: bool,
) -> tuple[FileSystemReader, list[int] | None]:
    """The reader of the DCP files, and the shape of this rank's data entry."""
    reader, entries = _reader(p, manifest, wanted, trusted=trust_pickled, stacklevel=5)
    if fresh_rank or manifest["format"] == 1:
        return reader, None
    if trust_pickled:
        md = reader.read_metadata()
        return reader, list(getattr(md.state_dict_metadata[data_key], "size", ()))
    data_shape = list(entries[data_key].size)
    stored = sum(info["size"] for info in manifest["files"].values())
    if math.prod(data_shape) > stored:  # a crafted .metadata: never allocated
        raise CheckpointError(
            f"checkpoint {str(p)!r}: its .metadata gives data= a size of "
            f"{data_shape}, more than its files hold ({stored} bytes)"
        )
    return reader, data_shape


def _request(
    src: _Source,
    keys: list[str],
    leaves: list[Any],
    shards: dict[int, DTensor],
    inplace: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Fresh tensors to read into (on CPU for inplace), by template key, and DCP's request.

    Nothing the caller holds changes unless every value was read. A shard is read
    through a DTensor over its scratch (on the shard's device, where its mesh is), so
    DCP fetches this rank's part of the whole tensor, whatever the number of ranks that
    saved it.
    """
    scratch: dict[str, torch.Tensor] = {}
    request: dict[str, Any] = {}
    for i, (key, t) in enumerate(zip(keys, leaves)):
        if key not in src.names:
            continue
        if i in shards:
            scratch[key] = subclasses.empty_like(t)
            request[src.names[key]] = as_dtensor(scratch[key], shards[i])
        else:
            scratch[key] = subclasses.empty_like(t, "cpu" if inplace else None)
            request[src.names[key]] = scratch[key]
    if not src.kept:  # a rank new since the save has no data either
        request[src.data_key] = (
            None  # format 1, trusted: a pickled _Box
            if src.data_shape is None
            else torch.empty(src.data_shape, dtype=torch.uint8)
        )
    return scratch, request


def _place(
    template: TrainState,
    keys: list[str],
    leaves: list[Any],
    spec: Any,
    scratch: dict[str, torch.Tensor],
    statics: dict[str, Any],
    *,
    inplace: bool,
    side: dict[str, dict[str, torch.Tensor]] | None = None,
) -> TrainState:
    """The loaded state: the template's own tensors updated (inplace), or new ones,
    with the saved static fields; a quantized state by ``subclasses.place``."""
    plain = [not subclasses.is_subclass(t) for t in leaves]
    if inplace:
        for key, t, p in zip(keys, leaves, plain):
            if key in scratch and p:
                t.detach().copy_(scratch[key])
        targets = leaves
    else:
        targets = [
            scratch[k] if k in scratch else t.detach().clone() if p else t
            for k, t, p in zip(keys, leaves, plain)
        ]
    targets = subclasses.place(keys, leaves, targets, scratch, side or {}, inplace=inplace)
    state: TrainState = pytree.tree_unflatten(targets, spec)
    state = _restore_statics(state, "", statics)
    if inplace:
        mark_donated(template, "checkpoint.load(..., inplace=True)")
    return state


def _data(src: _Source, request: dict[str, Any], p: Path) -> Any:
    """This rank's saved ``data`` (None for a rank new since the save)."""
    if src.kept:
        return None
    value = request[src.data_key]
    if isinstance(value, torch.Tensor):
        return _decode_data(value, repr(str(p)))
    return value.value if isinstance(value, _Box) else None


@overload
def resume(
    directory: str | os.PathLike[str],
    template: TrainState,
    *,
    data: Any = None,
    inplace: bool = False,
    verify_hashes: bool = True,
) -> tuple[TrainState, Any]: ...


@overload
def resume(
    directory: str | os.PathLike[str],
    template: Models,
    *,
    data: Any = None,
    inplace: bool = False,
    verify_hashes: bool = True,
) -> tuple[Models, Any]: ...


def resume(
    directory: str | os.PathLike[str],
    template: TrainState | Models,
    *,
    data: Any = None,
    inplace: bool = False,
    verify_hashes: bool = True,
) -> tuple[TrainState | Models, Any]:
    """Load the newest checkpoint in ``directory`` into ``template``, or start fresh.

    One call for the start of every run: the same code serves the first run (no
    checkpoint yet: ``(template, data)`` come back as given) and every restart (the
    newest intact checkpoint, as :func:`latest` finds it, loaded by :func:`load`).
    The plain equivalent::

        path = latest(directory)
        state, data = (template, data) if path is None else load(path, template)

    A :class:`fasttorch.Models` template resumes from the newest checkpoint that
    every trained member saved (:func:`latest_models`).

    Args:
        directory: where the checkpoints are saved; it need not exist yet.
        template: the fresh state, built as for :func:`load`; returned unchanged (and
            not donated) when there is no checkpoint.
        data: what to return as the data position when there is no checkpoint
            (``{"next_batch": 0}``), so that the loop reads it the same way on both paths.
        inplace: as in :func:`load`.
        verify_hashes: as in :func:`latest` and :func:`load`.

    Returns:
        ``(state, data)``.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> def make():
        ...     return fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> root = tempfile.mkdtemp()
        >>> state, data = fasttorch.checkpoint.resume(root, make(), data={"next": 0})
        >>> data
        {'next': 0}
        >>> _ = fasttorch.checkpoint.save(root, state, data={"next": 5})
        >>> state, data = fasttorch.checkpoint.resume(root, make(), data={"next": 0})
        >>> data
        {'next': 5}
    """
    d = _dir_arg(directory, "checkpoint.resume")
    if d.exists() and not d.is_dir():
        raise CheckpointError(
            f"checkpoint.resume: {str(d)!r} is not a directory; pass the directory the "
            "checkpoints are saved in"
        )
    check_state_kind(template, "checkpoint.resume", "template")
    if isinstance(template, Models):
        name = latest_models(d)
        if name is None:
            return template, data
        return load_models(d, name, template, inplace=inplace, verify_hashes=verify_hashes)
    check_alive(template, "checkpoint.resume")
    found = latest(d, verify_hashes=verify_hashes)
    if found is None:
        return template, data
    return load(found, template, inplace=inplace, verify_hashes=verify_hashes)


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
