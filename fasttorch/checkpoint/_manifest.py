"""The manifest (``fasttorch.json``): reading it, checking every field of it before
use, and :func:`verify` (every file there, with its size and SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from fasttorch import _checks
from fasttorch.checkpoint._errors import CheckpointError
from fasttorch.checkpoint._keys import _SCALARS
from fasttorch.checkpoint._paths import _is_link, _path_arg

# Format 2 stores ``data`` as JSON; format 1 pickled it (read only with trust_pickled).
FORMAT = 2
_READABLE = (1, 2)
MANIFEST = "fasttorch.json"
_CHUNK = 1 << 22


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
    return _checks.is_int(x) and low <= x < high


def _is_finite(x: Any) -> bool:
    if not _checks.is_real(x):
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
