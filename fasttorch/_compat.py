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
import os
import pickle
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CPU_ATTENTION",
    "CPU_ATTENTION_BACKWARD",
    "CombinedGraphPass",
    "CudagraphVerdict",
    "CustomGraphPass",
    "DcpMetadataUnpickler",
    "assert_async",
    "autograd_profiler_enabled",
    "compile_backends",
    "compile_modes",
    "cpp_compile_error",
    "cpu_has_amx_fp16",
    "cpu_has_bf16_units",
    "cpu_isa_probe",
    "cudagraph_check_backend",
    "cudagraph_skips",
    "dynamo_counters",
    "dynamo_reset",
    "fsdp_keeps_params_after_forward",
    "graph_pass_hash",
    "in_functorch_transform",
    "inductor_has_option",
    "inductor_mode_options",
    "is_optimized_module",
    "is_static_address",
    "mark_static_addresses",
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


class CustomGraphPass:
    """The base of fasttorch's inductor graph passes: an inductor ``CustomGraphPass``.

    Why not inductor's class itself: importing it loads inductor (seconds), and every
    ``import fasttorch`` would pay for it. Inductor only asks ``isinstance(p,
    CustomGraphPass)`` and calls ``uuid()`` (``torch/_inductor/codecache.py``, for its
    cache key), and its class is an ABC on every supported release
    (``torch/_inductor/custom_graph_pass.py``): each subclass here is registered as a
    virtual subclass of it when its first instance is made, which is before inductor
    sees one.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        _register_graph_pass(cls)
        return super().__new__(cls)

    def uuid(self) -> Any:
        """The pass's cache key; ``None``: never cache the graphs it ran on."""
        return None


_REGISTERED: set[type] = set()


def _register_graph_pass(cls: type) -> None:
    if cls in _REGISTERED:
        return
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass as Inductors
    except ImportError:  # pragma: no cover - every supported release has it
        return
    Inductors.register(cls)
    _REGISTERED.add(cls)


def graph_pass_hash(paths: tuple[str, ...], extra: str) -> Any:
    """A cache key for a graph pass defined in ``paths`` with settings ``extra``."""
    try:
        from torch._inductor.custom_graph_pass import get_hash_for_files
    except ImportError:  # pragma: no cover - every supported release has it
        return repr((paths, extra)).encode()
    return get_hash_for_files(paths, extra)


class CombinedGraphPass(CustomGraphPass):
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


# --------------------------------------------------------------------------- argument checks
# (what ``compiled`` checks its arguments against at wrap time, and attrs' repr)


def compile_modes() -> tuple[str, ...]:
    """The ``mode`` names ``torch.compile`` accepts on this torch release.

    Why: a typo in ``compiled(mode=...)`` is otherwise found by inductor at the step's
    first call, after the state was donated. ``torch._inductor.list_mode_options()``
    (``torch/_inductor/__init__.py``) is the table ``torch.compile`` reads the mode
    from; ``"default"`` is in it. Imported here, on first use, so that importing
    fasttorch does not load inductor.
    """
    from torch._inductor import list_mode_options

    return tuple(list_mode_options())


def compile_backends() -> tuple[str, ...]:
    """The backend names ``torch.compile`` knows now (registered ones included).

    Why: as :func:`compile_modes`, for ``backend=``; ``torch._dynamo.list_backends``
    (``torch/_dynamo/backends/registry.py``), with no tag excluded so that the debug
    backends (``"aot_eager"``) count as valid.
    """
    import torch._dynamo

    return tuple(torch._dynamo.list_backends(exclude_tags=()))


repr_context = threading.local()
"""Read by the ``__repr__`` that attrs generates for a class of a module importing this one.

Why (attrs, not torch): attrs compiles a class's generated methods in one namespace
that it fills with the class's module's globals (``attr/_make.py``, ``_make_init_script``
and ``_ClassBuilder``'s merged snippets); its ``__repr__`` then looks up
``_compat.repr_context`` (attrs' own module, for recursive reprs), but in a module with
``from fasttorch import _compat`` it finds this module instead, and ``repr()`` of an
fp16 ``with_amp`` step or a ``compiled`` step raised ``AttributeError``. The same
thread-local here keeps those reprs working whatever order attrs merges in.
"""
# --------------------------------------------------------------------------- CUDA graphs
#
# What fasttorch does so that ``mode="reduce-overhead"`` captures a donated step, and
# the check that proves it on any device (``fasttorch.testing.check_cudagraphs``).


def mark_static_addresses(tensors: list[torch.Tensor]) -> None:
    """Tell dynamo that these tensors keep their address from call to call, unguarded.

    Why: a donated step writes its results into the input state's own tensors, so the
    state's leaves are the same objects at the same addresses on every call; inductor's
    CUDA graphs refuse a graph that writes into an input unless the input is static
    ("skipping cudagraphs due to mutated inputs"), and only parameters of a module, or
    tensors marked with ``torch._dynamo.mark_static_address``, are static. ``guard=False``:
    no guard on the address (no recompile); a changed address makes the CUDA graph
    re-record instead (``torch/_dynamo/decorators.py``; inductor's
    ``cudagraph_utils.check_for_mutation``). Tensors already marked are left alone, so
    a call after the first costs one attribute read per leaf. Where dynamo has no such
    function this does nothing, and CUDA graphs skip the step as before.
    """
    mark = getattr(torch._dynamo, "mark_static_address", None)
    if mark is None:
        return
    for t in tensors:
        if getattr(t, "_dynamo_static_input_type", None) is None:
            mark(t, guard=False)


def is_static_address(t: torch.Tensor) -> bool:
    """Whether ``t`` was marked by :func:`mark_static_addresses` (or by the user)."""
    return getattr(t, "_dynamo_static_input_type", None) is not None


def cudagraph_skips() -> int:
    """How many graphs inductor compiled without CUDA graphs so far in this process.

    Why: the count behind inductor's "skipping cudagraphs due to ..." log line,
    ``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]``; torch has no
    public counter. The GPU tests assert it stays 0 under ``mode="reduce-overhead"``.
    """
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


class CudagraphVerdict:
    """What inductor's CUDA-graph checks say about one graph (filled by the backend below)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "forward", "backward" or "inference"
        self.inputs = 0
        self.static_inputs = 0
        self.mutated_inputs = 0  # mutated and neither static nor a CUDA-graph output
        self.dynamic = False
        self.reasons: list[str] = []
        self.calls = 0
        self.moved_static = 0  # calls in which a static input had a new address
        self.static_idxs: list[int] = []


def _mutated_input_idxs(gm: torch.fx.GraphModule) -> list[int]:
    """Indices of the graph inputs an op writes to (``copy_`` of a kept input mutation)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    out: set[int] = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for arg, value in zip(schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for v in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(v, torch.fx.Node) and v in index:
                        out.add(index[v])
    return sorted(out)


def _device_reason(gm: torch.fx.GraphModule, assume_cuda: str) -> str | None:
    """Inductor's device rule, with tensors on ``assume_cuda``'s type taken for CUDA ones."""
    from torch._inductor import cudagraph_utils

    mapping: dict[torch.device, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            dev = val.device
            if dev.type == assume_cuda:
                dev = torch.device("cuda", 0)
            mapping.setdefault(dev, node)
    if not mapping:
        return None
    return cudagraph_utils.check_multiple_devices_or_any_cpu_nodes(mapping)  # type: ignore[no-any-return]


def _judge(
    gm: torch.fx.GraphModule, example_inputs: list[Any], kind: str, assume_cuda: str
) -> CudagraphVerdict:
    """Run inductor's own CUDA-graph predicates on an AOTAutograd graph.

    Upstream: ``torch/_inductor/compile_fx.py`` (dynamic shapes, incompatible ops,
    devices: ``check_lowering_disable_cudagraph``), ``output_code.py``
    (``CompiledFxGraph.__init__``: input storage mutation, mutated inputs, non-Tensor
    inputs) and ``cudagraph_utils.check_for_mutation`` (the check cudagraph trees run
    when ``cudagraph_support_input_mutation`` is on, the default outside fbcode).
    """
    from torch._inductor import config, cudagraph_utils
    from torch._inductor import utils as inductor_utils

    v = CudagraphVerdict(kind)
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    static = list(getattr(meta, "static_input_indices", None) or []) if kind != "backward" else []
    v.inputs = len(example_inputs)
    v.static_inputs = len(static)
    v.static_idxs = static
    mutated = _mutated_input_idxs(gm)
    placeholders = cudagraph_utils.get_placeholder_info(gm.graph)
    func = types.SimpleNamespace(
        mutated_input_idxs=mutated, static_input_idxs=static, placeholders=placeholders
    )
    # On a CPU no tensor is a CUDA graph's output; on a GPU, outputs of an earlier graph
    # of the same call (a microbatch's loss read by the window's update) would be.
    if config.triton.cudagraph_support_input_mutation:
        reason = cudagraph_utils.check_for_mutation(func, example_inputs, lambda t: False)  # type: ignore[arg-type]
    else:
        names = {p.name for i, p in enumerate(placeholders) if i in mutated}
        reason = cudagraph_utils.check_for_mutation_ignore_cuda_graph_managed_tensor(
            gm,
            names,  # type: ignore[arg-type]
            mutated,  # type: ignore[arg-type]
            static,
        )
    v.mutated_inputs = len([i for i in mutated if i not in set(static)])
    v.dynamic = bool(inductor_utils.any_is_symbolic(*example_inputs))
    if v.dynamic and config.triton.cudagraph_skip_dynamic_graphs:
        v.reasons.append(
            "graph with symbolic shapes inputs and "
            "config.triton.cudagraph_skip_dynamic_graphs=True."
        )
    incompatible = inductor_utils.get_first_incompatible_cudagraph_node(gm)
    if incompatible is not None:
        v.reasons.append(f"disabling cudagraphs due to incompatible op {incompatible.target}")
    device = _device_reason(gm, assume_cuda)
    if device is not None:
        v.reasons.append(device)
    storage = getattr(cudagraph_utils, "get_input_storage_mutation_info", None)
    if storage is not None:
        why = cudagraph_utils.get_input_storage_mutation_reason(storage(gm))
        if why is not None:
            v.reasons.append(f"skipping cudagraphs due to {why}")
    if reason is not None:
        v.reasons.append(reason)
    allowed = (torch.Tensor, torch.SymInt, torch.Generator)
    if not all(isinstance(t, allowed) for t in example_inputs):
        v.reasons.append("skipping cudagraphs due to non-Tensor inputs")
    return v


def cudagraph_check_backend(
    verdicts: list[CudagraphVerdict], *, assume_cuda: str
) -> Callable[..., Any]:
    """A ``torch.compile`` backend that runs graphs as ``aot_eager`` and judges each one.

    Why: inductor decides whether a graph is captured deep inside its compile, on a GPU
    only; the same predicates, fed with the same AOTAutograd metadata
    (``fw_metadata.static_input_indices``, inputs mutated in the graph with
    ``keep_inference_input_mutations=True``, as inductor compiles), run on any device.
    Each call of a judged graph also checks that its static inputs kept their
    addresses: where one moves, a CUDA graph would re-record.
    """
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            v = _judge(gm, example_inputs, kind, assume_cuda)
            verdicts.append(v)
            static = v.static_idxs
            seen: list[int] | None = None

            def run(args: list[Any]) -> Any:
                nonlocal seen
                ptrs = [args[i].data_ptr() for i in static if isinstance(args[i], torch.Tensor)]
                if seen is not None and ptrs != seen:
                    v.moved_static += 1
                seen = ptrs
                v.calls += 1
                return torch.fx.Interpreter(gm).boxed_run(args)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_graph

    return aot_autograd(  # type: ignore[no-any-return]
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        keep_inference_input_mutations=True,
    )


# --------------------------------------------------------------------------- compile time
# Recompile reports, the recompile budget and warm starts (fasttorch/_recompiles.py,
# fasttorch/compile_cache.py).


def guard_failures(code: Any) -> list[str] | None:
    """The guard-failure reasons dynamo recorded for ``code``, oldest first.

    Why: ``compiled`` reports each recompile of a step's function in plain words, and
    ``torch.compile`` takes no guard-failure callback (``guard_fail_fn`` is an argument
    of the private ``torch._dynamo.optimize`` only). On every recompile dynamo appends
    one reason per existing compiled version, newest first, to
    ``torch._dynamo.utils.guard_failures[code]`` (``torch/_dynamo/guards.py``,
    ``get_guard_fail_reason``), whatever the logging settings. ``None`` where that
    record is gone: recompiles are then not reported (``compiled`` warns once).
    """
    utils = getattr(torch._dynamo, "utils", None)
    record = getattr(utils, "guard_failures", None)
    if not isinstance(record, dict):
        return None
    reasons = record.get(code)  # .get: never add a key to the defaultdict
    return [str(r) for r in reasons] if reasons else []


def recompile_budget(limit: int) -> contextlib.AbstractContextManager[Any]:
    """Dynamo's recompile limit set to ``limit``, and a hard error when it is hit.

    Why: past ``torch._dynamo.config.recompile_limit`` dynamo runs a function eagerly
    without a word unless ``fullgraph=True`` or ``fail_on_recompile_limit_hit`` is set
    (``torch/_dynamo/convert_frame.py``, "Dynamo recompile limit exceeded"); ``compiled``
    turns the hard error into its own :class:`fasttorch.RecompileLimitError`. Options
    missing from a release are left out (``recompile_budget_enforced`` says so).
    """
    config = torch._dynamo.config
    changes: dict[str, Any] = {}
    if hasattr(config, "recompile_limit"):
        changes["recompile_limit"] = limit
    # suppress_errors (the user asked for eager fallbacks) may not be combined with it.
    if hasattr(config, "fail_on_recompile_limit_hit") and not getattr(
        config, "suppress_errors", False
    ):
        changes["fail_on_recompile_limit_hit"] = True
    return config.patch(**changes) if changes else contextlib.nullcontext()  # type: ignore[no-any-return]


def recompile_budget_enforced() -> bool:
    """Whether this dynamo has both options :func:`recompile_budget` sets."""
    config = torch._dynamo.config
    return hasattr(config, "recompile_limit") and hasattr(config, "fail_on_recompile_limit_hit")


def recompile_limit_hit(err: BaseException) -> bool:
    """Whether ``err`` (or a cause) is dynamo's ``FailOnRecompileLimitHit``.

    Why: ``compiled`` re-raises it with the step's recompile history; the class lives in
    ``torch._dynamo.exc`` (matched by name where it moved).
    """
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if type(e).__name__ == "FailOnRecompileLimitHit":
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def use_inductor_cache_dir(path: str) -> None:
    """Point inductor's on-disk caches (FX graphs, AOT autograd, kernels) at ``path``.

    Why: inductor has one cache directory per process, read from
    ``TORCHINDUCTOR_CACHE_DIR`` when it first needs it and memoized in
    ``functools`` caches it registers (``torch/_inductor/runtime/cache_dir_utils.py``
    ``temporary_cache_dir`` clears them the same way, ``torch._inductor.utils.clear_caches``).
    Setting the variable after a compile would otherwise reach only part of inductor.
    """
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:  # pragma: no cover - every supported release has it
        return
    clear_caches()


def inductor_caches_disabled() -> str | None:
    """Which of inductor's persistent caches is switched off in this process, if any.

    Why: ``compiled(..., cache_dir=)`` warms a later process only through inductor's FX
    graph cache and AOT autograd's cache (``torch._inductor.config.fx_graph_cache``,
    ``force_disable_caches``; ``torch._functorch.config.enable_autograd_cache``).
    """
    from torch._inductor import config as inductor

    if getattr(inductor, "force_disable_caches", False):
        return "torch._inductor.config.force_disable_caches"
    if not getattr(inductor, "fx_graph_cache", True):
        return "torch._inductor.config.fx_graph_cache"
    functorch = importlib.import_module("torch._functorch.config")
    if not getattr(functorch, "enable_autograd_cache", True):
        return "torch._functorch.config.enable_autograd_cache"
    return None


def inductor_cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache hits and misses in this process (``counters["inductor"]``).

    Why: the warm-start test and benchmark count a process's code generation: a miss
    is a graph inductor compiled, a hit one it loaded (``torch/_inductor/codecache.py``).
    """
    c = torch._dynamo.utils.counters["inductor"]
    return {"hit": int(c["fxgraph_cache_hit"]), "miss": int(c["fxgraph_cache_miss"])}


def compile_phase_seconds() -> dict[str, float]:
    """Seconds this process spent in dynamo's tracing and in the compiler backend.

    Why: the compile-time benchmark reports dynamo's share of a cold compile, which
    fasttorch's own Python (records, functional_call, the optimizer) drives;
    ``torch._dynamo.utils.compilation_time_metrics`` records ``_compile.compile_inner``
    (a frame's whole compile) and ``OutputGraph.call_user_compiler`` (the backend's
    part of it). Zeros where the record is gone.
    """
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    whole = sum(metrics.get("_compile.compile_inner", []))
    backend = sum(metrics.get("OutputGraph.call_user_compiler", []))
    return {"dynamo": max(0.0, whole - backend), "backend": backend}


# --------------------------------------------------------------------------- vmapped
# (fasttorch.vmapped: populations under torch.func.vmap)

_FOREACH_BATCHING: list[Any] = []  # the Library holding the rules, once registered


def register_foreach_batching(per_tensor: Any) -> None:
    """Give every ``aten::_foreach_*`` overload a vmap batching rule: ``per_tensor``.

    Why: functorch has no batching rule, and no fallback, for the foreach kernels
    ("Batching rule not implemented for aten::_foreach_mul.Scalar. We could not
    generate a fallback"), which fasttorch's optimizers, clipping, accumulation and EMA
    call; a population runs them under ``torch.func.vmap``. ``per_tensor(op, args,
    kwargs)`` runs one as the per-tensor ops it stands for, which vmap batches. The
    rule is registered at the ``FuncTorchBatched`` dispatch key (a key name, through
    the public ``torch.library.Library``), so it applies in eager mode and while
    ``torch.compile`` traces a vmapped function with fake tensors alike (a
    ``TorchFunctionMode`` is not consulted there). It only adds rules where vmap had
    none: foreach calls outside vmap are untouched. Upstream: functorch's
    ``BatchRulesDecompositions.cpp`` lists no ``_foreach_*`` op (torch 2.10 to 2.13).
    Registered once per process.
    """
    if _FOREACH_BATCHING:
        return
    lib = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    for name in dir(torch):
        packet = getattr(torch.ops.aten, name, None) if name.startswith("_foreach_") else None
        if packet is None:
            continue
        op = name.removeprefix("_foreach_")
        for overload in packet.overloads():
            qualified = name if overload == "default" else f"{name}.{overload}"

            def rule(*args: Any, _op: str = op, **kwargs: Any) -> Any:
                return per_tensor(_op, args, kwargs)

            lib.impl(qualified, rule, "FuncTorchBatched")  # type: ignore[no-untyped-call]
    _FOREACH_BATCHING.append(lib)


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


# --------------------------------------------------------------------------- functorch


def in_functorch_transform() -> bool:
    """Whether the code runs inside a ``torch.func`` transform (``vmap``, ``grad``).

    Why: the eager optimizers read a few hyperparameters to the host once per change
    (CUDA's fused kernels and ``_foreach_lerp_``'s fast route take Python floats); under
    ``torch.func.vmap`` those tensors hold one value per member and cannot be read
    (``.item()`` of a batched tensor raises), so the tensor form is used there. torch
    has no public query; ``torch._C._functorch.peek_interpreter_stack`` is what
    ``torch._functorch`` itself consults (torch/_functorch/pyfunctorch.py). Where it is
    missing, False: the read then raises vmap's own error.
    """
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
