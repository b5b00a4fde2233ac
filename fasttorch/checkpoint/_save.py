""":func:`save`: plan the entries and the manifest, write them with DCP under a
temporary name, then publish by rename (rank 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

from fasttorch import _checks
from fasttorch.checkpoint import _manifest
from fasttorch.checkpoint import _subclasses as subclasses
from fasttorch.checkpoint._directory import (
    _OLD,
    _TMP,
    _check_keep,
    _discard,
    _fsync_dir,
    _inflight,
    _Keep,
    _lock,
    _unlock,
    prune,
)
from fasttorch.checkpoint._errors import (
    CheckpointError,
    _as_checkpoint_error,
    _quiet,
    check_state_kind,
)
from fasttorch.checkpoint._group import _agree, _broadcast, _distributed, _rank_world
from fasttorch.checkpoint._json import _encode_data
from fasttorch.checkpoint._keys import (
    _DATA,
    _class_name,
    _describe,
    _export_keys,
    _flatten,
    _is_per_rank,
    _optimizer_name,
    _per_rank,
    _shards,
    _statics,
)
from fasttorch.checkpoint._manifest import FORMAT, MANIFEST
from fasttorch.checkpoint._models import _carrying, _frozen, _trained
from fasttorch.checkpoint._paths import _dir_arg, _is_link
from fasttorch.distributed.fsdp import as_dtensor
from fasttorch.models import Models
from fasttorch.state import TrainState, check_alive
from fasttorch.substates import window_position


@dataclasses.dataclass
class _Plan:
    final: Path
    tmp: Path
    tensors: dict[str, Any]
    manifest: dict[str, Any]
    keep: _Keep
    lock: Any = None


def _check_metric(api: str, metric: Any) -> float | None:
    """``metric`` as a finite float (a 0-d tensor is read once, here, between steps)."""
    if metric is None:
        return None
    if isinstance(metric, torch.Tensor) and metric.numel() == 1 and not metric.is_complex():
        metric = metric.detach().reshape(()).item()
    valid = "a finite number (or a one-element tensor)"
    return _checks.real(
        api,
        "metric",
        metric,
        kind=valid,
        rule=valid,
        hint="Pass None for a checkpoint that must not compete for keep_best (a diverged "
        "run's NaN loss, for instance).",
    )


def _plan(
    directory: str | os.PathLike[str],
    state: TrainState,
    data: Any,
    name: str | None,
    keep: _Keep,
    metric: float | None,
    pg: Any,
    api: str,
) -> _Plan:
    check_alive(state, api)
    rank, _ = _rank_world()
    d = _dir_arg(directory, api)
    if d.exists() and not d.is_dir():
        raise CheckpointError(
            f"{api}: {str(d)!r} exists and is not a directory; name a directory for the "
            "checkpoints (it is created if missing)"
        )
    keys, leaves, _ = _flatten(state)
    step = _step_count(state)
    micro = window_position(state.substates)
    if name is None:
        name = f"step_{step:09d}" + (f"_micro{micro}" if micro else "")
    if not name or "/" in name or name.startswith(".") or name != name.strip():
        raise ValueError(
            f"{api}: name must be a plain directory name not starting with '.', got {name!r}"
        )
    try:
        blob: torch.Tensor | None = _encode_data(data)
        problem: Exception | None = None
    except TypeError as e:
        blob, problem = None, e
    lock = None
    if problem is None and rank == 0:  # one writer per directory (see _lock)
        try:
            lock = _lock(d, api)
        except (CheckpointError, OSError) as e:
            problem = e
    try:
        _agree(problem, api)
        return _plan_write(d, name, state, keys, leaves, blob, keep, metric, lock, pg, api)
    except BaseException:
        _unlock(lock)
        raise


def _plan_write(
    d: Path,
    name: str,
    state: TrainState,
    keys: list[str],
    leaves: list[Any],
    blob: torch.Tensor | None,
    keep: _Keep,
    metric: float | None,
    lock: Any,
    pg: Any,
    api: str,
) -> _Plan:
    rank, world = _rank_world()
    token = uuid.uuid4().hex[:12] if rank == 0 else None
    if rank == 0:  # from now on, no prune of this process takes it for a leftover
        _inflight.add(str(d / f"{_TMP}{name}.{token}"))
    with _as_checkpoint_error(f"{api} of {str(d / name)!r}"):
        token = _broadcast(token, pg)
    tmp = d / f"{_TMP}{name}.{token}"
    shards = _shards(state, keys)
    per_rank = _per_rank(state)
    tensors: dict[str, Any] = {}
    for i, (key, leaf) in enumerate(zip(keys, leaves)):
        leaf = subclasses.values(leaf)  # a quantized state's values (its codes: below)
        if i in shards:  # DCP writes this rank's part of the whole tensor under its key
            tensors[key] = as_dtensor(leaf.detach(), shards[i])
        else:
            tensors[f"rank{rank}/{key}" if _is_per_rank(key, per_rank) else key] = leaf.detach()
    tensors.update(subclasses.inner_tensors(keys, leaves, shards, rank))
    tensors[f"rank{rank}/{_DATA}"] = blob
    statics: dict[str, Any] = {}
    _statics(state, "", statics)
    manifest = {
        "format": FORMAT,
        "step": _step_count(state),
        "micro": window_position(state.substates),
        "world_size": world,
        "module": _class_name(state.module),
        "optimizer": _optimizer_name(state.optimizer),
        "statics": statics,
        "entries": {k: _describe(t, shards.get(i)) for i, (k, t) in enumerate(zip(keys, leaves))},
        "per_rank": [k for k in keys if _is_per_rank(k, per_rank)],
        "sharded": [keys[i] for i in sorted(shards)],
        subclasses.FIELD: subclasses.saved(keys, leaves),
        **_export_keys(state),
        "metric": metric,
    }
    return _Plan(d / name, tmp, tensors, manifest, keep, lock)


def _write(plan: _Plan, pg: Any) -> Path:
    """Write the DCP files, then (rank 0) the manifest and the renames. All ranks."""
    rank, _ = _rank_world()
    what = f"saving {str(plan.final)!r}"
    _inflight.add(str(plan.tmp))
    try:
        try:
            with _as_checkpoint_error(what), _quiet():
                _dcp_save(  # fails on every rank together, so no rank waits below
                    plan.tensors,
                    storage_writer=FileSystemWriter(plan.tmp, sync_files=True),
                    process_group=pg,
                    no_dist=not _distributed(),
                )
        except CheckpointError as e:
            if rank == 0 and _an_error(e):  # every rank is done with it: DCP failed on all
                _remove_own(plan.tmp, e)
            raise
        error: str | None = None
        if rank == 0:
            try:
                with _as_checkpoint_error(what):
                    _publish(plan)
            except BaseException as e:  # the other ranks must hear of it, even of a kill
                error = f"{type(e).__name__}: {e}"
                if isinstance(e, Exception):
                    _remove_own(plan.tmp, e)
                raise
            finally:
                with _as_checkpoint_error(what):
                    _broadcast(error, pg)
        else:
            with _as_checkpoint_error(what):
                error = _broadcast(None, pg)
            if error is not None:
                raise CheckpointError(f"rank 0 could not complete {str(plan.final)!r}: {error}")
    finally:
        _inflight.discard(str(plan.tmp))
        _unlock(plan.lock)
    return plan.final


def _an_error(e: BaseException) -> bool:
    """Whether a failed write failed by an error, not by an interruption (a kill, ^C):
    an interrupted save leaves its ``.tmp.`` directory to the next prune, as a real
    kill would; a failed one removes it at once (five failures on a full disk must not
    leave five partial copies)."""
    cause = e.__cause__
    if isinstance(cause, CheckpointException):
        return all(
            isinstance(f[0] if isinstance(f, tuple) else f, Exception)
            for f in cause.failures.values()
        )
    return cause is None or isinstance(cause, Exception)


def _remove_own(tmp: Path, error: BaseException) -> None:
    """Remove the ``.tmp.`` directory of this failed save (only its own, by its unique
    name); a failure to do so is noted on the save's error, which is what is raised."""
    try:
        _discard(tmp)
    except (OSError, CheckpointError) as e:
        error.add_note(f"its partial directory {str(tmp)!r} could not be removed: {e}")


def _publish(plan: _Plan) -> None:
    """Manifest, then the rename that makes the checkpoint visible (rank 0).

    Replacing a name keeps the previous copy until the new one is visible: ``final``
    is renamed to ``.old.<name>.<id>`` (which :func:`latest` accepts), the new one to
    ``final``, and only then is the old copy discarded.
    """
    files = {}
    for f in sorted(plan.tmp.iterdir()):
        if f.is_file():
            files[f.name] = {"size": f.stat().st_size, "sha256": _manifest._sha256(f)}
    manifest = {**plan.manifest, "saved_at": time.time(), "files": files}
    with open(plan.tmp / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(plan.tmp)
    old = None
    if _is_link(plan.final):
        raise CheckpointError(
            f"cannot save as {str(plan.final)!r}: it is a symbolic link, and fasttorch "
            "never replaces or writes through a link. Save under another name, or "
            "remove the link"
        )
    if plan.final.exists():
        if not (plan.final / MANIFEST).is_file():
            raise CheckpointError(
                f"cannot replace {str(plan.final)!r}: it exists and is not a fasttorch "
                f"checkpoint (it has no {MANIFEST}). Move it away or save under another name"
            )
        old = plan.final.with_name(f"{_OLD}{plan.final.name}.{uuid.uuid4().hex[:12]}")
        _inflight.add(str(old))
        os.rename(plan.final, old)
    try:
        os.rename(plan.tmp, plan.final)
        try:
            _fsync_dir(plan.final.parent)
        except OSError as e:
            raise CheckpointError(
                f"saved {str(plan.final)!r}, but making its rename durable failed: {e}. "
                "It is visible and complete, but may not survive a power loss or a "
                "crash of the machine; check the filesystem, then save again"
            ) from e
        if old is not None:
            _discard(old)
    finally:
        if old is not None:
            _inflight.discard(str(old))
    if plan.keep.last is not None:
        prune(plan.final.parent, plan.keep.last, keep_best=plan.keep.best, mode=plan.keep.mode)


def save(
    directory: str | os.PathLike[str],
    state: TrainState | Models,
    *,
    data: Any = None,
    name: str | None = None,
    keep_last: int | None = None,
    metric: float | torch.Tensor | None = None,
    keep_best: int | None = None,
    mode: str = "min",
) -> Path:
    """Save ``state`` (and your ``data`` position) as a new checkpoint in ``directory``.

    Everything in the state is saved: parameters, buffers, optimizer state and
    hyperparameters, step, loss scale and its counters, accumulation window (its
    position included), EMA copies, the RNG of each rank. ``data`` is JSON (dicts with
    ``str`` keys, lists, ``str``, ``int``, finite ``float``, ``bool``, ``None``), saved
    per rank and returned by :func:`load` equal to what you passed. The checkpoint is
    written as ``directory/.tmp.<name>.<id>`` and renamed to ``directory/<name>`` only
    once complete, so an interrupted save (even ``kill -9``) leaves earlier checkpoints
    untouched and is never returned by :func:`latest`. Call it between steps, on every
    rank of a distributed job (a collective). In a state sharded with FSDP2 each rank
    writes its shards as parts of the whole tensors, so the checkpoint loads on any
    number of ranks, sharded or not (see :func:`load`).

    A :class:`fasttorch.Models` state (several models) is saved as one checkpoint per
    trained member, ``directory/<member>/<name>``, all under one name (the first
    member's step by default), as :func:`save_models` does; the returned path is
    ``directory/<name>``, which :func:`load` and :func:`resume` take with a ``Models``
    template. Its ``Frozen`` members (a teacher, a target network) are saved with the
    first trained member.

    Args:
        directory: where checkpoints live (created if needed; shared by all ranks).
        state: a live ``TrainState`` or ``Models``; it is read, not changed.
        data: your position in the data, returned by :func:`load` on the same rank:
            JSON values only (dicts with ``str`` keys, lists, ``str``, ``int``, finite
            ``float``, ``bool``, ``None``; tensors through ``fasttorch.data.to_json``).
        name: the checkpoint's directory name; default ``step_<step>`` (with
            ``_micro<k>`` inside an accumulation window). An existing checkpoint of
            that name is replaced; at every moment one of the two copies is complete
            and found by :func:`latest` (the old one as ``.old.<name>.<id>``, see
            there), and the old one is deleted only once the new one is in place.
        keep_last: if set, then :func:`prune` to this many afterwards (rank 0).
        metric: a finite number (or one-element tensor, read here) to select
            checkpoints by, stored in the manifest; ``None``: never counts as best.
        keep_best: with ``keep_last``, also keep this many intact checkpoints with
            the best ``metric`` (the union of both is kept; see :func:`prune`).
        mode: ``"min"`` (lower metric is better, a loss) or ``"max"``.

    Returns:
        The path of the new checkpoint.

    Raises:
        TypeError: ``data`` is not JSON (nothing is written; names the bad value).
        ValueError: an empty ``directory``, a bad ``name``, ``keep_*``, ``metric``
            or ``mode`` (nothing is written).
        CheckpointError: the write failed, on any rank, or a peer died (the save's
            own partial directory is removed); a directory fsync failed; another
            process is saving into or pruning ``directory``; ``name`` is a link.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> root = tempfile.mkdtemp()
        >>> path = fasttorch.checkpoint.save(root, state, data={"batch": 0}, keep_last=2)
        >>> path.name, fasttorch.checkpoint.latest(root) == path
        ('step_000000000', True)
    """
    api = "checkpoint.save"
    check_state_kind(state, api)
    if isinstance(state, Models):
        kept = save_models(
            directory,
            state,
            data=data,
            name=name,
            keep_last=keep_last,
            metric=metric,
            keep_best=keep_best,
            mode=mode,
        )
        return Path(directory) / kept
    keep = _check_keep(api, keep_last, keep_best, mode, saving=True)
    plan = _plan(directory, state, data, name, keep, _check_metric(api, metric), None, api)
    return _write(plan, None)


def _step_count(state: TrainState) -> int:
    """The state's step count; a population's members each count theirs: the largest."""
    return int(state.step.max())


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
