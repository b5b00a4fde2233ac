"""``own_code``: a function over a fresh copy of its code object (``compiled``'s kernels),
and ``describe``: the name a kernel goes by in ``compiled``'s reports.

Dynamo caches compiled graphs per code object; every step's kernels share the same
source, so each compiled kernel runs a copy of its own (``compile_step_fn``).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

__all__ = ["describe", "own_code"]


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a function or bound method) over a fresh copy of its code object."""
    if isinstance(fn, functools.partial):
        # torch.compile runs a partial through one shared wrapper frame: a plain function
        # with code of its own instead.
        func, bound, named = fn.func, fn.args, fn.keywords

        def call(*args: Any, **kwargs: Any) -> Any:
            return func(*bound, *args, **named, **kwargs)

        functools.update_wrapper(call, func)
        return own_code(call)
    target = getattr(fn, "__func__", fn)
    if not isinstance(target, types.FunctionType):
        return fn
    copy = types.FunctionType(
        target.__code__.replace(),
        target.__globals__,
        target.__name__,
        target.__defaults__,
        target.__closure__,
    )
    copy.__kwdefaults__ = target.__kwdefaults__
    copy.__qualname__ = target.__qualname__
    copy.__dict__.update(target.__dict__)
    if target is not fn:  # a bound method
        return types.MethodType(copy, fn.__self__)  # type: ignore[attr-defined]
    return copy


def describe(fn: Callable[..., Any]) -> str:
    """``fn`` as a recompile report names it: its step and function, where known."""
    bound: tuple[Any, ...] = ()
    if isinstance(fn, functools.partial):
        bound, fn = fn.args, fn.func
    name = getattr(fn, "__name__", type(fn).__name__).lstrip("_")
    owner = getattr(bound[0], "name", None) if bound else None
    if isinstance(owner, str):
        return f"step {owner!r} (its function {name!r})"
    return f"function {name!r}"
