"""How the running eager call goes: the one piece of context the phases read.

A contextvar, not an argument, because the driver must tell the innermost phases how
this call runs (its state is donated; its backward adds into the module's ``.grad``)
without every transform in between threading a value it never reads. Graphs never read
it: each reader checks ``torch.compiler.is_compiling()`` first.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from fasttorch import _compat

__all__ = ["CallScope", "Progress", "begin", "current", "scope"]


@dataclasses.dataclass(frozen=True)
class CallScope:
    """``in_place``: the call donates its state, so phases may update its tensors in place.
    ``into``: an eager accumulation window whose backward adds into the module's ``.grad``
    (a :class:`fasttorch._engine.IntoGrad`), or ``None``. ``progress``: the driver's
    :class:`Progress` of the call. ``state_window``: the accumulation window the call
    adds into is the state's own (across calls), not a scratch one. ``shared``: a
    several-model call's shared forwards, kept for their owners' steps (a
    ``fasttorch._shared_forward.Pending``), or ``None``; read by the operator that
    backpropagates them, which runs outside graphs.
    """

    in_place: bool = False
    into: Any = None
    progress: Progress | None = None
    state_window: bool = False
    shared: Any = None


class Progress:
    """Whether the running call may have written into its donated state (``began``).

    Set outside any graph where a write can begin: an eager update phase that updates
    in place, an eager commit's copies, an accumulation window added into in place,
    a compiled kernel that ran (or failed while running). The driver marks a donated
    input state dead when a call fails after that point. An error raised earlier (by
    the loss function, by a compiler refusing a graph, by validation) leaves it usable;
    only buffers the eager forward updated in place (BatchNorm statistics) may differ.
    """

    began: bool = False


def begin() -> None:
    """Note that the running call may write its donated state now (outside any graph)."""
    progress = _SCOPE.get().progress
    if progress is not None:
        progress.began = True


_SCOPE: contextvars.ContextVar[CallScope] = contextvars.ContextVar(
    "fasttorch_call_scope",
    default=CallScope(),  # noqa: B039 (frozen: never changed, only replaced)
)


def current() -> CallScope:
    """The scope of the running call (the default one outside any call)."""
    return _SCOPE.get()


@contextlib.contextmanager
def scope(**changes: Any) -> Iterator[CallScope]:
    """Run the block with the current scope's fields changed as given."""
    new = dataclasses.replace(_SCOPE.get(), **changes)
    token = _SCOPE.set(new)
    try:
        yield new
    finally:
        _SCOPE.reset(token)


def kernel_ran(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, a compiled kernel, noting in the call scope that it may have written.

    A kernel that ran, or failed while running, may have written into the donated
    state (a counter's increment scheduled before the failing kernel). One that the
    compiler refused (a trace or compile error, a shape error found while tracing)
    ran nothing: the call scope is left as it was.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            # compiled re-raises the user's own error found while tracing from dynamo's
            if not (_compat.is_compile_error(e) or _compat.is_compile_error(e.__cause__)):
                begin()
            raise
        begin()
        return out

    return run
