"""Saving in a background thread from a copy in CPU memory: :func:`async_save` and
its :class:`SaveHandle`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fasttorch.checkpoint._directory import _check_keep, _unlock
from fasttorch.checkpoint._errors import CheckpointError, refuse_models
from fasttorch.checkpoint._group import _async_group
from fasttorch.checkpoint._save import _check_metric, _plan, _write
from fasttorch.distributed.fsdp import as_dtensor
from fasttorch.state import TrainState


class SaveHandle:
    """A background save started by :func:`async_save`; ``wait()`` for it to complete."""

    def __init__(self, path: Path, thread: threading.Thread | None) -> None:
        self.path = path
        self._thread = thread
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the save has finished (successfully or not); never blocks."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is complete and visible; return its path.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: the save failed.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"async save of {str(self.path)!r} still running")
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(
                f"async save of {str(self.path)!r} failed: {self._error!r}"
            ) from self._error
        return self.path

    def __repr__(self) -> str:
        return f"SaveHandle({str(self.path)!r}, done={self.done()})"


_pending: list[SaveHandle] = []


def _stage(t: Any) -> Any:
    if isinstance(t, DTensor):
        if t.device.type == "cpu":
            return as_dtensor(t.to_local().clone(), t)
        return t.to("cpu")  # a DTensor whose shard is in host memory, laid out as t
    if not isinstance(t, torch.Tensor):
        return t
    if t.device.type == "cpu":
        return t.detach().clone()
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    buf.copy_(t.detach(), non_blocking=True)
    return buf


def async_save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    data: Any = None,
    name: str | None = None,
    keep_last: int | None = None,
    metric: float | torch.Tensor | None = None,
    keep_best: int | None = None,
    mode: str = "min",
) -> SaveHandle:
    """Like :func:`save`, but write in a background thread; return at once.

    The state is first copied to CPU memory (pinned for a GPU state), which is the only
    part the caller waits for: the following steps may update the state in place
    while the copy is written. The checkpoint becomes visible, atomically, when the
    write completes; ``handle.wait()`` blocks until then and raises if it failed.
    A new ``async_save`` first waits for the previous one. In a distributed job the
    background writes use a gloo process group of their own.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> handle = fasttorch.checkpoint.async_save(tempfile.mkdtemp(), state)
        >>> handle.wait().name
        'step_000000000'
    """
    api = "checkpoint.async_save"
    refuse_models(
        state,
        api,
        "save it with checkpoint.save(directory, state) (one checkpoint per member), or "
        "async_save each member: async_save(Path(directory) / name, state[name])",
    )
    wait_pending()
    pg = _async_group()
    keep = _check_keep(api, keep_last, keep_best, mode, saving=True)
    plan = _plan(directory, state, data, name, keep, _check_metric(api, metric), pg, api)
    try:
        plan.tensors = {k: _stage(v) for k, v in plan.tensors.items()}
        if torch.cuda.is_available() and state.device.type == "cuda":
            torch.cuda.synchronize(state.device)
    except BaseException:
        _unlock(plan.lock)
        raise
    handle = SaveHandle(plan.final, None)

    def work() -> None:
        try:
            _write(plan, pg)
        except BaseException as e:
            handle._error = e

    thread = threading.Thread(target=work, name=f"fasttorch-save-{plan.final.name}")
    handle._thread = thread
    _pending.append(handle)
    thread.start()
    return handle


def wait_pending() -> None:
    """Wait for every background save of this process (errors are left to the handles)."""
    while _pending:
        h = _pending.pop(0)
        if h._thread is not None:
            h._thread.join()
