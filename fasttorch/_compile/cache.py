"""Warm starts: ``compiled(..., cache_dir=)``, the traced step and inductor's caches in a
directory you name.

A cold compile of a whole step takes seconds to minutes: dynamo traces fasttorch's and the
model's Python, then AOT autograd and inductor generate and build code. ``cache_dir``
keeps both parts for later processes (a restarted job, a second process, every rank of a
``torchrun`` job on a filesystem they share):

* :func:`precompiled`: each compiled function traced ahead (torch's ``aot_compile``) and
  written under ``cache_dir/fasttorch-steps/``, named by a :mod:`fasttorch._compile.fingerprint`
  digest of everything the trace could read (the guards on Python objects cannot be
  written); a process with the same digest loads it and runs no dynamo.
* :func:`use_cache_dir`: the directory as this process's inductor cache (FX graphs with
  their kernels, AOT autograd's graphs), which serves whatever is not kept traced.

The directory holds compiled code that later processes run: name only a directory you
trust, as for ``TORCHINDUCTOR_CACHE_DIR``. Nothing is written outside it.
"""

from __future__ import annotations

import os
import platform
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from fasttorch import _compat
from fasttorch._checks import warn_once
from fasttorch._compile.fingerprint import fingerprint
from fasttorch._version import __version__
from fasttorch.state import TrainState, is_sharded

__all__ = ["STEPS_DIR", "check_cache_dir", "kept", "precompiled", "use_cache_dir"]


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


# -- The traced step itself, kept beside inductor's cache --------------------------------

STEPS_DIR = "fasttorch-steps"

# How many traced functions this process kept in and loaded from cache directories.
counts = {"kept": 0, "loaded": 0}


def kept(
    fn: Callable[..., Any],
    mine: Callable[..., Any],
    name: str,
    opts: dict[str, Any],
    where: tuple[str, str | None],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    compiled_fn: Callable[..., Any],
) -> Callable[..., Any]:
    """``compiled_fn``, or the function traced once and kept in the cache directory (a
    warm start without dynamo's tracing, :func:`precompiled`) where that works.

    ``where``: the directory, and why the caller's options rule keeping out, if they do
    (CUDA graphs; regional compilation, whose tensor guards reach through the template's
    submodules, which a new process could not rebuild: "'_Missing' object has no
    attribute '_parameters'", torch 2.13).
    """
    path, why = where
    if not _compat.precompile_available():
        why = f"torch {torch.__version__} cannot load a traced function (aot_compile)"
    elif why is None and opts.get("fullgraph") is not True:
        why = "fullgraph=False"
    elif why is None and any(isinstance(a, TrainState) and is_sharded(a.module) for a in args):
        why = "the state is sharded (FSDP2)"
    if why is None:
        out = precompiled(fn, mine, opts, path, args, kwargs, compiled_fn, name)
        return compiled_fn if out is None else out
    warn_once(
        f"compiled: cache_dir keeps inductor's compiled code but not the traced step, because "
        f"{why}: each new process runs dynamo's tracing again (seconds to a minute)"
    )
    return compiled_fn


def precompiled(
    fn: Callable[..., Any],
    mine: Callable[..., Any],
    opts: dict[str, Any],
    path: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fallback: Callable[..., Any],
    name: str,
) -> Callable[..., Any] | None:
    """``mine`` (``fn`` over its own code) traced once and kept under ``path``, or loaded.

    A later process that builds the same step (equal :func:`fasttorch._compile.fingerprint`
    digest of the function, its closure, the arguments' metadata, the compile options and
    settings, the torch, fasttorch and Python versions and the CPU or GPU) loads dynamo's
    bytecode, its tensor guards and the compiled forward and backward instead of
    tracing. A call whose tensors the guards reject (another shape), or after a module
    changed its training mode, goes to ``fallback`` (the ordinary ``torch.compile`` of
    the function, which compiles for it as a recompile would), with a warning.
    ``None`` where the function cannot be kept (``compiled`` then compiles as before and
    says why, once).
    """
    func = getattr(mine, "__func__", mine)
    if not isinstance(func, types.FunctionType) or func is not mine:
        return None
    external = {f"cell{i}": c.cell_contents for i, c in enumerate(func.__closure__ or ())}
    try:
        key = _key(fn, opts, args, kwargs)
    except Exception as err:
        warn_once(
            f"compiled: the {name} cannot be kept in cache_dir as a traced graph: its "
            f"fingerprint could not be taken ({type(err).__name__}: {_first_line(err)}); "
            "a new process traces it again (inductor's compiled code is still reused)"
        )
        return None
    file = os.path.join(path, STEPS_DIR, f"{_slug(name)}-{key}.bin")
    loaded = None
    if os.path.exists(file):
        try:
            with _compat.inductor_config(opts.get("options")):  # as it was built
                loaded = _compat.load_precompiled(file, func.__globals__, external)
            counts["loaded"] += 1
        except Exception as err:
            warn_once(
                f"compiled: cache_dir holds a traced {name} ({file}) that this process "
                f"cannot load ({type(err).__name__}: {_first_line(err)}); tracing it again "
                "and replacing the file"
            )
    if loaded is None:
        inner = {**opts.get("options", {}), "guard_filter_fn": _compat.portable_guards}
        try:
            ahead = torch.compile(mine, **{**opts, "options": inner})
            with _compat.tracing_autograd_ops():  # the settings the step is traced under
                loaded = _compat.precompile(ahead, args, kwargs)
        except Exception as err:
            warn_once(
                f"compiled: the {name} cannot be kept in cache_dir as a traced graph "
                f"({type(err).__name__}: {_first_line(err)}); it is compiled as without "
                "cache_dir's traced graphs, and a new process traces it again (inductor's "
                "compiled code is still reused)"
            )
            return None
        loaded.disable_guard_check()
        try:
            os.makedirs(os.path.dirname(file), exist_ok=True)
            _compat.save_precompiled(loaded, file, external)
            counts["kept"] += 1
        except Exception as err:
            warn_once(
                f"compiled: could not write the traced {name} to {file} "
                f"({type(err).__name__}: {_first_line(err)}); a new process traces it again"
            )
    return _Guarded(loaded, fallback, name, _modes(args), opts.get("options"))


class _Guarded:
    """A loaded traced function, its tensor guards checked at every call.

    Slots, no ``__dict__``: a later kernel's fingerprint names this wrapper by its type
    (it is reachable from the step's kernel cache) instead of walking into it.
    """

    __slots__ = ("fallback", "fn", "modes", "name", "options")

    def __init__(
        self,
        fn: Any,
        fallback: Callable[..., Any],
        name: str,
        modes: tuple[bool, ...],
        options: dict[str, Any] | None = None,
    ):
        self.fn, self.fallback, self.name, self.modes = fn, fallback, name, modes
        # Inductor's options the function was built with, for its first call, which may
        # build its C++ (``_compat.inductor_config``); then ``None``.
        self.options = options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        why = _compat.precompiled_guard_failure(self.fn, args, kwargs)
        fix = "keep shapes fixed (drop_last=True) or mark the dimension dynamic"
        if why is None and _modes(args) != self.modes:
            why = "a module's training mode changed (train() or eval() on the model)"
            fix = "set the modes before the first call"
        if why is None and self.options is not None:
            with _compat.inductor_config(self.options):
                out = self.fn(*args, **kwargs)
            self.options = None
            return out
        if why is None:
            return self.fn(*args, **kwargs)
        warn_once(
            f"compiled: the traced {self.name} from cache_dir does not fit this call "
            f"({_first_line(why)}); compiling one for it, as a recompile would. To avoid "
            f"it, {fix}"
        )
        return self.fallback(*args, **kwargs)


def _modes(args: tuple[Any, ...]) -> tuple[bool, ...]:
    """The training mode of every submodule of each state's template module."""
    out: list[bool] = []
    for a in args:
        module = a.module if isinstance(a, TrainState) else None
        if isinstance(module, torch.nn.Module):
            out += [m.training for m in _submodules(module)]
    return tuple(out)


_SUBMODULES: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = (
    weakref.WeakKeyDictionary()
)


def _submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module.modules()``, listed once per template (a state's module is static)."""
    found = _SUBMODULES.get(module)
    if found is None:
        found = _SUBMODULES[module] = list(module.modules())
    return found


def _key(fn: Any, opts: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    devices = sorted({str(t.device) for t in _tensors((args, kwargs))})
    gpus = [
        (d, torch.cuda.get_device_name(d), torch.cuda.get_device_capability(d))
        for d in devices
        if d.startswith("cuda")
    ]
    env = (
        torch.__version__,
        __version__,
        sys.version,
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(),
        os.environ.get("ATEN_CPU_CAPABILITY"),
        gpus,
        _rank(),
        _compat.compile_settings(),
    )
    return fingerprint(fn, args, kwargs, opts, env)[:40]


def _rank() -> tuple[int, int] | None:
    """This process's rank and world size: a trace may hold either as a constant (a
    collective's peer, ``dist.get_rank()`` folded in), so ranks keep their own."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")[:60]


def _first_line(err: object) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""
