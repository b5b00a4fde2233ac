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
would otherwise keep one rank's value for a shared key, silently. In a state sharded
with FSDP2 (``fully_shard``) the shards of a parameter, and of what the optimizer and
EMA keep for it, are given to DCP as ``DTensor``s: each rank writes its part of the
whole tensor under the one key, and a load reads the part its template holds, so a
checkpoint saved on N ranks loads on M, sharded or not. The manifest lists those keys
(``sharded``) and gives every entry's whole shape.

Loading never runs code from the checkpoint directory: the user's ``data`` is JSON,
DCP's pickled ``.metadata`` is read by an unpickler that admits only DCP's own
metadata classes, tensors are read with ``torch.load(weights_only=True)``, and a
pickled object anywhere else is refused. ``trust_pickled=True`` opts out, for a
trusted checkpoint of format 1 (whose ``data`` was pickled). Nothing outside the
directory the user names is ever deleted or written: symbolic links are never
followed, and a checkpoint whose manifest is malformed is reported and left alone.
See docs/checkpointing.md for the trust model and the crash-safety rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import pickle
import re
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fasttorch import _compat, struct
from fasttorch.distributed.fsdp import as_dtensor, sharded_leaves
from fasttorch.state import TrainState, check_alive, is_sharded, mark_donated
from fasttorch.transforms.grad_accumulate import KEY as ACCUM_KEY

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "SaveHandle",
    "async_save",
    "export_safetensors",
    "latest",
    "load",
    "model_state_dict",
    "prune",
    "resume",
    "save",
    "verify",
]

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # not on Windows: saves there are not locked (see _lock)
    fcntl = None

# Format 2 stores ``data`` as JSON; format 1 pickled it (read only with trust_pickled).
FORMAT = 2
_READABLE = (1, 2)
MANIFEST = "fasttorch.json"
# Hidden directories a save or prune leaves while it works (see docs/checkpointing.md):
_TMP = ".tmp."  # a save being written; published by one rename
_OLD = ".old."  # the previous copy of a name being replaced; a valid fallback
_DEL = ".del."  # committed to deletion by one rename; removed file by file
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
    """The pickled wrapper of ``data`` in format-1 checkpoints (read with trust_pickled)."""

    def __init__(self, value: Any) -> None:
        self.value = value


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, unsafe, or could not be written or read."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the template state it is loaded into."""


# --------------------------------------------------------------------------- data


def _check_json(value: Any, where: str) -> None:
    """Raise unless ``value`` comes back from JSON exactly as it is (type included)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(
                f"checkpoint data must be JSON; {where} is {value!r}, which JSON cannot "
                "hold. Store it as a string or None"
            )
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"checkpoint data must be JSON; {where} has the key {k!r} "
                    f"({type(k).__name__}), and JSON keys are strings. Use str keys"
                )
            _check_json(v, f"{where}[{k!r}]")
        return
    hint = "use a list" if isinstance(value, tuple) else "convert it to those types first"
    raise TypeError(
        f"checkpoint data must be JSON (dict with str keys, list, str, int, float, bool, "
        f"None), so that loading it can never run code; {where} is a "
        f"{type(value).__name__}: {hint}"
    )


def _encode_data(data: Any) -> torch.Tensor:
    _check_json(data, "data")
    blob = json.dumps(data, allow_nan=False).encode()
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _decode_data(blob: torch.Tensor, where: str) -> Any:
    try:
        return json.loads(bytes(blob.numpy()).decode())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {where}: its data is not valid JSON: {e}") from e


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


def _describe(t: torch.Tensor, like: DTensor | None = None) -> dict[str, Any]:
    """Shape and dtype of an entry; of the whole tensor for a shard laid out as ``like``."""
    shape = t.shape if like is None else like.shape
    return {"shape": list(shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _export_keys(state: TrainState) -> dict[str, Any]:
    """How the saved entries map onto ``module.state_dict()``'s keys, for the export.

    ``non_persistent``: the buffers it leaves out (``persistent=False``, such as a
    rotary ``inv_freq``), saved with the state but not exported. ``aliases``: its keys
    that name a tensor the state keeps under another name (a tied weight), each with
    the entry it comes from.
    """
    module = state.module
    prefixes = _wrapper_prefixes(module)
    exported = module.state_dict(keep_vars=True)
    entry = {id(t): n for n, t in (*module.named_parameters(), *module.named_buffers())}
    group = {n: "params" if n in state.params else "buffers" for n in entry.values()}
    aliases = {}
    for key, t in exported.items():
        name = entry.get(id(t))
        if name is not None and name != key:
            aliases[_clean(key, prefixes)] = f"{group[name]}/{_clean(name, prefixes)}"
    return {
        "non_persistent": [
            f"buffers/{_clean(n, prefixes)}" for n in state.buffers if n not in exported
        ],
        "aliases": aliases,
    }


def _class_name(module: torch.nn.Module) -> str:
    """The model's class name; the user's own under FSDP2's ``FSDP<Name>`` subclass."""
    mro = type(module).__mro__
    return next(c for c in mro if not issubclass(c, FSDPModule)).__name__


def _shards(state: TrainState, keys: list[str]) -> dict[int, DTensor]:
    """The leaves of a sharded state that are FSDP2 shards, by index (none if replicated).

    Each maps to its module parameter, whose mesh, placements and global shape DCP
    needs to write the shard under the whole tensor's key, or to read this rank's part
    of it. The FSDP2 modules are resharded first: after a forward without gradients
    (``state.apply``, ``eval_step``) the root can hold its parameters unsharded, and
    its ``named_parameters`` are then plain whole tensors, not the ``DTensor`` shards.
    A per-rank entry (an open accumulation window) is saved as this rank's own.
    """
    if not is_sharded(state.module):
        return {}
    return {i: p for i, p in sharded_leaves(state).items() if not _is_per_rank(keys[i])}


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
                    if type(facts[where]) is not type(value):  # a hand-edited manifest
                        raise CheckpointMismatchError(
                            f"checkpoint static field {where!r} is {facts[where]!r} "
                            f"({type(facts[where]).__name__}); the template's is "
                            f"{value!r} ({type(value).__name__})"
                        )
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


def _agree(problem: Exception | None, api: str) -> None:
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


def _dcp_error(e: BaseException, what: str) -> CheckpointError:
    return CheckpointError(f"{what} failed in torch.distributed.checkpoint: {e!r}")


@contextlib.contextmanager
def _as_checkpoint_error(what: str) -> Iterator[None]:
    """Report a failed write, read or collective as the documented CheckpointError: a
    dead peer surfaces from gloo as a RuntimeError, DCP's own errors as a BaseException."""
    try:
        yield
    except CheckpointError:
        raise
    except CheckpointException as e:
        raise _dcp_error(e, what) from e
    except (RuntimeError, OSError, EOFError) as e:
        raise CheckpointError(f"{what} failed: {type(e).__name__}: {e}") from e


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
        if device not in _no_dir_sync_warned:
            _no_dir_sync_warned.add(device)
            warnings.warn(
                f"checkpoint: the filesystem of {str(path)!r} cannot fsync a directory "
                f"({e.strerror}); renames there are not made durable against power loss",
                UserWarning,
                stacklevel=3,
            )
    finally:
        os.close(fd)


def _is_link(path: Path) -> bool:
    """Whether ``path`` is a symbolic link (never followed, deleted or replaced)."""
    return os.path.islink(path)


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


def _dir_arg(directory: Any, api: str) -> Path:
    """``directory`` as a Path; an empty one (which would mean the working directory) or
    a value of another type is refused before anything is read or written."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"{api}: directory must be a path (str or os.PathLike), got "
            f"{type(directory).__name__} {directory!r}. Name the directory the "
            "checkpoints live in, e.g. 'checkpoints'"
        )
    text = os.fspath(directory)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"{api}: directory is {text!r}; an empty path would silently mean the current "
            "working directory. Name the checkpoint directory, e.g. 'checkpoints' (or '.' "
            "if you do mean the current directory)"
        )
    return Path(text)


def _path_arg(path: Any, api: str) -> Path:
    """The checkpoint ``path`` to read; ``None`` (what :func:`latest` returns for a
    directory without checkpoints) is refused with what to do instead."""
    if path is None:
        raise CheckpointError(
            f"{api} got path=None: there is no checkpoint to read. "
            "fasttorch.checkpoint.latest(directory) returns None when the directory has "
            "no complete checkpoint yet (a first run, or every save was interrupted). "
            "Start from your fresh state in that case, or call "
            "fasttorch.checkpoint.resume(directory, template), which loads the newest "
            "checkpoint or returns the template when there is none"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{api}: path must be a checkpoint directory (str or os.PathLike), got "
            f"{type(path).__name__} {path!r}"
        )
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"{api}: path is {text!r}, which names no checkpoint. Pass a checkpoint "
            "directory, e.g. fasttorch.checkpoint.latest(directory)"
        )
    return Path(text)


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
        if any(_has_manifest(c) for c in _subdirs(path)):
            raise CheckpointError(
                f"{str(path)!r} is a directory of checkpoints, not a checkpoint: pass one "
                "of them, e.g. fasttorch.checkpoint.latest(directory), or use "
                "fasttorch.checkpoint.resume(directory, template)"
            )
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST} (the file a "
            "save writes last). It was probably interrupted; load an earlier one "
            "(fasttorch.checkpoint.latest skips incomplete checkpoints)"
        )
    if _is_link(mf):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: its {MANIFEST} is a symbolic link; a checkpoint's "
            "files must be its own regular files"
        )
    try:
        manifest: dict[str, Any] = json.loads(mf.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable {MANIFEST}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") not in _READABLE:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {got!r}; this version of fasttorch "
            f"reads formats {list(_READABLE)}"
        )
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is unusable: its {MANIFEST} is malformed: {problem}. "
            "It was not written by fasttorch.checkpoint.save, or was edited; it is never "
            "loaded or deleted by fasttorch (remove or repair it yourself)"
        )
    return manifest


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not _is_link(p)]
    except OSError:
        return []


def _has_manifest(path: Path) -> bool:
    return (path / MANIFEST).is_file()


_INT64 = 1 << 63
_SHA = re.compile(r"[0-9a-f]{64}")


def _is_int(x: Any, low: int = 0, high: int = _INT64) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x < high


def _is_finite(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float's range (10**400)
        return False


def _dtype(name: Any) -> torch.dtype | None:
    """The torch dtype named ``name`` ("float32"), or None: never any other attribute."""
    if not isinstance(name, str) or not name.isidentifier():
        return None
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


def _manifest_problem(m: dict[str, Any]) -> str | None:
    """What is wrong with a parsed manifest's fields (types and ranges), or None.

    Checked before any field is used, so a hostile or hand-edited manifest gives one
    clear error, never a KeyError, a ValueError from ``int()``, or an allocation of
    the size it claims.
    """
    if not _is_int(m.get("step")):
        return f"'step' must be an integer in [0, 2**63), got {m.get('step')!r}"
    if m.get("micro") is not None and not _is_int(m["micro"]):
        return f"'micro' must be null or an integer >= 0, got {m['micro']!r}"
    if not _is_int(m.get("world_size"), 1, 1 << 31):
        return f"'world_size' must be an integer >= 1, got {m.get('world_size')!r}"
    if not _is_finite(m.get("saved_at")):
        return f"'saved_at' must be a finite number, got {m.get('saved_at')!r}"
    for key in ("module", "optimizer"):
        if not isinstance(m.get(key), str):
            return f"{key!r} must be a string, got {m.get(key)!r}"
    files = m.get("files")
    if not isinstance(files, dict):
        return f"'files' must be an object, got {type(files).__name__}"
    for n, info in files.items():
        if not (isinstance(n, str) and n and n == Path(n).name and n not in (".", "..")):
            return f"'files' must list plain file names of the checkpoint directory, got {n!r}"
        if not isinstance(info, dict) or not _is_int(info.get("size")):
            return f"'files'[{n!r}] must be an object with an integer 'size' >= 0, got {info!r}"
        if not (isinstance(info.get("sha256"), str) and _SHA.fullmatch(info["sha256"])):
            return f"'files'[{n!r}] must have a 'sha256' of 64 hex digits"
    entries = m.get("entries")
    if not isinstance(entries, dict):
        return f"'entries' must be an object, got {type(entries).__name__}"
    for key, info in entries.items():
        problem = _entry_problem(info)
        if problem is not None:
            return f"'entries'[{key!r}] {problem}"
    if not isinstance(m.get("statics", {}), dict) or not all(
        isinstance(v, _SCALARS) for v in m.get("statics", {}).values()
    ):
        return "'statics' must be an object of plain values (numbers, strings, null)"
    for key in ("per_rank", "sharded", "non_persistent"):
        v = m.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            return f"{key!r} must be a list of strings, got {v!r}"
    # The entries cannot hold more bytes than the files (each is stored at least once):
    # a huge claimed shape is refused here, before anything is allocated for it.
    stored = sum(info["size"] for info in files.values())
    claimed = sum(_nbytes(info) for info in entries.values())
    if claimed > stored:
        return (
            f"its entries come to {claimed} bytes in all, but its files hold {stored} "
            "bytes (nothing was allocated)"
        )
    aliases = m.get("aliases", {})
    if not isinstance(aliases, dict) or not all(
        isinstance(v, str) and v in entries for v in aliases.values()
    ):
        return "'aliases' must map names to entries of 'entries'"
    metric = m.get("metric")
    if metric is not None and not _is_finite(metric):
        return f"'metric' must be null or a finite number, got {metric!r}"
    return None


def _entry_problem(info: Any) -> str | None:
    if not isinstance(info, dict):
        return f"must be an object with 'shape' and 'dtype', got {info!r}"
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape) or len(shape) > 64:
        return f"has shape {shape!r}; a shape is a list of integers >= 0"
    if _dtype(info.get("dtype")) is None:
        return f"has dtype {info.get('dtype')!r}, which is not a torch dtype"
    return None


def _nbytes(info: dict[str, Any]) -> int:
    dtype = _dtype(info["dtype"])
    assert dtype is not None
    return int(math.prod(info["shape"])) * dtype.itemsize


def verify(path: str | os.PathLike[str], *, hashes: bool = True) -> dict[str, Any]:
    """Check that the checkpoint at ``path`` is complete and intact; return its manifest.

    Every file listed in the manifest must exist with its recorded size and (with
    ``hashes``) SHA-256. :func:`load` calls this first. The manifest lives in the same
    directory, so this detects damage (a truncated copy, a flipped bit), not a
    deliberate change: see the trust model in docs/checkpointing.md.

    Raises:
        CheckpointError: naming the missing, truncated or corrupted file.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> path = fasttorch.checkpoint.save(tempfile.mkdtemp(), state)
        >>> fasttorch.checkpoint.verify(path)["step"]
        0
    """
    p = _path_arg(path, "checkpoint.verify")
    manifest = _read_manifest(p)
    for name, info in manifest["files"].items():
        f = p / name
        if _is_link(f):
            raise CheckpointError(
                f"checkpoint {str(p)!r}: its file {name!r} is a symbolic link; a "
                "checkpoint's files must be its own regular files"
            )
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


# --------------------------------------------------------------------------- save


@dataclasses.dataclass
class _Plan:
    final: Path
    tmp: Path
    tensors: dict[str, Any]
    manifest: dict[str, Any]
    keep: _Keep
    lock: Any = None


@dataclasses.dataclass(frozen=True)
class _Keep:
    """What a save prunes to afterwards: the newest ``last``, and the ``best`` by metric."""

    last: int | None = None
    best: int | None = None
    mode: str = "min"


def _check_keep(api: str, keep_last: Any, keep_best: Any, mode: Any, *, saving: bool) -> _Keep:
    for what, value in (("keep_last", keep_last), ("keep_best", keep_best)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{api}: {what} must be None or an integer >= 1, got {value!r}")
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


def _check_metric(api: str, metric: Any) -> float | None:
    """``metric`` as a finite float (a 0-d tensor is read once, here, between steps)."""
    if metric is None:
        return None
    if isinstance(metric, torch.Tensor) and metric.numel() == 1 and not metric.is_complex():
        metric = metric.detach().reshape(()).item()
    if isinstance(metric, bool) or not isinstance(metric, (int, float)) or not _is_finite(metric):
        raise ValueError(
            f"{api}: metric must be a finite number (or a one-element tensor), got "
            f"{metric!r}. Pass None for a checkpoint that must not compete for keep_best "
            "(a diverged run's NaN loss, for instance)"
        )
    return float(metric)


def _optimizer_name(optimizer: Any) -> str:
    """The optimizer as the user chose it: ``AdamW`` for fasttorch.optim.adamw (an
    ``Adam`` with decoupled weight decay), ``TorchOptimizer(RMSprop)`` for from_torch."""
    name = type(optimizer).__name__
    if getattr(optimizer, "decoupled_weight_decay", False) is True:
        name += "W"
    cls = getattr(optimizer, "cls", None)
    if isinstance(cls, type):
        name += f"({cls.__name__})"
    return name


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
    step = int(state.step)
    window = state.substates.get(ACCUM_KEY)
    micro = getattr(window, "micro", None)
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
    tensors: dict[str, Any] = {}
    for i, (key, leaf) in enumerate(zip(keys, leaves)):
        if i in shards:  # DCP writes this rank's part of the whole tensor under its key
            tensors[key] = as_dtensor(leaf.detach(), shards[i])
        else:
            tensors[f"rank{rank}/{key}" if _is_per_rank(key) else key] = leaf.detach()
    tensors[f"rank{rank}/{_DATA}"] = blob
    statics: dict[str, Any] = {}
    _statics(state, "", statics)
    window = state.substates.get(ACCUM_KEY)
    manifest = {
        "format": FORMAT,
        "step": int(state.step),
        "micro": getattr(window, "micro", None),
        "world_size": world,
        "module": _class_name(state.module),
        "optimizer": _optimizer_name(state.optimizer),
        "statics": statics,
        "entries": {k: _describe(t, shards.get(i)) for i, (k, t) in enumerate(zip(keys, leaves))},
        "per_rank": [k for k in keys if _is_per_rank(k)],
        "sharded": [keys[i] for i in sorted(shards)],
        **_export_keys(state),
        "metric": metric,
    }
    return _Plan(d / name, tmp, tensors, manifest, keep, lock)


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
            files[f.name] = {"size": f.stat().st_size, "sha256": _sha256(f)}
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
    state: TrainState,
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

    Args:
        directory: where checkpoints live (created if needed; shared by all ranks).
        state: a live ``TrainState``; it is read, not changed.
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
    keep = _check_keep(api, keep_last, keep_best, mode, saving=True)
    plan = _plan(directory, state, data, name, keep, _check_metric(api, metric), None, api)
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
    if isinstance(t, DTensor):
        if t.device.type == "cpu":
            return as_dtensor(t.to_local().clone(), t)
        return t.to("cpu")  # a DTensor whose shard is in host memory, laid out as t
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
    metric: float | torch.Tensor | None = None,
    keep_best: int | None = None,
    mode: str = "min",
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
    api = "checkpoint.async_save"
    keep = _check_keep(api, keep_last, keep_best, mode, saving=True)
    plan = _plan(directory, state, data, name, keep, _check_metric(api, metric), pg, api)
    try:
        plan.tensors = {k: _stage(v) for k, v in plan.tensors.items()}
        if torch.cuda.is_available() and state.device.type == "cuda":
            torch.cuda.synchronize(state.device)
    except BaseException:
        _unlock(plan.lock)
        raise
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


# --------------------------------------------------------------------------- safe reading
# torch 2.13 (and upstream, pytorch/pytorch#189308) reads DCP's ".metadata" with a
# plain pickle.load, and DefaultLoadPlanner.load_bytes unpickles any non-tensor entry with
# torch.load(weights_only=False). Tensors are read with weights_only=True. So fasttorch
# reads the metadata itself, with an unpickler that can only rebuild DCP's metadata
# records, and refuses every non-tensor entry.

_MetadataUnpickler = _compat.DcpMetadataUnpickler


def _unsafe(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {str(path)!r} refused: {what}. fasttorch never runs code from a "
        "checkpoint, and a pickle that names anything else could. If you wrote this "
        "checkpoint yourself and trust every byte of it, load it with "
        "trust_pickled=True"
    )


def _check_metadata(md: Any, path: Path, files: set[str]) -> None:
    """The metadata must be DCP's records pointing only into the manifest's files."""
    if not isinstance(md, _dcp_md.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise _unsafe(path, ".metadata does not hold DCP metadata")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(
            entry, (_dcp_md.TensorStorageMetadata, _dcp_md.BytesStorageMetadata)
        ) or not isinstance(key, str):
            raise _unsafe(path, f".metadata entry {key!r} is a {type(entry).__name__}")
    if not isinstance(md.storage_data, dict):
        raise _unsafe(path, ".metadata has no storage table")
    for info in md.storage_data.values():
        name = getattr(info, "relative_path", None)
        if name not in files or getattr(info, "transform_descriptors", None):
            raise _unsafe(
                path, f".metadata points at {name!r}, which is not a plain file of the manifest"
            )


class _SafeReader(FileSystemReader):
    """DCP's file reader with :class:`_MetadataUnpickler` for ``.metadata``."""

    def __init__(self, path: Path, files: set[str]) -> None:
        super().__init__(path)
        self._where = path
        self._files = files
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> _dcp_md.Metadata:
        if self._metadata is None:
            try:
                with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                    md = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise _unsafe(self._where, f".metadata {e}") from e
            except Exception as e:
                raise CheckpointError(
                    f"checkpoint {str(self._where)!r}: unreadable DCP .metadata: {e!r}"
                ) from e
            _check_metadata(md, self._where, self._files)
            self._metadata = md
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = _dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md  # type: ignore[no-any-return]


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """Loads tensors (read with ``weights_only=True``); refuses pickled entries."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
            "fasttorch does not unpickle checkpoint entries (trust_pickled=True does)"
        )


def _tensor_entries(reader: _SafeReader, keys: list[str], path: Path) -> dict[str, Any]:
    """The metadata of ``keys``: each must be a tensor entry (never a pickled one)."""
    md = reader.read_metadata()
    out = {}
    for key in keys:
        entry = md.state_dict_metadata.get(key)
        if entry is None:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: its .metadata has no entry {key!r}, which "
                "its manifest lists"
            )
        if not isinstance(entry, _dcp_md.TensorStorageMetadata):
            raise _unsafe(path, f"its entry {key!r} is a pickled object, not a tensor")
        out[key] = entry
    return out


def _trust_warning(path: Path) -> None:
    warnings.warn(
        f"checkpoint {str(path)!r} is read with trust_pickled=True: its pickled parts "
        "are unpickled without restriction and can run any code. Do this only for a "
        "checkpoint you wrote yourself",
        UserWarning,
        stacklevel=3,
    )


# --------------------------------------------------------------------------- load


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


def load(
    path: str | os.PathLike[str],
    template: TrainState,
    *,
    inplace: bool = False,
    verify_hashes: bool = True,
    trust_pickled: bool = False,
) -> tuple[TrainState, Any]:
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
    check_alive(template, "checkpoint.load")
    rank, world = _rank_world()
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
    data_key = f"rank{rank}/{_DATA}"
    names: dict[str, str] = {}  # template key -> checkpoint key, for the entries read
    data_shape: list[int] | None = None
    reader: FileSystemReader | None = None
    problem: CheckpointError | None = None
    try:
        manifest = verify(p, hashes=verify_hashes)
        _check_fit(manifest, keys, leaves, repr(str(p)), shards, template)
        saved_world = int(manifest["world_size"])
        fresh_rank = rank >= saved_world
        if fresh_rank and manifest["micro"]:
            raise CheckpointError(
                f"checkpoint {str(p)!r} was saved by {saved_world} ranks in the middle of "
                f"an accumulation window ({manifest['micro']} microbatches in); rank "
                f"{rank} of {world} has no window to resume. Resume on {saved_world} "
                "ranks, or from a checkpoint saved at a window boundary"
            )
        for key in keys:
            if not _is_per_rank(key):
                names[key] = key
            elif not fresh_rank:
                names[key] = f"rank{rank}/{key}"
        if manifest["format"] == 1 and not trust_pickled:
            raise _unsafe(p, "it is a format-1 checkpoint, whose data= is pickled")
        if trust_pickled:
            _trust_warning(p)
            reader = FileSystemReader(p)
            if not fresh_rank and manifest["format"] != 1:
                md = reader.read_metadata()
                data_shape = list(getattr(md.state_dict_metadata[data_key], "size", ()))
        else:
            safe = _SafeReader(p, set(manifest["files"]))
            wanted = [*names.values(), *([] if fresh_rank else [data_key])]
            entries = _tensor_entries(safe, wanted, p)
            if not fresh_rank:
                data_shape = list(entries[data_key].size)
                stored = sum(info["size"] for info in manifest["files"].values())
                if math.prod(data_shape) > stored:  # a crafted .metadata: never allocated
                    raise CheckpointError(
                        f"checkpoint {str(p)!r}: its .metadata gives data= a size of "
                        f"{data_shape}, more than its files hold ({stored} bytes)"
                    )
            reader = safe
    except CheckpointError as e:
        problem = e
    except (OSError, RuntimeError, ValueError, KeyError, EOFError) as e:
        problem = CheckpointError(f"loading {str(p)!r} failed: {e!r}")
    with _as_checkpoint_error(f"checkpoint.load of {str(p)!r}"):
        _agree(problem, "checkpoint.load")
    assert reader is not None
    # Read into fresh tensors (on CPU for inplace): nothing the caller holds changes
    # unless every value was read. A shard is read through a DTensor over its scratch
    # (on the shard's device, where its mesh is), so DCP fetches this rank's part of
    # the whole tensor, whatever the number of ranks that saved it.
    scratch: dict[str, torch.Tensor] = {}
    request: dict[str, Any] = {}
    for i, (key, t) in enumerate(zip(keys, leaves)):
        if key not in names:
            continue
        if i in shards:
            scratch[key] = torch.empty_like(t)
            request[names[key]] = as_dtensor(scratch[key], shards[i])
        else:
            scratch[key] = torch.empty_like(t, device="cpu") if inplace else torch.empty_like(t)
            request[names[key]] = scratch[key]
    kept = [k for k in keys if k not in names]
    if kept:
        warnings.warn(
            f"checkpoint {str(p)!r} was saved by {saved_world} ranks; rank {rank} keeps "
            f"the template's value for {kept} (its RNG seeds it)",
            UserWarning,
            stacklevel=2,
        )
    elif data_shape is not None:
        request[data_key] = torch.empty(data_shape, dtype=torch.uint8)
    else:
        request[data_key] = None  # format 1, trusted: a pickled _Box
    try:
        with _quiet():
            _dcp_load(
                request,
                storage_reader=reader,
                planner=None if trust_pickled else _TensorsOnlyPlanner(),
                no_dist=not _distributed(),
            )
    except CheckpointException as e:
        raise _dcp_error(e, f"loading {str(p)!r}") from e
    except CheckpointError:
        raise
    except (OSError, RuntimeError, ValueError, EOFError) as e:
        raise CheckpointError(f"loading {str(p)!r} failed: {e!r}") from e
    if inplace:
        for key, t in zip(keys, leaves):
            if key in scratch:
                t.detach().copy_(scratch[key])
        targets = leaves
    else:
        targets = [scratch[k] if k in scratch else t.detach().clone() for k, t in zip(keys, leaves)]
    state: TrainState = pytree.tree_unflatten(targets, spec)
    state = _restore_statics(state, "", manifest["statics"])
    if inplace:
        mark_donated(template, "checkpoint.load(..., inplace=True)")
    if kept:
        return state, None
    value = request[data_key]
    if isinstance(value, torch.Tensor):
        return state, _decode_data(value, repr(str(p)))
    return state, value.value if isinstance(value, _Box) else None


def resume(
    directory: str | os.PathLike[str],
    template: TrainState,
    *,
    data: Any = None,
    inplace: bool = False,
    verify_hashes: bool = True,
) -> tuple[TrainState, Any]:
    """Load the newest checkpoint in ``directory`` into ``template``, or start fresh.

    One call for the start of every run: the same code serves the first run (no
    checkpoint yet: ``(template, data)`` come back as given) and every restart (the
    newest intact checkpoint, as :func:`latest` finds it, loaded by :func:`load`).
    The plain equivalent::

        path = latest(directory)
        state, data = (template, data) if path is None else load(path, template)

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
    check_alive(template, "checkpoint.resume")
    found = latest(d, verify_hashes=verify_hashes)
    if found is None:
        return template, data
    return load(found, template, inplace=inplace, verify_hashes=verify_hashes)


def model_state_dict(
    path: str | os.PathLike[str], *, trust_pickled: bool = False
) -> dict[str, torch.Tensor]:
    """The parameters and buffers of a checkpoint, keyed like ``model.state_dict()``.

    No template is needed: use it to export trained weights to a plain model,
    ``model.load_state_dict(model_state_dict(path))``. Keys carry no ``_orig_mod.`` or
    ``module.`` prefix, so the model need not be wrapped as it was in training. Like
    :func:`load`, it never runs code from the checkpoint unless ``trust_pickled``.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> model = torch.nn.Linear(2, 1)
        >>> state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
        >>> path = fasttorch.checkpoint.save(tempfile.mkdtemp(), state)
        >>> torch.nn.Linear(2, 1).load_state_dict(fasttorch.checkpoint.model_state_dict(path))
        <All keys matched successfully>
    """
    p = _path_arg(path, "checkpoint.model_state_dict")
    manifest = verify(p)
    request: dict[str, Any] = {}
    left_out = set(manifest.get("non_persistent", ()))
    for key, info in manifest["entries"].items():
        group = key.partition("/")[0]
        if group in ("params", "buffers") and key not in left_out:
            request[key] = torch.empty(info["shape"], dtype=_dtype(info["dtype"]))
    if trust_pickled:
        _trust_warning(p)
        reader: FileSystemReader = FileSystemReader(p)
    else:
        safe = _SafeReader(p, set(manifest["files"]))
        _tensor_entries(safe, list(request), p)
        reader = safe
    try:
        with _quiet():
            _dcp_load(
                request,
                storage_reader=reader,
                planner=None if trust_pickled else _TensorsOnlyPlanner(),
                no_dist=True,
            )
    except CheckpointException as e:
        raise _dcp_error(e, f"loading {str(p)!r}") from e
    except (OSError, RuntimeError, ValueError, EOFError) as e:
        raise CheckpointError(f"loading {str(p)!r} failed: {e!r}") from e
    out = {k.partition("/")[2]: v for k, v in request.items()}
    for key, source in manifest.get("aliases", {}).items():  # tied weights, by each name
        if source in request:
            out[key] = request[source]
    return out


# --------------------------------------------------------------------------- safetensors
# The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte
# little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} with
# optional "__metadata__" (str -> str), then the raw little-endian bytes. It is written
# here (~40 lines) rather than through the `safetensors` package, so that exporting
# needs no extra dependency; the tests read the files back with `safetensors` itself.

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def export_safetensors(
    source: str | os.PathLike[str] | TrainState,
    file: str | os.PathLike[str],
    *,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a model's weights to one ``.safetensors`` file that loads without fasttorch.

    ``source`` is a checkpoint directory (its :func:`model_state_dict`) or a live
    ``TrainState`` (its ``state_dict()``): exactly the keys of ``model.state_dict()``.
    Read it back with ``safetensors.torch.load_file(file)`` and
    ``model.load_state_dict(...)``, or hand it to any tool that reads safetensors. The
    file is written beside its final name and renamed into place once complete (an
    existing file, or a link, of that name is replaced, never written through).

    The plain PyTorch equivalent:
    ``safetensors.torch.save_file(model.state_dict(), file, metadata={"format": "pt"})``.

    Args:
        source: a checkpoint directory or a state (not a sharded one: export its
            checkpoint, which holds the whole tensors).
        file: the file to write; its directory must exist.
        metadata: extra ``str -> str`` entries for the header (``"format": "pt"`` is
            always set, as Hugging Face libraries expect).

    Example:
        >>> import tempfile, os, torch, fasttorch
        >>> from safetensors.torch import load_file
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> out = fasttorch.checkpoint.export_safetensors(
        ...     state, os.path.join(tempfile.mkdtemp(), "model.safetensors"))
        >>> torch.nn.Linear(2, 1).load_state_dict(load_file(out))
        <All keys matched successfully>
    """
    api = "checkpoint.export_safetensors"
    if isinstance(source, TrainState):
        check_alive(source, api)
        if is_sharded(source.module):
            raise ValueError(
                f"{api}: the state is sharded (FSDP2), so it holds only this rank's "
                "shards. Save a checkpoint and export that path: it holds whole tensors"
            )
        tensors = {k: v for k, v in source.state_dict().items() if isinstance(v, torch.Tensor)}
    else:
        tensors = model_state_dict(_path_arg(source, api))
    out = _file_arg(file, api)
    head: dict[str, Any] = {"__metadata__": {**(metadata or {}), "format": "pt"}}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in head["__metadata__"].items()):
        raise TypeError(f"{api}: metadata must map str to str, got {metadata!r}")
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{api}: {name!r} is a {t.dtype} tensor, which safetensors cannot hold")
        raw = t.reshape(-1).view(torch.uint8)
        head[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.numel()],
        }
        offset += raw.numel()
        blobs.append(raw)
    _write_safetensors(out, head, blobs)
    return out


def _file_arg(file: Any, api: str) -> Path:
    if not isinstance(file, (str, os.PathLike)) or not str(os.fspath(file)).strip():
        raise ValueError(f"{api}: file must name a file to write, got {file!r}")
    out = Path(os.fspath(file))  # type: ignore[arg-type]
    if out.is_dir() and not _is_link(out):
        raise CheckpointError(
            f"{api}: {str(out)!r} is a directory; name a file, e.g. model.safetensors"
        )
    if not out.parent.is_dir():
        raise CheckpointError(
            f"{api}: the directory of {str(out)!r} does not exist; create it first"
        )
    return out


def _write_safetensors(out: Path, head: dict[str, Any], blobs: list[torch.Tensor]) -> None:
    if sys.byteorder != "little":
        raise CheckpointError("export_safetensors writes little-endian data; this machine is not")
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:  # a new file of ours: never an existing one or a link
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for raw in blobs:
                f.write(raw.numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(out.parent)
