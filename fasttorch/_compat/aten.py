"""Private ATen ops and CPU queries: CPU attention's kernels, the async assert, the CPU's
matrix units, the profiler's state, and the fused optimizer and loss-scale kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CPU_ATTENTION",
    "CPU_ATTENTION_BACKWARD",
    "amp_update_scale",
    "assert_async",
    "autograd_profiler_enabled",
    "cpu_has_amx_fp16",
    "cpu_has_bf16_units",
    "fused_optimizer_kernel",
    "tensor_version",
]


def _op(name: str) -> Any:
    return getattr(torch.ops.aten, name).default


# CPU attention's own kernels, forward and backward, which the same pass runs in float32.
CPU_ATTENTION = _op("_scaled_dot_product_flash_attention_for_cpu")
CPU_ATTENTION_BACKWARD = _op("_scaled_dot_product_flash_attention_for_cpu_backward")


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Raise where ``condition`` (a bool tensor) is false, without a Python branch on it.

    Why: the reducer checks that ranks agree without a host read inside the step;
    ``torch._assert_async`` raises on CPU at once (it is a device assert on CUDA).
    """
    torch._assert_async(condition, message)


@functools.cache
def cpu_has_bf16_units() -> bool:
    """Whether this CPU has AVX512-BF16 or AMX tiles (bf16 matrix products in hardware).

    Why: ``with_amp("auto")`` and ``compiled``'s CPU matrix-product pass choose by it;
    torch exposes the check only as ``torch.cpu._is_avx512_bf16_supported`` /
    ``_is_amx_tile_supported``. Where neither exists the answer is "no".
    """
    cpu = torch.cpu
    checks = [
        getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    return any(bool(c()) for c in checks if callable(c))


@functools.cache
def cpu_has_amx_fp16() -> bool:
    """Whether this CPU has AMX-FP16 (``torch.cpu._is_amx_fp16_supported``), else ``False``."""
    check = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    return bool(check()) if callable(check) else False


def autograd_profiler_enabled() -> bool:
    """Whether the autograd profiler is running (``torch._C._autograd._profiler_enabled``).

    Why: ``tune_device`` refuses to time kernels under a profiler, whose overhead would
    decide the choice; torch has no public query.
    """
    check = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    return bool(check()) if callable(check) else False


_FUSED_KERNELS = {"adam": "_fused_adam_", "adamw": "_fused_adamw_", "sgd": "_fused_sgd_"}


def _find_fused_kernel(name: str) -> Callable[..., Any] | None:
    packet = getattr(torch.ops.aten, _FUSED_KERNELS[name], None)
    if packet is None or "tensor_lr" not in packet.overloads():
        return None
    return packet.tensor_lr  # type: ignore[no-any-return]


# Looked up once: dynamo cannot trace ``OpOverloadPacket.overloads``, and an opaque
# optimizer asks, while its compiled step is traced, whether the kernel exists.
_FUSED_FOUND = {name: _find_fused_kernel(name) for name in _FUSED_KERNELS}


def fused_optimizer_kernel(name: str) -> Callable[..., Any] | None:
    """torch's fused multi-tensor kernel of optimizer ``name`` ("adam", "adamw", "sgd").

    Why: a donated eager step on a GPU should launch what ``torch.optim.AdamW(fused=True)``
    launches, one kernel per dtype for the whole update, instead of a ``_foreach_*``
    launch per operation; an opaque optimizer's step on a CPU (``adam(...,
    opaque=True)``) runs torch's fused CPU kernel, one pass per tensor. The kernels are
    private ATen ops (``torch._fused_adamw_``, called by ``torch/optim/adam.py``
    ``_fused_adam``), with a ``tensor_lr`` overload (the learning rate read on the
    device, no host sync) and ``grad_scale`` / ``found_inf`` (``GradScaler``'s unscale
    and skip inside the kernel). ``None`` where this torch has no such op or overload.
    """
    return _FUSED_FOUND[name]


def tensor_version(t: torch.Tensor) -> int:
    """The version counter of ``t``: it changes on every in-place write.

    Why: the fused kernels take beta1, beta2, eps, weight_decay as host floats while
    fasttorch keeps them as device tensors; a host copy of each is valid while the
    tensor's version is the one it was read at (``Tensor._version``, the counter
    autograd uses to detect in-place changes; no public equivalent).
    """
    return int(t._version)


def amp_update_scale() -> Callable[..., Any] | None:
    """``torch._amp_update_scale_``: GradScaler's scale and growth-tracker update, in place.

    Why: fasttorch's loss scale follows GradScaler's rule; in a donated eager step one
    launch of GradScaler's own kernel (``torch/amp/grad_scaler.py`` ``update``) replaces
    about twenty 0-d operations. ``None`` where this torch lacks it.
    """
    return getattr(torch, "_amp_update_scale_", None)
