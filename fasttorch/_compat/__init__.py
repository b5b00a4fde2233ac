"""Every use of a private torch API in fasttorch, in one place: this package.

A torch upgrade should touch this package only, one module per area of torch:
``dynamo``, ``inductor``, ``cudagraphs``, ``aten`` (private ops and CPU queries),
``distributed`` (DCP, FSDP2), ``functorch`` and ``releases`` (the checks that can only
read the version); ``interpreter`` holds the one workaround for CPython itself. Each
entry is feature-detected where there is a feature to detect (a release check says why
there is none), says why fasttorch needs it, and names the upstream code or issue it
depends on. Nothing else in the package imports
``torch._dynamo``, ``torch._inductor`` or ``torch._C``, or calls a private ATen op.

Every name is re-exported here: the rest of fasttorch, and its tests, use
``fasttorch._compat.X``.
"""

from __future__ import annotations

import threading

from fasttorch._compat.aten import (
    CPU_ATTENTION,
    CPU_ATTENTION_BACKWARD,
    amp_update_scale,
    assert_async,
    autograd_profiler_enabled,
    cpu_has_amx_fp16,
    cpu_has_bf16_units,
    fused_optimizer_kernel,
    tensor_version,
)
from fasttorch._compat.cudagraphs import (
    CudagraphVerdict,
    cudagraph_check_backend,
    cudagraph_skips,
    is_static_address,
    mark_static_addresses,
)
from fasttorch._compat.distributed import (
    DcpMetadataUnpickler,
    fsdp_keeps_params_after_forward,
)
from fasttorch._compat.dynamo import (
    TracedError,
    compile_backends,
    compile_phase_seconds,
    compile_settings,
    compiled_in_place,
    dynamo_counters,
    dynamo_reset,
    guard_failures,
    is_compile_error,
    is_optimized_module,
    load_precompiled,
    no_recompile_limit,
    portable_guards,
    precompile,
    precompile_available,
    precompiled_guard_failure,
    recompile_budget,
    recompile_budget_enforced,
    recompile_limit_hit,
    save_precompiled,
    traced_error,
    tracing_autograd_ops,
)
from fasttorch._compat.functorch import (
    in_functorch_transform,
    register_foreach_batching,
)
from fasttorch._compat.inductor import (
    CombinedGraphPass,
    CustomGraphPass,
    compile_modes,
    cpp_compile_error,
    cpu_isa_probe,
    graph_pass_hash,
    inductor_cache_counts,
    inductor_caches_disabled,
    inductor_config,
    inductor_graph_seconds,
    inductor_has_option,
    inductor_mode_options,
    parallel_cpp_builds,
    use_inductor_cache_dir,
    with_cacheable_autocast,
)
from fasttorch._compat.interpreter import LARGE_STACK_SLOTS, on_large_stack
from fasttorch._compat.releases import (
    AUTOGRAD_GRAD_IN_GRAPH,
    cpu_gemm_pass_works,
)

__all__ = [
    "AUTOGRAD_GRAD_IN_GRAPH",
    "CPU_ATTENTION",
    "CPU_ATTENTION_BACKWARD",
    "LARGE_STACK_SLOTS",
    "CombinedGraphPass",
    "CudagraphVerdict",
    "CustomGraphPass",
    "DcpMetadataUnpickler",
    "TracedError",
    "amp_update_scale",
    "assert_async",
    "autograd_profiler_enabled",
    "compile_backends",
    "compile_modes",
    "compile_phase_seconds",
    "compile_settings",
    "compiled_in_place",
    "cpp_compile_error",
    "cpu_gemm_pass_works",
    "cpu_has_amx_fp16",
    "cpu_has_bf16_units",
    "cpu_isa_probe",
    "cudagraph_check_backend",
    "cudagraph_skips",
    "dynamo_counters",
    "dynamo_reset",
    "fsdp_keeps_params_after_forward",
    "fused_optimizer_kernel",
    "graph_pass_hash",
    "guard_failures",
    "in_functorch_transform",
    "inductor_cache_counts",
    "inductor_caches_disabled",
    "inductor_config",
    "inductor_graph_seconds",
    "inductor_has_option",
    "inductor_mode_options",
    "is_compile_error",
    "is_optimized_module",
    "is_static_address",
    "load_precompiled",
    "mark_static_addresses",
    "no_recompile_limit",
    "on_large_stack",
    "parallel_cpp_builds",
    "portable_guards",
    "precompile",
    "precompile_available",
    "precompiled_guard_failure",
    "recompile_budget",
    "recompile_budget_enforced",
    "recompile_limit_hit",
    "register_foreach_batching",
    "repr_context",
    "save_precompiled",
    "tensor_version",
    "traced_error",
    "tracing_autograd_ops",
    "use_inductor_cache_dir",
    "with_cacheable_autocast",
]

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
