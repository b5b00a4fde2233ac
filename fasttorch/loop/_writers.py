"""The metric sinks of :class:`fasttorch.loop.Logger`: TensorBoard, CSV and JSON lines.

Each is a callable ``sink(step, {name: float})`` that writes one record per call, and a
context manager that closes its file. They are importable from :mod:`fasttorch.loop`,
where the logger that feeds them lives.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from fasttorch import _checks

__all__ = ["CSVWriter", "JSONLWriter", "TensorBoardWriter", "scalars"]


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of ``metrics`` as floats, nested dicts as ``outer/inner`` names.

    Tensors of one element and ints and floats (not bools) are kept; the rest is left out.
    """
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, Mapping):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif (isinstance(v, torch.Tensor) and v.numel() == 1) or _checks.is_real(v):
            out[prefix + k] = float(v)
    return out


class TensorBoardWriter:
    """A :class:`Logger` sink that writes scalars to TensorBoard event files in ``log_dir``.

    Each call adds one scalar per metric (``SummaryWriter.add_scalar(name, value,
    step)``); open the curves with ``tensorboard --logdir DIR``. It writes the floats
    it is given: under a :class:`Logger` they were read on logging steps only. Tensors
    passed directly are read here (a host sync), so call it only when you log. Needs
    the ``tensorboard`` package (``pip install fasttorch[tensorboard]``).

    Args:
        log_dir: the run's directory (created if missing).
        prefix: put before every name, e.g. ``"train/"``.
        flush_secs: how often the event file is flushed to disk.

    Example:
        >>> import tempfile, torch
        >>> from fasttorch.loop import Logger, TensorBoardWriter
        >>> with TensorBoardWriter(tempfile.mkdtemp()) as tb:
        ...     log = Logger(2, sink=tb)
        ...     for i in range(4):
        ...         _ = log(i, {"loss": torch.tensor(1.0 / (i + 1))})
    """

    def __init__(
        self, log_dir: str | os.PathLike[str], *, prefix: str = "", flush_secs: int = 30
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch imports tensorboard lazily, here
            raise ImportError(
                "TensorBoardWriter needs the tensorboard package, which is not installed "
                f"({e}); install it with: pip install 'fasttorch[tensorboard]' "
                "(or use CSVWriter / JSONLWriter, which need nothing)"
            ) from e
        self.log_dir = Path(log_dir)
        self.prefix = prefix
        self.writer = SummaryWriter(str(self.log_dir), flush_secs=flush_secs)

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write each metric at ``step``."""
        for name, value in scalars(metrics).items():
            self.writer.add_scalar(self.prefix + name, value, step)

    def flush(self) -> None:
        """Write what is buffered to disk now."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CSVWriter:
    """A :class:`Logger` sink that appends one CSV row per call: ``step`` then the metrics.

    The columns are ``columns`` if given, else the first call's metric names; a later
    metric outside them raises (give ``columns=`` up front, or use :class:`JSONLWriter`,
    whose rows may differ). A metric missing from a row is left empty. An existing file
    is appended to without a second header, so a resumed run continues it. Each row is
    flushed.

    Args:
        path: the ``.csv`` file (its directory is created if missing).
        columns: the metric names, in order (``None``: the first row's).

    Example:
        >>> import os, tempfile, torch
        >>> from fasttorch.loop import CSVWriter, Logger
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.csv")
        >>> with CSVWriter(path) as out:
        ...     log = Logger(2, sink=out)
        ...     for i in range(4):
        ...         _ = log(i, {"loss": torch.tensor(float(i))})
        >>> print(open(path).read().strip())
        step,loss,loss_avg
        2,1.0,0.5
        4,3.0,2.5
    """

    def __init__(self, path: str | os.PathLike[str], *, columns: Sequence[str] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns: list[str] | None = list(columns) if columns is not None else None
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open(newline="") as f:
                header = next(csv.reader(f), None)
            if header and header[0] == "step":
                if self.columns is not None and header[1:] != self.columns:
                    raise ValueError(
                        f"CSVWriter: {self.path} has columns {header[1:]}, not the columns= "
                        f"given {self.columns}; write to a new file or give the same columns"
                    )
                self.columns = header[1:]
        self._file: TextIO = self.path.open("a", newline="")
        self._csv = csv.writer(self._file)
        self._wrote_header = self.columns is not None and self._file.tell() > 0

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append the row for ``step``."""
        values = scalars(metrics)
        if self.columns is None:
            self.columns = list(values)
        extra = [k for k in values if k not in self.columns]
        if extra:
            raise ValueError(
                f"CSVWriter: metrics {extra} are not among the file's columns {self.columns} "
                f"({self.path}); give CSVWriter(path, columns=[...]) with every name, or "
                "use JSONLWriter, whose rows may differ"
            )
        if not self._wrote_header:
            self._csv.writerow(["step", *self.columns])
            self._wrote_header = True
        self._csv.writerow([step, *(repr(values[k]) if k in values else "" for k in self.columns)])
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> CSVWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JSONLWriter:
    """A :class:`Logger` sink that appends one JSON object per call: ``{"step": i, ...}``.

    Rows may carry different metrics (training every ``k`` steps, evaluation every
    ``m``). Non-finite values are written as ``NaN`` / ``Infinity``, which Python's
    ``json`` reads back. Appends to an existing file; each line is flushed.

    Args:
        path: the ``.jsonl`` file (its directory is created if missing).

    Example:
        >>> import json, os, tempfile
        >>> from fasttorch.loop import JSONLWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> with JSONLWriter(path) as out:
        ...     out(10, {"loss": 2.5})
        ...     out(20, {"loss": 2.0, "eval": {"loss": 2.25}})
        >>> [json.loads(line) for line in open(path)]
        [{'step': 10, 'loss': 2.5}, {'step': 20, 'loss': 2.0, 'eval/loss': 2.25}]
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a")

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append the line for ``step``."""
        self._file.write(json.dumps({"step": step, **scalars(metrics)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> JSONLWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
