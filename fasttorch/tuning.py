"""Device tuning: the global PyTorch switches that matter for speed, set explicitly.

Nothing here runs at import. :func:`tune_device` sets the switches when called and
gives back an undo, usable as a context manager.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Literal

import torch

from fasttorch import _checks, _compat

__all__ = ["DeviceTuning", "tune_device"]

MatmulPrecision = Literal["highest", "high", "medium"]


class DeviceTuning:
    """What :func:`tune_device` changed, and how to put it back.

    Call it (or leave its ``with`` block) to restore every setting it changed.
    Undoing twice is harmless.

    Attributes:
        previous: the values the settings had before, by setting name.
    """

    def __init__(self, previous: dict[str, Any]) -> None:
        self.previous = previous
        self._undone = False

    def undo(self) -> None:
        """Restore the settings to their values before :func:`tune_device`."""
        if self._undone:
            return
        self._undone = True
        p = self.previous
        if "matmul_precision" in p:
            torch.set_float32_matmul_precision(p["matmul_precision"])
        if "cudnn_benchmark" in p:
            torch.backends.cudnn.benchmark = p["cudnn_benchmark"]
        if "anomaly_detection" in p:
            enabled, check_nan = p["anomaly_detection"]
            torch.autograd.set_detect_anomaly(enabled, check_nan=check_nan)

    __call__ = undo

    def __enter__(self) -> DeviceTuning:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()


def tune_device(
    *,
    matmul_precision: MatmulPrecision | None = "high",
    cudnn_benchmark: bool | None = True,
    anomaly_detection: bool | None = False,
    autograd_profiler: bool = False,
) -> DeviceTuning:
    """Set the speed-related global switches now; return how to undo them.

    * ``matmul_precision``: ``torch.set_float32_matmul_precision``. ``"high"`` lets
      float32 matmuls use TF32 (Ampere and newer) or bf16x3; ``"highest"`` is full
      float32, torch's default.
    * ``cudnn_benchmark``: ``torch.backends.cudnn.benchmark``: cuDNN times its
      convolution algorithms for each new input shape and keeps the fastest (good with
      fixed shapes, costly when they vary).
    * ``anomaly_detection``: ``torch.autograd.set_detect_anomaly``; on, it records a
      stack per op and checks every backward output for NaN, several times slower.
    * ``autograd_profiler``: ``False`` checks that no ``torch.profiler.profile`` /
      ``torch.autograd.profiler.emit_nvtx`` is recording, and raises if one is (one
      cannot be closed safely by someone else); ``True`` allows it.

    ``None`` leaves a setting as it is. Nothing is set at import; this call is the only
    thing that changes them, and only those it reports in ``previous``.

    Equivalent to::

        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = True
        torch.autograd.set_detect_anomaly(False)

    Args:
        matmul_precision, cudnn_benchmark, anomaly_detection, autograd_profiler: as
            above.

    Returns:
        A :class:`DeviceTuning`: call it, or use it in ``with``, to restore.

    Example:
        >>> import torch, fasttorch
        >>> before = torch.get_float32_matmul_precision()
        >>> with fasttorch.tune_device(matmul_precision="high"):
        ...     torch.get_float32_matmul_precision()
        'high'
        >>> torch.get_float32_matmul_precision() == before
        True
    """
    if matmul_precision not in (None, "highest", "high", "medium"):
        raise ValueError(
            "tune_device: matmul_precision must be 'highest', 'high', 'medium' or None, "
            f"got {matmul_precision!r}"
        )
    for name, value in (
        ("cudnn_benchmark", cudnn_benchmark),
        ("anomaly_detection", anomaly_detection),
    ):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"tune_device: {name} must be True, False or None, got {value!r}")
    _checks.flag("tune_device", "autograd_profiler", autograd_profiler)
    if not autograd_profiler and _compat.autograd_profiler_enabled():
        raise RuntimeError(
            "tune_device: an autograd profiler (torch.profiler.profile or "
            "torch.autograd.profiler.emit_nvtx) is recording and slows every op down. "
            "Leave its block first, or pass autograd_profiler=True to keep it on purpose"
        )
    previous: dict[str, Any] = {}
    if matmul_precision is not None:
        previous["matmul_precision"] = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(matmul_precision)
    if cudnn_benchmark is not None:
        previous["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = cudnn_benchmark
    if anomaly_detection is not None:
        previous["anomaly_detection"] = (
            torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled(),
        )
        torch.autograd.set_detect_anomaly(anomaly_detection)
    return DeviceTuning(previous)
