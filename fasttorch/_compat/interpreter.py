"""What depends on how CPython runs Python code, not on torch.

:func:`on_large_stack` works around CPython's chunked frame stack (3.11 and later),
whose chunks are mapped and unmapped as calls cross them: a compile's deep, repeated
calls crossing one boundary cost a system call pair and page faults each time.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["LARGE_STACK_SLOTS", "on_large_stack"]

T = TypeVar("T")

# The free frame stack :func:`on_large_stack` gives its callee, in pointer-sized slots
# (8 MiB on a 64-bit build): far deeper than a compile's calls go (inductor's deepest
# recursions are a few thousand frames of tens of slots).
LARGE_STACK_SLOTS = 1 << 20


def _call(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    return fn(*args, **kwargs)


def _large_stack_call() -> (
    Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] | None
):
    """``_call`` with a frame of ``LARGE_STACK_SLOTS`` unused evaluation-stack slots,
    or ``None`` where the interpreter has no chunked frame stack (CPython before 3.11,
    other interpreters), where there is nothing to work around."""
    if sys.implementation.name != "cpython" or sys.version_info < (3, 11):
        return None
    code = _call.__code__.replace(co_stacksize=_call.__code__.co_stacksize + LARGE_STACK_SLOTS)
    return types.FunctionType(code, _call.__globals__, "_call_on_large_stack")


_LARGE = _large_stack_call()


def on_large_stack(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, its calls on a frame stack with no chunk boundary near.

    Why: since 3.11 CPython keeps frames in chunks of 16 KiB, allocated with ``mmap``
    when a call does not fit in the current one and unmapped when that call returns
    (``push_chunk``/``_PyThreadState_PopFrame``, ``Python/pystate.c``). A loop that
    calls across a boundary pays a system call pair and fresh page faults per call:
    python/cpython#142183, fixed by caching one chunk in 3.13 and 3.14 point releases
    (python/cpython#145789), not in 3.11 or 3.12. A compile hits it: dynamo and inductor
    recurse deeply (``torch.utils._pytree``, the pattern matcher), and where the
    caller's depth puts a hot recursion on a boundary, the 12-layer benchmark GPT's
    first step made 820,000 ``mmap``/``munmap`` pairs and took 29 s instead of 22 s
    (docs/design.md, "The frame stack"). Which depth thrashes depends on the caller:
    the same script run as ``python script.py`` and through ``runpy`` differed by
    four frames and by 700,000 pairs.

    How: a frame's evaluation stack is reserved whole when it is pushed, so a frame
    whose code declares ``LARGE_STACK_SLOTS`` more stack slots than it uses gets a
    chunk of its own, twice that size (``push_chunk`` doubles until the frame fits);
    the callee's frames go in the chunk's other half, where no boundary lies. The
    reserved slots are never written, so the memory is mapped but not touched. One
    ``mmap`` per call (14 us), so for calls that compile, not for every step.
    """
    if _LARGE is None:
        return fn(*args, **kwargs)
    out: T = _LARGE(fn, args, kwargs)
    return out
