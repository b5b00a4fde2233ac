"""``profiled``: a few steps under ``torch.profiler``, traces for Perfetto, HTA or TensorBoard."""

from __future__ import annotations

import functools
import os
from typing import Any, ClassVar

import torch

from fasttorch import _checks

__all__ = ["Profiled", "profiled"]

PROFILED_MARK = "__fasttorch_profiled__"
"""Set on what :func:`profiled` returns; ``compiled`` refuses to wrap it."""


class Profiled:
    """A ``(state, batch)`` callable that steps a ``torch.profiler.profile`` after each call.

    Built by :func:`profiled`. The profiler starts on the first call and stops by
    itself once its schedule is done (``(wait + warmup + active) * repeat`` calls);
    :meth:`stop` stops it earlier and writes the window being recorded.

    Attributes:
        profiler: the ``torch.profiler.profile`` (``None`` before the first call).
        calls: how many calls went through.
    """

    # Read by compiled, which refuses to wrap a callable that declares why it cannot be
    # compiled (it names no transform): what it is, why, and the order that works.
    compile_refusal: ClassVar[str] = (
        "a profiled step: the profiler steps on the host, which inside a graph is a "
        "graph break. Write profiled(compiled(step), dir=...) instead"
    )

    def __init__(self, step: Any, make: Any, total: int | None) -> None:
        functools.update_wrapper(self, step, updated=())
        self.step = step
        self.transforms = (*getattr(step, "transforms", ()), "profiled")
        self.profiler: torch.profiler.profile | None = None
        self.calls = 0
        self._make = make
        self._total = total
        self._stopped = False
        setattr(self, PROFILED_MARK, True)

    def __repr__(self) -> str:
        return f"Profiled({self.step!r}, calls={self.calls}, stopped={self._stopped})"

    def __call__(self, state: Any, batch: Any) -> Any:
        if self._stopped:
            return self.step(state, batch)
        if self.profiler is None:
            self.profiler = self._make()
            self.profiler.start()
        out = self.step(state, batch)
        self.calls += 1
        self.profiler.step()
        if self._total is not None and self.calls >= self._total:
            self.stop()
        return out

    def stop(self) -> None:
        """Stop profiling now and write the trace of a window still being recorded.

        Later calls run the step without the profiler. Calling it twice is harmless.
        """
        if not self._stopped and self.profiler is not None:
            self.profiler.stop()
        self._stopped = True


def profiled(
    step: Any,
    *,
    dir: str | os.PathLike[str],
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    repeat: int = 1,
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
) -> Profiled:
    """Profile calls of ``step`` with ``torch.profiler`` and write traces to ``dir``.

    Each call runs the step, then advances the profiler's schedule: ``wait`` calls
    ignored, ``warmup`` traced and thrown away, ``active`` recorded, the cycle done
    ``repeat`` times (``0``: until :meth:`Profiled.stop`). Each recorded window is
    written by ``torch.profiler.tensorboard_trace_handler(dir)`` as
    ``<host>_<pid>.<time>.pt.trace.json``. Read it first in Perfetto (ui.perfetto.dev:
    open the file, nothing is uploaded), and for GPU runs with Holistic Trace Analysis;
    TensorBoard's profiler plugin (``torch-tb-profiler``, the ``profile`` extra) opens
    it too but is deprecated upstream. docs/profiling.md shows each. The profiler stops
    by itself after the schedule.

    It wraps the whole call, so it accepts any ``(state, batch)`` callable, a compiled
    step included: write ``profiled(compiled(step))``. ``compiled(profiled(step))``
    is refused, since profiling inside a graph is a graph break.

    Equivalent to::

        with torch.profiler.profile(schedule=torch.profiler.schedule(
                wait=1, warmup=1, active=3, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(dir)) as prof:
            for batch in loader:
                state, metrics = step(state, batch)
                prof.step()

    Args:
        step: a :class:`fasttorch.Step` or any ``(state, batch)`` callable.
        dir: folder for the trace files (created if missing).
        wait, warmup, active, repeat: the schedule, as ``torch.profiler.schedule``.
        record_shapes, profile_memory, with_stack: as ``torch.profiler.profile``.

    Returns:
        A :class:`Profiled` callable with the step's name, and ``.stop()``.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> out = tempfile.mkdtemp()
        >>> step = fasttorch.profiled(fasttorch.step(loss_fn), dir=out, wait=0, warmup=1, active=1)
        >>> for _ in range(3):
        ...     state, metrics = step(state, torch.randn(8, 4))
        >>> import os; [f.endswith(".pt.trace.json") for f in os.listdir(out)]
        [True]
    """
    if getattr(step, PROFILED_MARK, False):
        raise ValueError("profiled: this step is already profiled; apply profiled once")
    if not callable(step):
        raise TypeError(
            f"profiled expects a step or a (state, batch) callable, got {type(step).__name__}"
        )
    for name, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
        _checks.count("profiled", name, value, low=low)
    _checks.count("profiled", "repeat", repeat, low=0, hint="(0 repeats until .stop())")
    if not isinstance(dir, (str, os.PathLike)):
        raise TypeError(f"profiled: dir must be a path, got {type(dir).__name__}")
    trace_dir = os.fspath(dir)

    def make() -> torch.profiler.profile:
        return torch.profiler.profile(
            activities=_activities(),
            schedule=torch.profiler.schedule(
                wait=wait, warmup=warmup, active=active, repeat=repeat
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir),
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
        )

    total = (wait + warmup + active) * repeat if repeat else None
    return Profiled(step, make, total)


def _activities() -> list[torch.profiler.ProfilerActivity]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts
