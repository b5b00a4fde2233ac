"""The paths a user names, checked before anything is read or written, and the one
test for a symbolic link (fasttorch never follows, deletes or replaces one).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fasttorch.checkpoint._errors import CheckpointError


def _is_link(path: Path) -> bool:
    """Whether ``path`` is a symbolic link (never followed, deleted or replaced)."""
    return os.path.islink(path)


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
