"""Warm starts: ``compiled(..., cache_dir=)``, inductor's caches in a directory you name.

A cold compile of a whole step takes seconds to minutes. Inductor keeps what it compiled
(FX graphs with their generated kernels, AOT autograd's forward and backward graphs) in
an on-disk cache, keyed by the graph, the inputs' shapes and dtypes, the options and the
torch version, so a later process compiling the same step loads the result instead of
generating code. ``cache_dir`` is that cache's directory, named once: a restarted job,
a second process, or every rank of a ``torchrun`` job (on a filesystem they share) that
gives the same directory starts from the first one's compile. Dynamo still traces the
step in each process; only code generation is skipped.

The directory holds compiled code that later processes run: name only a directory you
trust, as for ``TORCHINDUCTOR_CACHE_DIR``. Nothing is written outside it.
"""

from __future__ import annotations

import os
from typing import Any

from fasttorch import _compat
from fasttorch._checks import warn_once

__all__ = ["check_cache_dir", "use_cache_dir"]


def check_cache_dir(value: Any, backend: Any) -> str | None:
    """``value`` as an absolute path, or raise for a value ``compiled`` cannot use."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"compiled: cache_dir must be a directory path (str or os.PathLike), got "
            f"{type(value).__name__}"
        )
    if backend != "inductor":
        raise ValueError(
            f"compiled: cache_dir keeps inductor's compiled graphs; backend {backend!r} "
            "generates none. Use the inductor backend, or leave cache_dir out"
        )
    path = os.path.abspath(os.fspath(value))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"compiled: cache_dir {path!r} exists and is not a directory")
    return path


def use_cache_dir(path: str) -> None:
    """Make ``path`` this process's inductor cache directory (before the first compile)."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if before is not None and os.path.abspath(before) != path:
        warn_once(
            f"compiled: cache_dir={path!r} replaces TORCHINDUCTOR_CACHE_DIR={before!r} "
            "for the whole process (inductor has one cache directory per process); "
            "graphs compiled from now on are kept and looked up there"
        )
    os.makedirs(path, exist_ok=True)
    _compat.use_inductor_cache_dir(path)
    off = _compat.inductor_caches_disabled()
    if off is not None:
        warn_once(
            f"compiled: cache_dir={path!r} is given but {off} is off in this process, so "
            "nothing is kept for a warm start. Turn it back on to use the cache"
        )
