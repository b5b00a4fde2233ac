"""Checkpoints of a whole ``TrainState``: atomic, verified, resumable bit for bit.

A checkpoint is a directory written by :mod:`torch.distributed.checkpoint` (DCP) under
a temporary name, completed by a manifest (``fasttorch.json``: step, world size, the
static facts of the state, every entry's shape and dtype, and each file's size and
SHA-256), then renamed into place. A directory without a manifest is incomplete and
never loaded; :func:`latest` skips it. Works from one process and from every rank of a
``torch.distributed`` job (call it on all ranks; the files go to a shared filesystem).

Keys are clean paths into the state: ``params/inp.weight``,
``opt_state/slots/exp_avg/inp.weight``, ``substates/amp/scale`` (no ``_orig_mod.`` or
``module.``). Values that differ between ranks are stored per rank under
``rank{r}/...``: the RNG, an open accumulation window and the user's ``data``; DCP
would otherwise keep one rank's value for a shared key, silently.

Loading a checkpoint unpickles the ``data`` objects in it: load only checkpoints you
trust, as with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

from fasttorch import _compat, struct
from fasttorch.state import TrainState, check_alive, mark_donated
from fasttorch.transforms.grad_accumulate import KEY as ACCUM_KEY

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "SaveHandle",
    "async_save",
    "latest",
    "load",
    "model_state_dict",
    "prune",
    "save",
    "verify",
]

FORMAT = 1
MANIFEST = "fasttorch.json"
_TMP = ".tmp."
_OLD = ".old."
# Entries whose values legitimately differ between ranks: saved under "rank{r}/".
PER_RANK = ("rng", f"substates/{ACCUM_KEY}")
_DATA = "data"
_CHUNK = 1 << 22


# DCP warns on every single-process save and load; that is fasttorch's normal case.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's single-process warning (pytest resets the import-time filter)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # catch_warnings is not thread-safe; the import-time filter applies
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


class _Box:
    """Keeps the user's ``data`` whole: DCP would flatten a dict into one key per item."""

    def __init__(self, value: Any) -> None:
        self.value = value


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, or could not be written or read."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the template state it is loaded into."""


# --------------------------------------------------------------------------- keys


def _wrapper_prefixes(module: torch.nn.Module) -> tuple[str, ...]:
    prefixes = ["_orig_mod."]
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    m: Any = module
    prefix = ""
    while True:
        if _compat.is_optimized_module(m):
            prefix += "_orig_mod."
            m = m._orig_mod
        elif isinstance(m, wrappers):
            prefix += "module."
            m = m.module
        else:
            break
    if prefix:
        prefixes.append(prefix)
    return tuple(prefixes)


def _clean(name: str, prefixes: tuple[str, ...]) -> str:
    for p in prefixes[1:]:
        name = name.removeprefix(p)
    # A compiled submodule leaves "_orig_mod." anywhere in the name.
    return name.replace("._orig_mod.", ".").removeprefix("_orig_mod.")


def _part(k: Any, rename: dict[str, str]) -> str:
    if isinstance(k, pytree.GetAttrKey):
        return k.name
    if isinstance(k, pytree.MappingKey):
        return rename.get(str(k.key), str(k.key))
    if isinstance(k, pytree.SequenceKey):
        return str(k.idx)
    return str(k)


def _is_per_rank(key: str) -> bool:
    return any(key == p or key.startswith(p + "/") for p in PER_RANK)


def _flatten(state: TrainState) -> tuple[list[str], list[Any], Any]:
    """Clean keys, leaves and tree spec of ``state``."""
    prefixes = _wrapper_prefixes(state.module)
    rename = {n: _clean(n, prefixes) for n in (*state.params, *state.buffers)}
    if len(set(rename.values())) != len(rename):
        raise CheckpointError(
            "two parameter names of the model become the same once the wrapper prefixes "
            f"'_orig_mod.'/'module.' are removed: {sorted(rename)}"
        )
    pairs, spec = pytree.tree_flatten_with_path(state)
    keys = ["/".join(_part(k, rename) for k in path) for path, _ in pairs]
    leaves = [leaf for _, leaf in pairs]
    for key, leaf in zip(keys, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise CheckpointError(
                f"state entry {key!r} is a {type(leaf).__name__}; every leaf of a "
                "TrainState must be a tensor (keep Python values in static fields)"
            )
    return keys, leaves, spec


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


# --------------------------------------------------------------------------- statics


_SCALARS = (bool, int, float, str, type(None))


def _statics(obj: Any, path: str, out: dict[str, Any]) -> None:
    """Collect the plain-valued static fields of records (``AccumState.micro``)."""
    if isinstance(obj, struct.Record):
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            where = f"{path}/{f.name}" if path else f.name
            if f.metadata.get("fasttorch_static", False):
                if isinstance(value, _SCALARS):
                    out[where] = value
            else:
                _statics(value, where, out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _statics(v, f"{path}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _statics(v, f"{path}/{i}", out)


def _restore_statics(obj: Any, path: str, facts: dict[str, Any]) -> Any:
    if isinstance(obj, struct.Record):
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            where = f"{path}/{f.name}" if path else f.name
            if f.metadata.get("fasttorch_static", False):
                if isinstance(value, _SCALARS) and where in facts and facts[where] != value:
                    changes[f.name] = facts[where]
            else:
                new = _restore_statics(value, where, facts)
                if new is not value:
                    changes[f.name] = new
        return obj.replace(**changes) if changes else obj
    if isinstance(obj, dict):
        new_d = {k: _restore_statics(v, f"{path}/{k}", facts) for k, v in obj.items()}
        return obj if all(new_d[k] is obj[k] for k in obj) else new_d
    return obj


# --------------------------------------------------------------------------- process group


def _rank_world(pg: Any = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(pg), dist.get_world_size(pg)
    return 0, 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_async_groups: dict[int, Any] = {}


def _async_group() -> Any:
    """A gloo group of its own for background saves, so they never interleave with the
    collectives of training steps on the default group. Created collectively, once."""
    if not _distributed():
        return None
    key = id(dist.group.WORLD)
    if key not in _async_groups:
        _async_groups[key] = dist.new_group(backend="gloo")
    return _async_groups[key]


def _agree(problem: CheckpointError | None, api: str) -> None:
    """Raise on every rank if any rank found a problem, before a collective would hang."""
    if not _distributed():
        if problem is not None:
            raise problem
        return
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if problem is None else (type(problem), str(problem)))
    for r, item in enumerate(found):
        if item is not None:
            cls, msg = item
            if problem is not None:
                raise problem
            raise cls(f"{api} failed on rank {r}: {msg}")


def _broadcast(value: Any, pg: Any) -> Any:
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=pg)
    return box[0]


# --------------------------------------------------------------------------- files


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(
            f"no checkpoint at {str(path)!r}: it is not a directory. Pass a directory "
            "written by fasttorch.checkpoint.save, or use latest(parent_directory)"
        )
    mf = path / MANIFEST
    if not mf.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST} (the file a "
            "save writes last). It was probably interrupted; load an earlier one "
            "(fasttorch.checkpoint.latest skips incomplete checkpoints)"
        )
    try:
        manifest: dict[str, Any] = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable {MANIFEST}: {e}") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {manifest.get('format')!r}; this "
            f"version of fasttorch reads format {FORMAT}"
        )
    return manifest


def verify(path: str | os.PathLike[str], *, hashes: bool = True) -> dict[str, Any]:
    """Check that the checkpoint at ``path`` is complete and intact; return its manifest.

    Every file listed in the manifest must exist with its recorded size and (with
    ``hashes``) SHA-256. :func:`load` calls this first.

    Raises:
        CheckpointError: naming the missing, truncated or corrupted file.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> path = fasttorch.checkpoint.save(tempfile.mkdtemp(), state)
        >>> fasttorch.checkpoint.verify(path)["step"]
        0
    """
    p = Path(path)
    manifest = _read_manifest(p)
    for name, info in manifest["files"].items():
        f = p / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(p)!r} is missing its file {name!r}")
        size = f.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint {str(p)!r} is corrupted: {name!r} has {size} bytes, "
                f"{info['size']} were written (truncated or overwritten)"
            )
        if hashes and _sha256(f) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint {str(p)!r} is corrupted: the SHA-256 of {name!r} differs "
                "from the one recorded when it was written"
            )
    return manifest


def _checkpoints(directory: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.name.startswith((_TMP, _OLD)) or not p.is_dir():
            continue
        try:
            manifest = verify(p, hashes=False)
        except CheckpointError:
            continue
        yield p, manifest


def _order(item: tuple[Path, dict[str, Any]]) -> tuple[int, int, float]:
    _, m = item
    return (m["step"], m["micro"] or 0, m["saved_at"])


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``directory``, or ``None`` if there is none.

    Newest means the highest ``(step, position in the accumulation window)``, then the
    latest save. Temporary directories of saves in progress or interrupted
    (``kill -9``), and checkpoints with missing or truncated files, are skipped.

    Example:
        >>> import tempfile, fasttorch
        >>> fasttorch.checkpoint.latest(tempfile.mkdtemp()) is None
        True
    """
    found = sorted(_checkpoints(Path(directory)), key=_order)
    return found[-1][0] if found else None


_inflight_tmp: set[str] = set()


def prune(directory: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints in ``directory``.

    Also removes leftovers of interrupted saves (temporary directories not being
    written by this process). Returns the paths removed. Call it on one rank only
    (:func:`save` does, on rank 0, with ``keep_last=``).
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"prune: keep_last must be an integer >= 1, got {keep_last!r}")
    d = Path(directory)
    found = sorted(_checkpoints(d), key=_order)
    removed = [p for p, _ in found[:-keep_last]]
    if d.is_dir():
        removed += [
            p
            for p in d.iterdir()
            if p.name.startswith((_TMP, _OLD)) and str(p) not in _inflight_tmp
        ]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


# --------------------------------------------------------------------------- save


@dataclasses.dataclass
class _Plan:
    final: Path
    tmp: Path
    tensors: dict[str, Any]
    manifest: dict[str, Any]
    keep_last: int | None


def _plan(
    directory: str | os.PathLike[str],
    state: TrainState,
    data: Any,
    name: str | None,
    keep_last: int | None,
    pg: Any,
    api: str,
) -> _Plan:
    check_alive(state, api)
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"{api}: keep_last must be None or an integer >= 1, got {keep_last!r}")
    rank, world = _rank_world()
    keys, leaves, _ = _flatten(state)
    step = int(state.step)
    window = state.substates.get(ACCUM_KEY)
    micro = getattr(window, "micro", None)
    if name is None:
        name = f"step_{step:09d}" + (f"_micro{micro}" if micro else "")
    if not name or "/" in name or name.startswith(".") or name != name.strip():
        raise ValueError(
            f"{api}: name must be a plain directory name not starting with '.', got {name!r}"
        )
    token = _broadcast(uuid.uuid4().hex[:12] if rank == 0 else None, pg)
    d = Path(directory)
    tmp = d / f"{_TMP}{name}.{token}"
    tensors: dict[str, Any] = {}
    for key, leaf in zip(keys, leaves):
        tensors[f"rank{rank}/{key}" if _is_per_rank(key) else key] = leaf.detach()
    tensors[f"rank{rank}/{_DATA}"] = _Box(data)
    statics: dict[str, Any] = {}
    _statics(state, "", statics)
    manifest = {
        "format": FORMAT,
        "step": step,
        "micro": micro,
        "world_size": world,
        "module": type(state.module).__name__,
        "optimizer": type(state.optimizer).__name__,
        "statics": statics,
        "entries": {k: _describe(t) for k, t in zip(keys, leaves)},
        "per_rank": [k for k in keys if _is_per_rank(k)],
    }
    return _Plan(d / name, tmp, tensors, manifest, keep_last)


def _dcp_error(e: BaseException, what: str) -> CheckpointError:
    return CheckpointError(f"{what} failed in torch.distributed.checkpoint: {e!r}")


def _write(plan: _Plan, pg: Any) -> Path:
    """Write the DCP files, then (rank 0) the manifest and the rename. All ranks."""
    rank, _ = _rank_world()
    _inflight_tmp.add(str(plan.tmp))
    error: str | None = None
    try:
        try:
            with _quiet():
                _dcp_save(
                    plan.tensors,
                    storage_writer=FileSystemWriter(plan.tmp, sync_files=True),
                    process_group=pg,
                    no_dist=not _distributed(),
                )
        except CheckpointException as e:
            raise _dcp_error(e, f"saving {str(plan.final)!r}") from e
        if rank == 0:
            try:
                _publish(plan)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                raise
    finally:
        _inflight_tmp.discard(str(plan.tmp))
        error = _broadcast(error, pg)
    if error is not None:
        raise CheckpointError(f"rank 0 could not complete {str(plan.final)!r}: {error}")
    return plan.final


def _publish(plan: _Plan) -> None:
    files = {}
    for f in sorted(plan.tmp.iterdir()):
        if f.is_file():
            files[f.name] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    manifest = {**plan.manifest, "saved_at": time.time(), "files": files}
    mf = plan.tmp / MANIFEST
    with open(mf, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(plan.tmp)
    old = None
    if plan.final.exists():
        old = plan.final.with_name(f"{_OLD}{plan.final.name}.{uuid.uuid4().hex[:12]}")
        os.rename(plan.final, old)
    os.rename(plan.tmp, plan.final)
    _fsync_dir(plan.final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if plan.keep_last is not None:
        prune(plan.final.parent, plan.keep_last)


def save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    data: Any = None,
    name: str | None = None,
    keep_last: int | None = None,
) -> Path:
    """Save ``state`` (and your ``data`` position) as a new checkpoint in ``directory``.

    Everything in the state is saved: parameters, buffers, optimizer state and
    hyperparameters, step, loss scale and its counters, accumulation window (its
    position included), EMA copies, the RNG of each rank. ``data`` is any picklable
    object (an epoch and batch index, a sampler's state), saved per rank. The
    checkpoint is written as ``directory/.tmp.<name>.<id>`` and renamed to
    ``directory/<name>`` only once complete, so an interrupted save (even ``kill -9``)
    leaves earlier checkpoints untouched and is never returned by :func:`latest`.
    Call it between steps, on every rank of a distributed job (a collective).

    Args:
        directory: where checkpoints live (created if needed; shared by all ranks).
        state: a live ``TrainState``; it is read, not changed.
        data: your position in the data, returned by :func:`load` on the same rank.
        name: the checkpoint's directory name; default ``step_<step>`` (with
            ``_micro<k>`` inside an accumulation window). An existing checkpoint of
            that name is replaced atomically.
        keep_last: if set, delete all but this many newest checkpoints afterwards.

    Returns:
        The path of the new checkpoint.

    Raises:
        CheckpointError: the write failed (on any rank).

    Example:
        >>> import tempfile, torch, fasttorch
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> root = tempfile.mkdtemp()
        >>> path = fasttorch.checkpoint.save(root, state, data={"batch": 0}, keep_last=2)
        >>> path.name, fasttorch.checkpoint.latest(root) == path
        ('step_000000000', True)
    """
    plan = _plan(directory, state, data, name, keep_last, None, "checkpoint.save")
    return _write(plan, None)


class SaveHandle:
    """A background save started by :func:`async_save`; ``wait()`` for it to complete."""

    def __init__(self, path: Path, thread: threading.Thread | None) -> None:
        self.path = path
        self._thread = thread
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the save has finished (successfully or not); never blocks."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is complete and visible; return its path.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: the save failed.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"async save of {str(self.path)!r} still running")
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(
                f"async save of {str(self.path)!r} failed: {self._error!r}"
            ) from self._error
        return self.path

    def __repr__(self) -> str:
        return f"SaveHandle({str(self.path)!r}, done={self.done()})"


_pending: list[SaveHandle] = []


def _stage(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if t.device.type == "cpu":
        return t.detach().clone()
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    buf.copy_(t.detach(), non_blocking=True)
    return buf


def async_save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    data: Any = None,
    name: str | None = None,
    keep_last: int | None = None,
) -> SaveHandle:
    """Like :func:`save`, but write in a background thread; return at once.

    The state is first copied to CPU memory (pinned for a GPU state), which is the only
    part the caller waits for: the following steps may update the state in place
    while the copy is written. The checkpoint becomes visible, atomically, when the
    write completes; ``handle.wait()`` blocks until then and raises if it failed.
    A new ``async_save`` first waits for the previous one. In a distributed job the
    background writes use a gloo process group of their own.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> handle = fasttorch.checkpoint.async_save(tempfile.mkdtemp(), state)
        >>> handle.wait().name
        'step_000000000'
    """
    wait_pending()
    pg = _async_group()
    plan = _plan(directory, state, data, name, keep_last, pg, "checkpoint.async_save")
    plan.tensors = {k: _stage(v) for k, v in plan.tensors.items()}
    if torch.cuda.is_available() and state.device.type == "cuda":
        torch.cuda.synchronize(state.device)
    handle = SaveHandle(plan.final, None)

    def work() -> None:
        try:
            _write(plan, pg)
        except BaseException as e:
            handle._error = e

    thread = threading.Thread(target=work, name=f"fasttorch-save-{plan.final.name}")
    handle._thread = thread
    _pending.append(handle)
    thread.start()
    return handle


def wait_pending() -> None:
    """Wait for every background save of this process (errors are left to the handles)."""
    while _pending:
        h = _pending.pop(0)
        if h._thread is not None:
            h._thread.join()


# --------------------------------------------------------------------------- load


def _shape(info: dict[str, Any]) -> str:
    return f"{tuple(info['shape'])} {info['dtype']}"


def _check_fit(manifest: dict[str, Any], keys: list[str], leaves: list[Any], where: str) -> None:
    saved: dict[str, Any] = manifest["entries"]
    origin = (
        f"(the checkpoint holds a {manifest['module']} trained by {manifest['optimizer']}; "
        "build the template the same way: model, optimizer, and step.init(...) of the "
        "same transforms)"
    )
    for key, leaf in zip(keys, leaves):
        mine = _describe(leaf)
        if key not in saved:
            raise CheckpointMismatchError(
                f"checkpoint {where} does not fit the template: the template's entry "
                f"{key!r} ({_shape(mine)}) is not in the checkpoint {origin}"
            )
        if saved[key] != mine:
            raise CheckpointMismatchError(
                f"checkpoint {where} does not fit the template: entry {key!r} has "
                f"{_shape(saved[key])} in the checkpoint but {_shape(mine)} in the "
                f"template {origin}"
            )
    extra = [k for k in saved if k not in set(keys)]
    if extra:
        raise CheckpointMismatchError(
            f"checkpoint {where} does not fit the template: its entry {extra[0]!r} "
            f"({_shape(saved[extra[0]])}) has no place in the template "
            f"({len(extra)} such entries) {origin}"
        )


def load(
    path: str | os.PathLike[str],
    template: TrainState,
    *,
    inplace: bool = False,
    verify_hashes: bool = True,
) -> tuple[TrainState, Any]:
    """Load the checkpoint at ``path`` into a state shaped like ``template``.

    ``template`` is a state built the same way as the saved one (same model and
    optimizer, and ``step.init(...)`` for the same transforms); its values do not
    matter. Each rank gets its own RNG, accumulation window and ``data`` back. Files
    are checked against the manifest first; the entries must match the template's
    one for one, in shape and dtype. Resharding works: a checkpoint saved by ``W``
    ranks loads on any number of ranks; a rank that did not exist at save time keeps
    the template's RNG (with a warning), and a window left open mid-accumulation
    cannot be split across a new number of ranks.

    Args:
        path: a checkpoint directory (see :func:`latest`).
        template: the state to fill; left untouched unless ``inplace``.
        inplace: load into the template's own tensors (which the module shares, so the
            module follows) and mark the template donated, as a step does.
        verify_hashes: also check each file's SHA-256 (sizes are always checked).

    Returns:
        ``(state, data)``: the restored state and this rank's saved ``data``.

    Raises:
        CheckpointError: missing, incomplete, truncated or corrupted checkpoint.
        CheckpointMismatchError: it does not fit ``template`` (names the first entry
            that differs, with both shapes).

    Example:
        >>> import tempfile, torch, fasttorch
        >>> def make():
        ...     return fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> path = fasttorch.checkpoint.save(tempfile.mkdtemp(), make(), data=7)
        >>> state, data = fasttorch.checkpoint.load(path, make())
        >>> int(state.step), data
        (0, 7)
    """
    check_alive(template, "checkpoint.load")
    p = Path(path)
    rank, world = _rank_world()
    keys, leaves, spec = _flatten(template)
    problem: CheckpointError | None = None
    try:
        manifest = verify(p, hashes=verify_hashes)
        _check_fit(manifest, keys, leaves, repr(str(p)))
        saved_world = int(manifest["world_size"])
        fresh_rank = rank >= saved_world
        if fresh_rank and manifest["micro"]:
            raise CheckpointError(
                f"checkpoint {str(p)!r} was saved by {saved_world} ranks in the middle of "
                f"an accumulation window ({manifest['micro']} microbatches in); rank "
                f"{rank} of {world} has no window to resume. Resume on {saved_world} "
                "ranks, or from a checkpoint saved at a window boundary"
            )
    except CheckpointError as e:
        problem = e
    _agree(problem, "checkpoint.load")
    targets = leaves if inplace else [torch.empty_like(t) for t in leaves]
    request: dict[str, Any] = {}
    kept: list[str] = []
    for key, t in zip(keys, targets):
        if _is_per_rank(key):
            if fresh_rank:
                kept.append(key)
                continue
            request[f"rank{rank}/{key}"] = t
        else:
            request[key] = t
    if fresh_rank:
        warnings.warn(
            f"checkpoint {str(p)!r} was saved by {saved_world} ranks; rank {rank} keeps "
            f"the template's value for {kept} (its RNG seeds it)",
            UserWarning,
            stacklevel=2,
        )
        for key, t, src in zip(keys, targets, leaves):
            if key in kept and t is not src:
                t.copy_(src)
    else:
        request[f"rank{rank}/{_DATA}"] = None
    try:
        with _quiet():
            _dcp_load(
                request,
                storage_reader=FileSystemReader(p),
                no_dist=not _distributed(),
            )
    except CheckpointException as e:
        raise _dcp_error(e, f"loading {str(p)!r}") from e
    except (OSError, RuntimeError, ValueError, EOFError) as e:
        raise CheckpointError(f"loading {str(p)!r} failed: {e!r}") from e
    state: TrainState = pytree.tree_unflatten(targets, spec)
    state = _restore_statics(state, "", manifest["statics"])
    if inplace:
        mark_donated(template, "checkpoint.load(..., inplace=True)")
    box = request.get(f"rank{rank}/{_DATA}")
    return state, box.value if isinstance(box, _Box) else None


def model_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The parameters and buffers of a checkpoint, keyed like ``model.state_dict()``.

    No template is needed: use it to export trained weights to a plain model,
    ``model.load_state_dict(model_state_dict(path))``. Keys carry no ``_orig_mod.`` or
    ``module.`` prefix, so the model need not be wrapped as it was in training.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> model = torch.nn.Linear(2, 1)
        >>> state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
        >>> path = fasttorch.checkpoint.save(tempfile.mkdtemp(), state)
        >>> torch.nn.Linear(2, 1).load_state_dict(fasttorch.checkpoint.model_state_dict(path))
        <All keys matched successfully>
    """
    p = Path(path)
    manifest = verify(p)
    request: dict[str, Any] = {}
    for key, info in manifest["entries"].items():
        group = key.partition("/")[0]
        if group in ("params", "buffers"):
            dtype = getattr(torch, info["dtype"])
            request[key] = torch.empty(info["shape"], dtype=dtype)
    try:
        with _quiet():
            _dcp_load(request, storage_reader=FileSystemReader(p), no_dist=True)
    except CheckpointException as e:
        raise _dcp_error(e, f"loading {str(p)!r}") from e
    return {k.partition("/")[2]: v for k, v in request.items()}
