"""The directory of checkpoints, crash-safe: :func:`latest`, :func:`prune`, the
hidden names of a change in progress, deletion by rename, directory fsync, and the lock
that keeps one writer per directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from fasttorch import _checks
from fasttorch.checkpoint._errors import CheckpointError
from fasttorch.checkpoint._manifest import _has_manifest, _read_manifest, verify
from fasttorch.checkpoint._paths import _dir_arg, _is_link

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # not on Windows: saves there are not locked (see _lock)
    fcntl = None

# Hidden directories a save or prune leaves while it works (see docs/checkpointing.md):
_TMP = ".tmp."  # a save being written; published by one rename
_OLD = ".old."  # the previous copy of a name being replaced; a valid fallback
_DEL = ".del."  # committed to deletion by one rename; removed file by file


# --------------------------------------------------------------------------- files
# Every change to the directory is one of: os.rename (publish, set aside, commit to
# deletion), os.unlink / os.rmdir (inside a ".del." directory only), os.fsync. The
# kill-injection tests stop a save or a prune before each of these calls in turn.


_no_dir_sync_warned: set[int] = set()


def _fsync_dir(path: Path) -> None:
    """Make the renames inside ``path`` durable; a failure is the save's failure.

    A filesystem that cannot sync a directory at all (EINVAL/ENOTSUP on some network
    and FUSE mounts) is told apart from one that failed to (EIO): the first warns once
    and goes on, since nothing can be done there; the second raises.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise OSError(e.errno, f"fsync of the directory {str(path)!r} failed: {e}") from e
        device = os.fstat(fd).st_dev  # once per filesystem
        if device not in _no_dir_sync_warned:  # tests reset it: a module global, read here
            _no_dir_sync_warned.add(device)
            warnings.warn(
                f"checkpoint: the filesystem of {str(path)!r} cannot fsync a directory "
                f"({e.strerror}); renames there are not made durable against power loss",
                UserWarning,
                stacklevel=3,
            )
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    """Delete ``path`` file by file (a kill leaves a ".del." directory, removed later).

    Never follows a symbolic link: a link inside the tree is removed as a link (its
    target is left alone), and a ``path`` that is itself a link is not touched.
    """
    if _is_link(path):
        return
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            _rmtree(Path(entry.path))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def _discard(path: Path) -> None:
    """Commit ``path`` to deletion with one rename, then delete it (never a link)."""
    if _is_link(path):
        raise CheckpointError(
            f"refusing to delete {str(path)!r}: it is a symbolic link, and fasttorch never "
            "deletes through a link. Remove the link yourself"
        )
    doomed = path.with_name(f"{_DEL}{path.name}.{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    _rmtree(doomed)


def _old_target(p: Path) -> Path:
    """``dir/.old.<name>.<id>`` -> ``dir/<name>``: the name it was the previous copy of."""
    return p.with_name(p.name[len(_OLD) :].rpartition(".")[0])


_reported: set[tuple[str, str]] = set()


def _report_once(p: Path, problem: CheckpointError, api: str) -> None:
    if (str(p), str(problem)) not in _reported:
        _reported.add((str(p), str(problem)))
        warnings.warn(f"{api} skips {str(p)!r}: {problem}", UserWarning, stacklevel=3)


def _checkpoints(directory: Path, api: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every directory with a readable manifest: published ones and ``.old.`` copies.

    Symbolic links are never candidates (a ``best`` or ``latest`` link is the user's,
    and deleting or replacing through it would reach outside the directory). A
    directory without a manifest is an interrupted save, skipped silently; one whose
    manifest is malformed is reported once and skipped (never deleted).
    """
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.name.startswith((_TMP, _DEL)) or _is_link(p) or not p.is_dir():
            continue
        if p.name.startswith(".") and not p.name.startswith(_OLD):
            continue
        if not _has_manifest(p):
            continue
        try:
            manifest = _read_manifest(p)
        except CheckpointError as e:
            _report_once(p, e, api)
            continue
        yield p, manifest


def _order(item: tuple[Path, dict[str, Any]]) -> tuple[int, int, float]:
    _, m = item
    return (int(m["step"]), int(m["micro"] or 0), float(m["saved_at"]))


def latest(directory: str | os.PathLike[str], *, verify_hashes: bool = True) -> Path | None:
    """The newest intact checkpoint in ``directory``, or ``None`` if there is none.

    Newest means the highest ``(step, position in the accumulation window)``, then the
    latest save. Temporary directories of saves in progress or interrupted
    (``kill -9``) are skipped; so, with a warning, are checkpoints with a missing,
    truncated or (``verify_hashes``, the default) corrupted file. If a save that
    replaces a name was interrupted between its two renames, the previous copy is
    returned under its hidden name ``.old.<name>.<id>``; the next :func:`prune` (or
    ``save(..., keep_last=)``) renames it back.

    Example:
        >>> import tempfile, fasttorch
        >>> fasttorch.checkpoint.latest(tempfile.mkdtemp()) is None
        True
    """
    d = _dir_arg(directory, "checkpoint.latest")
    found = sorted(_checkpoints(d, "checkpoint.latest"), key=_order, reverse=True)
    for p, _ in found:
        try:
            verify(p, hashes=verify_hashes)
        except CheckpointError as e:
            warnings.warn(f"checkpoint.latest skips {str(p)!r}: {e}", UserWarning, stacklevel=2)
            continue
        return p
    return None


# Temporary and ".old." directories that a save of this process is working on.
_inflight: set[str] = set()


def prune(
    directory: str | os.PathLike[str],
    keep_last: int,
    *,
    keep_best: int | None = None,
    mode: str = "min",
) -> list[Path]:
    """Keep the ``keep_last`` newest intact checkpoints in ``directory``; delete older ones.

    Each candidate is verified (sizes and SHA-256) from the newest down until
    ``keep_last`` intact ones are found; those are kept, and every checkpoint older
    than the oldest of them is deleted, except the ``keep_best`` intact ones with the
    best ``metric`` (given to :func:`save`; lowest for ``mode="min"``, highest for
    ``"max"``; checkpoints saved without one never count as best). A corrupted
    checkpoint newer than that is left in place, with a warning, and does not count:
    a corrupted newest copy never costs you the intact one before it. Also removes
    what interrupted saves and prunes left: ``.tmp.`` directories not being written
    by this process, ``.del.`` directories, and ``.old.`` copies whose replacement is
    intact (an ``.old.`` copy whose replacement is missing is renamed back). Every
    deletion starts with one rename to ``.del.<name>.<id>``, so a kill never leaves a
    half-deleted checkpoint under a visible name. Symbolic links are never followed,
    deleted or renamed, and a directory whose manifest is malformed is never deleted
    (both are left to you). Returns the paths removed. One process at a time: a
    prune or save of another process in the same directory is refused
    (``CheckpointError``); :func:`save` prunes on rank 0, with ``keep_last=``.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> root = tempfile.mkdtemp()
        >>> a = fasttorch.checkpoint.save(root, state, name="a")
        >>> b = fasttorch.checkpoint.save(root, state, name="b")
        >>> [p.name for p in fasttorch.checkpoint.prune(root, keep_last=1)]
        ['a']
    """
    api = "checkpoint.prune"
    if keep_last is None:
        raise ValueError(f"{api}: keep_last must be an integer >= 1, got None")
    keep = _check_keep(api, keep_last, keep_best, mode, saving=False)
    d = _dir_arg(directory, api)
    if not d.is_dir():
        return []
    lock = _lock(d, api)
    try:
        return _prune(d, keep)
    finally:
        _unlock(lock)


def _prune(d: Path, keep: _Keep) -> list[Path]:
    busy = set(_inflight)
    removed: list[Path] = []
    for p in sorted(d.iterdir()):  # committed deletions and stale temporaries first
        if _is_link(p):  # never followed, never deleted: not fasttorch's
            continue
        if str(p) not in busy and p.name.startswith((_DEL, _TMP)) and p.is_dir():
            (_rmtree if p.name.startswith(_DEL) else _discard)(p)
            removed.append(p)
    found = [(p, m) for p, m in _checkpoints(d, "checkpoint.prune") if str(p) not in busy]
    intact: dict[Path, bool] = {}

    def ok(p: Path) -> bool:
        if p not in intact:
            try:
                verify(p)
                intact[p] = True
            except CheckpointError as e:
                warnings.warn(
                    f"checkpoint.prune keeps {str(p)!r}, which is corrupted: {e}",
                    UserWarning,
                    stacklevel=4,
                )
                intact[p] = False
        return intact[p]

    names = {p for p, _ in found}
    superseded = [
        p
        for p, _ in found
        if p.name.startswith(_OLD) and _old_target(p) in names and ok(_old_target(p))
    ]
    newest = [pm for pm in sorted(found, key=_order, reverse=True) if pm[0] not in superseded]
    kept: list[Path] = []
    doomed: list[Path] = []
    for p, _ in newest:
        if len(kept) < (keep.last or 0):
            if ok(p):
                kept.append(p)
        else:
            doomed.append(p)
    best = _best(newest, keep, ok)
    doomed = [p for p in doomed if p not in best]
    for p in superseded + doomed:
        _discard(p)
        removed.append(p)
    for p in kept + best:  # an interrupted replacement: the previous copy takes its name back
        if p.name.startswith(_OLD) and not os.path.lexists(_old_target(p)):
            os.rename(p, _old_target(p))
            _fsync_dir(d)
    return removed


def _best(newest: list[tuple[Path, dict[str, Any]]], keep: _Keep, ok: Any) -> list[Path]:
    """The ``keep.best`` intact checkpoints with the best metric (newest first on ties)."""
    if not keep.best:
        return []
    sign = 1.0 if keep.mode == "min" else -1.0
    scored = [(p, m["metric"]) for p, m in newest if m.get("metric") is not None]
    best: list[Path] = []
    for p, _ in sorted(scored, key=lambda pm: sign * pm[1]):  # stable: newest first
        if len(best) == keep.best:
            break
        if ok(p):
            best.append(p)
    return best


@dataclasses.dataclass(frozen=True)
class _Keep:
    """What a save prunes to afterwards: the newest ``last``, and the ``best`` by metric."""

    last: int | None = None
    best: int | None = None
    mode: str = "min"


def _check_keep(api: str, keep_last: Any, keep_best: Any, mode: Any, *, saving: bool) -> _Keep:
    for what, value in (("keep_last", keep_last), ("keep_best", keep_best)):
        if value is not None:
            _checks.count(api, what, value, kind="None or an integer >= 1")
    if mode not in ("min", "max"):
        raise ValueError(
            f"{api}: mode must be 'min' (lower metric is better, a loss) or 'max' (an "
            f"accuracy), got {mode!r}"
        )
    if saving and keep_best is not None and keep_last is None:
        raise ValueError(
            f"{api}: keep_best={keep_best} needs keep_last too (the newest checkpoints, "
            "kept to resume from; the best ones are kept beside them), e.g. keep_last=1"
        )
    return _Keep(keep_last, keep_best, mode)


# --------------------------------------------------------------------------- one writer

_locks: dict[tuple[int, int], list[int]] = {}  # directory -> [fd, saves of this process]
_locks_guard = threading.Lock()
_no_lock_warned: set[int] = set()


def _lock(d: Path, api: str) -> tuple[int, int] | None:
    """Hold ``d``'s advisory lock (``flock`` on the directory itself; no file is added)
    for a save or prune of this process; refuse if another process holds it.

    Two processes saving or pruning one directory would delete each other's
    temporaries mid-write. The saves of one process (a ``save`` during an
    ``async_save``) share the lock and are kept apart by ``_inflight``. Where the
    filesystem cannot lock (some network mounts), it warns once and goes on.
    """
    d.mkdir(parents=True, exist_ok=True)
    info = os.stat(d)
    key = (info.st_dev, info.st_ino)
    with _locks_guard:
        if key in _locks:
            _locks[key][1] += 1
            return key
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            if fcntl is None:
                raise OSError(errno.ENOTSUP, "no fcntl module on this platform")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"{api}: another process is saving into or pruning {str(d)!r} right now "
                "(it holds the directory's lock). Two writers would delete each other's "
                "unfinished checkpoints, so fasttorch supports one writer per directory: "
                "give each job its own directory (in a distributed job every rank calls "
                "save, and rank 0 alone changes the directory)"
            ) from None
        except OSError as e:
            os.close(fd)
            if info.st_dev not in _no_lock_warned:
                _no_lock_warned.add(info.st_dev)
                warnings.warn(
                    f"{api}: cannot lock {str(d)!r} ({e}); a second process saving into "
                    "the same directory would not be detected. Use one writer per directory",
                    UserWarning,
                    stacklevel=4,
                )
            return None
        _locks[key] = [fd, 1]
        return key


def _unlock(key: tuple[int, int] | None) -> None:
    if key is None:
        return
    with _locks_guard:
        entry = _locks[key]
        entry[1] -= 1
        if entry[1] == 0:
            del _locks[key]
            os.close(entry[0])  # releases the flock
