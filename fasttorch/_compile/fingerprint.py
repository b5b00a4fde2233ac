"""``fingerprint``: a digest of everything a traced step could have read, for a warm start.

A step traced in one process and loaded in another (``compiled(..., cache_dir=)``) keeps
dynamo's guards on tensors only: guards on Python objects (a module's ``eps``, a loss
function's closure, the optimizer's hyperparameters, the identity of functions) cannot
be written to disk. The digest stands in for them. It covers, from the kernel function
and its arguments outward:

* tensors by their metadata (shape, strides, dtype, device, layout, ``requires_grad``,
  class), never their values; the same tensor reached twice is one reference;
* numbers, strings, dtypes, devices and containers by value;
* functions by their code (bytecode, constants, names, recursively), defaults, closure
  cells and the module globals their code names; classes and functions also by the
  bytes of the source file that defines them (a library's files by its version, see
  below), so an edited ``forward`` or loss function makes a new digest;
* ``attrs`` and dataclass instances by their fields (what configures them; caches they
  keep in ``__dict__`` are left out), modules by their attributes, parameters and
  buffers (metadata), submodules and training mode, other objects by ``vars()``.

It over-approximates: anything the trace might depend on is in it, so an equal digest
means an equal traced program. Torch's compile machinery (dynamo, inductor, C++ objects)
is named by type (its behaviour is torch's version, which the caller adds); objects with
no fields to walk by their type and what they print (a numpy value by its bytes; a
default ``repr`` with an address by the type alone: locks, generators). A digest is
deterministic across processes: no ``id``, no address, sets in sorted order. Nesting
deeper than 64 levels raises :class:`TooDeep` instead of giving a partial digest.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import re
import sys
import sysconfig
import types
from typing import Any

import attrs
import torch

__all__ = ["TooDeep", "fingerprint"]

_MAX_DEPTH = 64
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")})


def fingerprint(*roots: Any) -> str:
    """A hex digest of ``roots`` and everything reachable from them (module docstring)."""
    walk = _Walk()
    walk.visit(roots, 0)
    for module, path in sorted(walk.files):  # by module name: a copied project matches
        walk.emit("file", module, _file_digest(path))
    return walk.hash.hexdigest()


class TooDeep(ValueError):
    """Objects nested deeper than the walk goes: no digest (a partial one could match a
    different step)."""


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "unreadable"


def _is_library_path(path: str) -> bool:
    """Torch's files (covered by its version) and the standard library's (Python's)."""
    real = os.path.realpath(path)
    if real.startswith(_TORCH_DIR):
        return True
    return any(real.startswith(p) and "site-packages" not in real for p in _STDLIB)


# Torch's machinery (compiled functions, guards, graphs, C++ objects): named by type only;
# what it does is torch's version. Other torch objects (an autocast context, a
# distribution) are walked like any object.
_MACHINERY = (
    "torch._dynamo",
    "torch._inductor",
    "torch._C",
    "torch._functorch",
    "torch._subclasses",
    "torch._guards",
    "torch.fx",
    "torch._higher_order_ops",
)


def _is_torch_machinery(obj: Any) -> bool:
    module = getattr(type(obj), "__module__", "") or ""
    return module.startswith(_MACHINERY)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def _opaque(obj: Any) -> tuple[str, ...]:
    """An object with no fields to walk: its type, and its value where it prints one.

    A numpy array by its dtype, shape and bytes; anything else by ``repr`` unless that
    holds an address (the default ``repr``: then the type alone, which never matches a
    wrong value, since an object with no fields and no printed value has none to bake in).
    """
    name = _qualname(type(obj))
    tobytes = getattr(obj, "tobytes", None)
    if type(obj).__module__ == "numpy" and callable(tobytes):
        data = hashlib.sha256(tobytes()).hexdigest()
        return (name, str(getattr(obj, "dtype", "")), str(getattr(obj, "shape", "")), data)
    try:
        text = repr(obj)
    except Exception:
        return (name,)
    return (name,) if _ADDRESS.search(text) or len(text) > 10_000 else (name, text)


class _Walk:
    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # holds visited objects, so no id is reused meanwhile
        self.files: set[tuple[str, str]] = set()

    def emit(self, *parts: object) -> None:
        self.hash.update(repr(parts).encode())
        self.hash.update(b"\x00")

    def _first_time(self, obj: Any) -> bool:
        key = id(obj)
        if key in self.seen:
            self.emit("ref", self.seen[key])
            return False
        self.seen[key] = len(self.seen)
        self.keep.append(obj)
        return True

    def _source(self, obj: Any) -> None:
        name = getattr(obj, "__module__", None) or ""
        path = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(path, str) and not _is_library_path(path):
            self.files.add((name, os.path.realpath(path)))

    def visit(self, obj: Any, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise TooDeep(
                f"objects nested deeper than {_MAX_DEPTH} levels ({_qualname(type(obj))})"
            )
        d = depth + 1
        if isinstance(obj, _SCALARS):
            self.emit(type(obj).__name__, repr(obj))
        elif isinstance(obj, torch.Tensor):
            if self._first_time(obj):
                self.emit(
                    "tensor",
                    _qualname(type(obj)),
                    tuple(obj.shape),
                    _strides(obj),
                    str(obj.dtype),
                    str(obj.device),
                    str(obj.layout),
                    obj.requires_grad,
                )
        elif isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            self.emit("torch", str(obj))
        elif isinstance(obj, enum.Enum):
            self.emit("enum", _qualname(type(obj)), obj.name)
        elif isinstance(obj, types.ModuleType):
            self.emit("module", obj.__name__)
        elif isinstance(obj, type):
            self._class(obj, d)
        elif isinstance(obj, types.CodeType):
            self._code(obj, d)
        elif isinstance(obj, types.FunctionType):
            self._function(obj, d)
        elif isinstance(obj, types.MethodType):
            self.emit("method")
            self.visit(obj.__func__, d)
            self.visit(obj.__self__, d)
        elif isinstance(obj, functools.partial):
            if self._first_time(obj):
                self.emit("partial")
                for part in (obj.func, obj.args, obj.keywords):
                    self.visit(part, d)
        elif isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            self.emit(
                "builtin",
                getattr(obj, "__module__", None),
                getattr(obj, "__qualname__", None),
                _qualname(type(getattr(obj, "__self__", None))),
            )
        elif isinstance(obj, (tuple, list)):
            if self._first_time(obj):
                self.emit(type(obj).__name__, len(obj))
                for item in obj:
                    self.visit(item, d)
        elif isinstance(obj, dict):
            if self._first_time(obj):
                self.emit("dict", _qualname(type(obj)), len(obj))
                for k, v in obj.items():
                    self.visit(k, d)
                    # Where the cache is does not change what is compiled (a copied
                    # cache directory must still match).
                    self.visit("<cache_dir>" if k == "cache_dir" else v, d)
        elif isinstance(obj, (set, frozenset)):
            if self._first_time(obj):
                self.emit("set", sorted(_nested(item, d) for item in obj))
        elif _is_torch_machinery(obj):
            self.emit("machinery", _qualname(type(obj)))
        elif not hasattr(obj, "__dict__") and not attrs.has(type(obj)):
            self.emit("opaque", *_opaque(obj))
        else:
            self._object(obj, d)

    def _object(self, obj: Any, d: int) -> None:
        if not self._first_time(obj):
            return
        cls = type(obj)
        self._class(cls, d)
        if attrs.has(cls):
            fields: Any = [(f.name, getattr(obj, f.name, None)) for f in attrs.fields(cls)]
        elif dataclasses.is_dataclass(obj):
            fields = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
        elif isinstance(obj, torch.nn.Module):
            fields = [(k, v) for k, v in vars(obj).items() if not _is_hook_dict(k)]
            fields += [(k, len(v)) for k, v in vars(obj).items() if _is_hook_dict(k)]
        else:
            fields = list(vars(obj).items())
        self.emit("object", len(fields))
        for name, value in fields:
            self.emit("field", name)
            self.visit(value, d)

    def _class(self, cls: type, d: int) -> None:
        self.emit("class", _qualname(cls))
        if not self._first_time(cls):
            return
        for base in cls.__mro__:
            if base.__module__ in ("builtins",) or base.__module__.startswith("torch"):
                continue
            self._source(base)
            for name, member in sorted(vars(base).items()):
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, types.FunctionType):
                    self.emit("member", name)
                    self._function(member, d)

    def _function(self, fn: types.FunctionType, d: int) -> None:
        self.emit("function", fn.__module__, fn.__qualname__)
        if not self._first_time(fn):
            return
        if (fn.__module__ or "").startswith("torch"):
            return  # torch's version covers it
        if fn.__code__.co_filename.startswith("<"):
            # Generated methods (attrs' __init__, __eq__, __hash__ with a per-process
            # salt): the class's source file and fields cover what they do.
            return
        self._source(fn)
        self._code(fn.__code__, d)
        self.visit(fn.__defaults__, d)
        self.visit(fn.__kwdefaults__, d)
        for cell in fn.__closure__ or ():
            try:
                self.visit(cell.cell_contents, d)
            except ValueError:  # an empty cell
                self.emit("empty-cell")
        own = (fn.__module__ or "").startswith("fasttorch")
        for name in _global_names(fn.__code__):
            if name in fn.__globals__:
                value = fn.__globals__[name]
                # fasttorch's own module state (warning registries, caches) is not
                # configuration: its code, constants and functions are.
                if own and not isinstance(value, (*_SCALARS, type, types.FunctionType)):
                    continue
                self.emit("global", name)
                self.visit(value, d)

    def _code(self, code: types.CodeType, d: int) -> None:
        self.emit(
            "code",
            code.co_code,
            code.co_names,
            code.co_varnames,
            code.co_freevars,
            code.co_cellvars,
            code.co_flags,
            code.co_argcount,
            code.co_kwonlyargcount,
        )
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._code(const, d)
            else:
                self.visit(const, d)


def _nested(obj: Any, depth: int) -> str:
    walk = _Walk()
    walk.visit(obj, depth)
    return walk.hash.hexdigest()


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return sorted(set(names))


def _is_hook_dict(name: str) -> bool:
    return name.endswith("_hooks") or name.endswith("_hooks_with_kwargs") or "hooks" in name


def _strides(t: torch.Tensor) -> tuple[int, ...] | None:
    try:
        return tuple(t.stride())
    except RuntimeError:  # sparse and nested layouts have none
        return None


def _qualname(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"
