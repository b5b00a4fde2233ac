"""Every use of a private torch API in fasttorch, in one place.

A torch upgrade should touch this file only. Each entry is feature-detected where there
is a feature to detect (the one release check says why there is none), says why
fasttorch needs it, and names the upstream code or issue it depends on. Nothing else in
the package imports ``torch._dynamo``, ``torch._inductor`` or ``torch._C``, or calls a
private ATen op.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pickle
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CPU_ATTENTION",
    "CPU_ATTENTION_BACKWARD",
    "CombinedGraphPass",
    "CustomGraphPass",
    "DcpMetadataUnpickler",
    "assert_async",
    "autograd_profiler_enabled",
    "cpp_compile_error",
    "cpu_has_amx_fp16",
    "cpu_has_bf16_units",
    "cpu_isa_probe",
    "dynamo_counters",
    "dynamo_reset",
    "fsdp_keeps_params_after_forward",
    "graph_pass_hash",
    "inductor_has_option",
    "inductor_mode_options",
    "is_optimized_module",
    "tracing_autograd_ops",
]

# --------------------------------------------------------------------------- dynamo


def tracing_autograd_ops() -> contextlib.AbstractContextManager[Any]:
    """Let dynamo trace ``torch.autograd.grad`` inside a compiled step.

    Why: the whole step (forward, backward, update) is one graph only if dynamo traces
    the backward call; ``torch._dynamo.config.trace_autograd_ops`` turns that on where
    it exists (``torch/_dynamo/config.py``, added in 2.11; without it dynamo reports
    "torch.autograd.grad with trace_autograd_ops=False"). Where the option is missing
    this is a no-op, and tracing the backward fails as that release fails.
    """
    config = torch._dynamo.config
    if hasattr(config, "trace_autograd_ops"):
        return config.patch(trace_autograd_ops=True)  # type: ignore[no-any-return]
    return contextlib.nullcontext()


def dynamo_reset() -> None:
    """``torch._dynamo.reset()``: forget compiled graphs, so a test counts from zero."""
    torch._dynamo.reset()


def dynamo_counters() -> Any:
    """``torch._dynamo.utils.counters``: graph breaks and recompiles, for the contract checks."""
    return torch._dynamo.utils.counters


def is_optimized_module(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile(module)``'s wrapper (its keys gain ``_orig_mod.``).

    Upstream: ``torch._dynamo.eval_frame.OptimizedModule`` has no public alias.
    """
    optimized = getattr(getattr(torch._dynamo, "eval_frame", None), "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)


# --------------------------------------------------------------------------- inductor


def inductor_has_option(name: str) -> bool:
    """Whether this torch's inductor knows the config option ``name``.

    Why: options come and go between releases (``cpp_wrapper_build_separate`` appeared
    in 2.8); passing an unknown one to ``torch.compile`` is an error.
    """
    from torch._inductor import config

    return hasattr(config, name)


def inductor_mode_options(mode: str, dynamic: bool | None) -> dict[str, Any]:
    """The inductor options a ``torch.compile`` mode stands for.

    Why: ``torch.compile`` takes ``mode`` or ``options``, not both; to add an option to a
    mode, fasttorch expands the mode as ``torch.compile`` itself does
    (``torch._inductor.list_mode_options``).
    """
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))


def cpp_compile_error(err: BaseException) -> BaseException | None:
    """The C++ compiler's error in ``err``'s chain of causes, if there is one.

    Why: ``compiled`` retries a two-file C++ build that it chose as one file when the
    compiler fails; inductor raises ``torch._inductor.exc.CppCompileError`` for that.
    """
    try:
        from torch._inductor.exc import CppCompileError
    except ImportError:  # renamed upstream: no retry, the error goes to the caller
        return None
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, CppCompileError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def cpu_isa_probe() -> Callable[[], Any] | None:
    """Inductor's probe of the C++ compiler's vector instruction sets, if it has one.

    Why: ``compiled`` starts it in a thread while dynamo traces, so a cold CPU compile
    does not wait 7-16 s for it (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``,
    cached by inductor for the process).
    """
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return None
    probe = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    return probe if callable(probe) else None


try:  # the base class inductor requires of a custom graph pass, for its cache key
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
except ImportError:  # pragma: no cover - every supported release has it

    class CustomGraphPass:  # type: ignore[no-redef]
        """Stand-in where inductor has no custom graph passes: never used as one."""

        def uuid(self) -> Any:
            return None

    def get_hash_for_files(paths: tuple[str, ...], extra: str = "") -> bytes:  # type: ignore[misc]
        return repr((paths, extra)).encode()


def graph_pass_hash(paths: tuple[str, ...], extra: str) -> Any:
    """A cache key for a graph pass defined in ``paths`` with settings ``extra``."""
    return get_hash_for_files(paths, extra)


class CombinedGraphPass(CustomGraphPass):  # type: ignore[misc]
    """Several graph passes as one, run in order.

    Why: inductor releases up to 2.12 call ``post_grad_custom_pre_pass`` directly, so a
    list there fails with "'list' object is not callable"; one pass object works on
    every release (``torch/_inductor/fx_passes/post_grad.py``).
    """

    def __init__(self, passes: list[Any]) -> None:
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        """One key from the parts' keys; ``None`` (never cache) if any part has none."""
        parts = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        return None if any(u is None for u in parts) else repr(parts)


def _release() -> tuple[int, ...]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


# Whether dynamo traces the eager gradient path (detached leaves with requires_grad_(),
# then torch.autograd.grad) inside a graph. A release check: the only test is to compile
# one, which cannot happen while the step itself is being traced. 2.11's dynamo refuses
# Tensor.requires_grad_() (graph break gb0125) and 2.10's refuses torch.autograd.grad;
# 2.12 and later trace both. Read as a constant by the gradient phase.
AUTOGRAD_GRAD_IN_GRAPH = _release() >= (2, 12)


def cpu_gemm_pass_works() -> bool:
    """Whether this inductor builds ``compiled``'s float32 CPU matrix-product pass right.

    Why a release check: there is no feature to detect. Inductor 2.10's C++ codegen
    fails on the pass with ``emulate_precision_casts`` (``CppVecOverrides.to_dtype()``
    lacks ``use_compute_types``); 2.11 and 2.12 build it but their compiled step
    differs from the hand-written loop by ~2e-2 (2.6e-4 on 2.15), a rounding
    difference whose cause was not found. 2.13 is the first release tested good.
    """
    return _release() >= (2, 13)


# --------------------------------------------------------------------------- ATen


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


# --------------------------------------------------------------------------- DCP

_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_MD, n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name
    ("collections", "OrderedDict"),
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "WindowsPath")),
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PurePosixPath", "PureWindowsPath")),
}


class DcpMetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata only: every other global a pickle names is refused, so a
    crafted file cannot call a function (a pickle runs code only through globals).

    Why: torch reads DCP's ``.metadata`` with a plain ``pickle.load``
    (``FileSystemReader.read_metadata``; pytorch/pytorch#189308, open), and those
    records include private classes (``_StorageInfo``, ``_MEM_FORMAT_ENCODING``,
    ``torch.serialization._get_layout``), named here and nowhere else.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"it names {module}.{name}")


# --------------------------------------------------------------------------- FSDP2


def fsdp_keeps_params_after_forward(module: Any) -> bool | None:
    """Whether FSDP2 keeps ``module``'s own parameters unsharded from forward to backward.

    Why: a sharded window keeps a unit's parameters gathered from one microbatch to the
    next (``set_reshard_after_backward(False)``, public) only where that costs no memory
    the user did not already give: where the unit was sharded with
    ``reshard_after_forward=False``, or is the root, which FSDP2 never reshards after
    forward. FSDP2 has no public getter for it: ``fully_shard`` keeps it as the
    parameter groups' ``post_forward_mesh_info`` (``None``: kept), on the module's
    ``FSDPState`` (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``,
    ``_reshard_after_forward``; the root's is cleared in ``_fsdp_state.py``
    ``_lazy_init``). ``_fsdp_param_groups`` is a list from 2.12 (per-parameter
    meshes), one ``_fsdp_param_group`` before. ``None`` where none of this is found:
    the caller then reshards, as FSDP2 does by default.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    try:
        state = get_state()
    except AssertionError:  # not initialized by fully_shard
        return None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    if not groups or not all(hasattr(g, "post_forward_mesh_info") for g in groups):
        return None
    return all(g.post_forward_mesh_info is None for g in groups)


# ----------------------------------------------------------------- fused optimizer kernels


_FUSED_KERNELS = {"adam": "_fused_adam_", "adamw": "_fused_adamw_", "sgd": "_fused_sgd_"}


def fused_optimizer_kernel(name: str) -> Callable[..., Any] | None:
    """torch's fused multi-tensor kernel of optimizer ``name`` ("adam", "adamw", "sgd").

    Why: a donated eager step on a GPU should launch what ``torch.optim.AdamW(fused=True)``
    launches, one kernel per dtype for the whole update, instead of a ``_foreach_*``
    launch per operation. The kernels are private ATen ops (``torch._fused_adamw_``,
    called by ``torch/optim/adam.py`` ``_fused_adam``), with a ``tensor_lr`` overload
    (the learning rate read on the device, no host sync) and ``grad_scale`` /
    ``found_inf`` (``GradScaler``'s unscale and skip inside the kernel). ``None`` where
    this torch has no such op or overload.
    """
    packet = getattr(torch.ops.aten, _FUSED_KERNELS[name], None)
    if packet is None or "tensor_lr" not in packet.overloads():
        return None
    return packet.tensor_lr  # type: ignore[no-any-return]


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
