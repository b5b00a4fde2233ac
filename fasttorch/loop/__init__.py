"""Loop helpers: small pieces for the loop you write yourself (fasttorch is not a Trainer).

* :func:`until`: step indices until a step budget or a wall-clock budget runs out;
* :func:`every`: a predicate for "evaluate / log / checkpoint every k steps";
* :class:`EarlyStopping`: stop when a metric stops improving;
* :class:`Logger`: reads metrics to the host only every k steps, and hands them to
  sinks: a printed line, :class:`TensorBoardWriter`, :class:`CSVWriter`,
  :class:`JSONLWriter`, or any ``(step, {name: float})`` callable;
* :class:`Progress`: a one-line progress display (loss, lr, precision, loss scale,
  steps/s, memory), no dependency.

Reading a metric (``float(tensor)``) waits for the device. These helpers read only on
the steps they report, so the steps in between run without host syncs.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TextIO

import torch

from fasttorch import _checks
from fasttorch.loop._writers import CSVWriter, JSONLWriter, TensorBoardWriter, scalars

__all__ = [
    "CSVWriter",
    "EarlyStopping",
    "JSONLWriter",
    "Logger",
    "Progress",
    "TensorBoardWriter",
    "every",
    "memory_bytes",
    "until",
]

Clock = Callable[[], float]
Sink = Callable[[int, dict[str, float]], Any]


def until(
    max_steps: int | None = None,
    *,
    max_seconds: float | None = None,
    start: int = 0,
    clock: Clock = time.monotonic,
) -> Iterator[int]:
    """Yield step indices ``start, start + 1, ...`` until either budget is spent.

    The time budget is checked before each step, from the first ``next``: a step that
    started in time is allowed to finish.

    Args:
        max_steps: stop before index ``max_steps`` (``None``: no step limit).
        max_seconds: stop once this much wall time has passed (``None``: no limit).
        start: the first index (resume from ``int(state.step)``).
        clock: the time source (seconds), for tests.

    Returns:
        An iterator of ints.

    Example:
        >>> from fasttorch.loop import until
        >>> list(until(3)), list(until(5, start=3))
        ([0, 1, 2], [3, 4])
    """
    if max_steps is None and max_seconds is None:
        raise ValueError("until: give max_steps, max_seconds or both; both None never stops")
    if max_steps is not None:
        _checks.count("until", "max_steps", max_steps, low=0, hint="Or pass None: no limit.")
    if max_seconds is not None:
        _checks.real("until", "max_seconds", max_seconds, low=0.0, low_open=True, finite=False)
    _checks.count("until", "start", start, low=0, hint="Resume with start=int(state.step).")
    return _until(max_steps, max_seconds, start, clock)


def _until(
    max_steps: int | None, max_seconds: float | None, start: int, clock: Clock
) -> Iterator[int]:
    t0 = clock()
    i = start
    while max_steps is None or i < max_steps:
        if max_seconds is not None and clock() - t0 >= max_seconds:
            return
        yield i
        i += 1


def every(k: int, *, first: bool = False) -> Callable[[int], bool]:
    """A predicate on 0-based step indices, true on the last step of every ``k``.

    ``every(k)(i)`` is ``(i + 1) % k == 0``: true at ``i = k - 1, 2k - 1, ...``, that is
    after each ``k`` completed steps. ``first=True`` also makes it true at ``i = 0``
    (a baseline evaluation before training has moved).

    Example:
        >>> from fasttorch.loop import every
        >>> [i for i in range(10) if every(4)(i)], [i for i in range(6) if every(3, first=True)(i)]
        ([3, 7], [0, 2, 5])
    """
    _checks.count("every", "k", k)

    def due(i: int) -> bool:
        return (i + 1) % k == 0 or (first and i == 0)

    return due


class EarlyStopping:
    """Stop when a metric has not improved by ``min_delta`` for ``patience`` checks.

    Call :meth:`update` with each evaluation's value (this reads it to the host, once
    per evaluation); it returns ``True`` when training should stop.

    Args:
        patience: checks without improvement tolerated before stopping (``>= 1``).
        min_delta: the smallest change that counts as an improvement (``>= 0``).
        mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).

    Attributes:
        best: the best value so far (``inf`` / ``-inf`` before the first).
        bad_checks: checks since the last improvement.

    Example:
        >>> from fasttorch.loop import EarlyStopping
        >>> stop = EarlyStopping(patience=2)
        >>> [stop.update(v) for v in [3.0, 2.0, 2.5, 2.1, 1.0]]
        [False, False, False, True, False]
    """

    def __init__(
        self, patience: int, *, min_delta: float = 0.0, mode: Literal["min", "max"] = "min"
    ) -> None:
        _checks.count("EarlyStopping", "patience", patience)
        _checks.real("EarlyStopping", "min_delta", min_delta, low=0.0)
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}")
        self.patience = patience
        self.min_delta = float(min_delta)
        self.mode = mode
        self.best = math.inf if mode == "min" else -math.inf
        self.bad_checks = 0

    def update(self, value: float | torch.Tensor) -> bool:
        """Record ``value``; ``True`` when ``patience`` checks in a row did not improve."""
        v = float(value)
        better = (
            v < self.best - self.min_delta if self.mode == "min" else v > self.best + self.min_delta
        )
        if better:
            self.best = v
            self.bad_checks = 0
        else:
            self.bad_checks += 1
        return self.bad_checks >= self.patience


class Logger:
    """Hand metrics to sinks every ``k`` steps, reading them to the host only then.

    On the steps in between, the loss is added to a running sum on the device (no
    sync), so the logged ``loss_avg`` is the mean over the ``k`` steps, not a sample.
    Nested dicts become ``outer/inner`` names; tensors with more than one element and
    non-numbers are left out.

    The sinks get the number of steps done, ``i + 1`` for the 0-based index ``i``
    the loop passes (``log(i, metrics)`` after the ``i``-th call): the state's step
    count after that update (``int(state.step)`` when ``i`` counts from it), and the
    number :class:`Progress` shows, so every record of one step says the same number.

    Args:
        k: log every ``k`` steps (``every(k)``).
        sink: called as ``sink(steps_done, {name: float})``; a sequence of them is
            called in order (e.g. ``[TensorBoardWriter(dir), CSVWriter(path)]``);
            default prints a line.

    Example:
        >>> import torch
        >>> from fasttorch.loop import Logger
        >>> log = Logger(2, sink=lambda done, m: print(done, m))
        >>> for i in range(4):
        ...     _ = log(i, {"loss": torch.tensor(float(i)), "aux": {"acc": torch.tensor(0.5)}})
        2 {'loss': 1.0, 'aux/acc': 0.5, 'loss_avg': 0.5}
        4 {'loss': 3.0, 'aux/acc': 0.5, 'loss_avg': 2.5}
    """

    def __init__(self, k: int, *, sink: Sink | Sequence[Sink] | None = None):
        self.due = every(k)
        if sink is None:
            sink = _print_line
        self.sinks: tuple[Sink, ...] = tuple(sink) if isinstance(sink, Sequence) else (sink,)
        for s in self.sinks:
            if not callable(s):
                raise TypeError(
                    f"Logger: each sink must be callable as sink(step, metrics), got "
                    f"{type(s).__name__}; pass a function or a writer such as CSVWriter(path)"
                )
        self._sum: torch.Tensor | None = None
        self._n = 0

    def __call__(self, i: int, metrics: Mapping[str, Any]) -> dict[str, float] | None:
        """Record step ``i``'s (0-based) metrics; on a logging step read, send and return them.

        The sinks are called with ``i + 1``, the number of steps done.
        """
        loss = metrics.get("loss")
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
            self._sum = loss if self._sum is None else self._sum + loss
            self._n += 1
        if not self.due(i):
            return None
        out = scalars(metrics)
        if self._sum is not None:
            out["loss_avg"] = float(self._sum) / self._n
        self._sum, self._n = None, 0
        for sink in self.sinks:
            sink(i + 1, out)  # steps done: state.step after the update, as Progress shows
        return out


def _print_line(i: int, m: dict[str, float]) -> None:
    print(f"step {i}: " + " ".join(f"{k}={v:.4g}" for k, v in m.items()), flush=True)


def memory_bytes(device: torch.device | str | None = None) -> int:
    """Peak CUDA memory allocated on a CUDA ``device``, else the process's resident set.

    Example:
        >>> from fasttorch.loop import memory_bytes
        >>> memory_bytes("cpu") > 0
        True
    """
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak, in KiB (bytes on macOS)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


class Progress:
    """A one-line progress display; reads metrics every ``k`` steps only.

    Shows the step (of ``total``), loss, learning rate, precision, fp16 loss scale,
    steps/s since the last display, and memory (:func:`memory_bytes`). On a terminal it
    rewrites one line with ``\\r``; otherwise (a log file, CI) it writes one line per
    display. Call :meth:`close` at the end to finish the line.

    Args:
        total: the planned number of steps, or ``None``.
        k: display every ``k`` steps.
        precision: shown as is (``"bf16"``); default: ``"fp16"`` when the metrics hold
            a ``loss_scale``, else nothing.
        stream: where to write (default ``sys.stdout``).
        clock: the time source, for tests.

    Example:
        >>> import io, torch
        >>> from fasttorch.loop import Progress
        >>> out = io.StringIO()
        >>> bar = Progress(4, k=2, stream=out, precision="bf16")
        >>> for i in range(4):
        ...     bar(i, {"loss": torch.tensor(0.5), "lr": torch.tensor(1e-3)})
        >>> out.getvalue().splitlines()[0].split(" | ")[:4]
        ['step 2/4', 'loss 0.5', 'lr 0.001', 'bf16']
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        k: int = 10,
        precision: str | None = None,
        stream: TextIO | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.total = total
        self.due = every(k)
        self.precision = precision
        self.stream = stream if stream is not None else sys.stdout
        self.clock = clock
        self._last = (clock(), 0)
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._open = False

    def __call__(self, i: int, metrics: Mapping[str, Any]) -> None:
        """Record step ``i`` (0-based); on a display step, read the metrics and show them."""
        if not self.due(i):
            return
        now, done = self.clock(), i + 1
        t0, n0 = self._last
        rate = (done - n0) / (now - t0) if now > t0 else math.inf
        self._last = (now, done)
        self.write(self.line(done, metrics, rate))

    def line(self, done: int, metrics: Mapping[str, Any], rate: float) -> str:
        """The text shown after ``done`` steps."""
        parts = [f"step {done}" + (f"/{self.total}" if self.total else "")]
        for key, label in (("loss", "loss"), ("lr", "lr")):
            if key in metrics:
                parts.append(f"{label} {float(metrics[key]):.4g}")
        precision = self.precision or ("fp16" if "loss_scale" in metrics else None)
        if precision:
            parts.append(precision)
        if "loss_scale" in metrics:
            parts.append(f"scale {float(metrics['loss_scale']):.4g}")
        parts.append(f"{rate:.3g} steps/s")
        device = None
        loss = metrics.get("loss")
        if isinstance(loss, torch.Tensor):
            device = loss.device
        parts.append(f"mem {memory_bytes(device) / 2**30:.2f} GiB")
        return " | ".join(parts)

    def write(self, text: str) -> None:
        """Show ``text``: rewrite the line on a terminal, else append a line."""
        if self._tty:
            self.stream.write("\r\x1b[K" + text)
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the terminal line (nothing to do when writing lines)."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
