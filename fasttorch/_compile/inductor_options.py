"""The inductor options ``compiled`` chooses from a step's first call.

``torch.compile``'s arguments as the caller gave them, plus what fasttorch adds on
the inductor backend: the float32 pass for bf16/fp16 matrix products on a CPU without
half-precision units (:mod:`fasttorch._compile.cpu_gemm`), the C++ wrapper for
graphs whose tensors are all on the CPU, a cap on the fusion search, the CPU-only
passes dropped from GPU graphs, and the early probe of the C++ compiler's instruction
sets. Each takes options and returns new ones; none runs a graph.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from fasttorch import _checks, _compat
from fasttorch._checks import warn_once
from fasttorch._compile.cpu_gemm import CpuGemm, HalfGemmInFloat32, half_gemm_dtypes


def _with_cpu_gemm(
    options: dict[str, Any] | None, cpu_gemm: CpuGemm, backend: str | Callable[..., Any]
) -> dict[str, Any] | None:
    """``options`` with the float32 GEMM pass added ahead of any post-grad pass of theirs."""
    dtypes = half_gemm_dtypes(cpu_gemm)  # checks the value
    if backend != "inductor":
        if cpu_gemm == "fp32":
            raise ValueError(
                f"cpu_gemm='fp32' is an inductor graph pass; backend {backend!r} does not run "
                "it. Use the inductor backend, or cpu_gemm='auto'/'native'"
            )
        return options
    if not dtypes:
        return options
    unavailable = None
    if not _compat.cpu_gemm_pass_works():
        found = torch.__version__
        if cpu_gemm == "fp32":
            raise ValueError(
                f"compiled: cpu_gemm='fp32' needs torch >= 2.13, found {found}: older "
                "inductor fails to build it (2.10) or rounds it differently from the "
                "hand-written loop (2.11, 2.12). Use cpu_gemm='native', or upgrade torch"
            )
        # Said on the first call, and only if it has CPU tensors: a GPU step never needs it.
        unavailable = (
            f"compiled: bf16/fp16 matrix products on this CPU run natively on torch {found} "
            "(slower here than in float32): compiled's float32 pass needs torch >= 2.13. "
            "Pass cpu_gemm='native' to silence this, or upgrade torch"
        )
    out = dict(options or {})
    # Inductor would otherwise skip the bf16 rounding between a value's producer and
    # the widening convert when both fuse, and multiply unrounded float32 values.
    set_emulate = "emulate_precision_casts" not in out
    out.setdefault("emulate_precision_casts", True)
    mine = HalfGemmInFloat32(dtypes, set_emulate=set_emulate)
    mine.unavailable = unavailable
    return with_pass_first(out, mine)


def _passes(given: Any) -> list[Any]:
    """The passes in a ``post_grad_custom_pre_pass`` value: one, a list, or combined."""
    if given is None:
        return []
    if isinstance(given, _compat.CombinedGraphPass):
        return list(given.passes)
    return list(given) if isinstance(given, (list, tuple)) else [given]


def with_pass_first(inner: dict[str, Any], mine: Any) -> dict[str, Any]:
    """Inductor options ``inner`` with graph pass ``mine`` run ahead of those it has."""
    passes = [mine, *_passes(inner.get("post_grad_custom_pre_pass"))]
    both = passes[0] if len(passes) == 1 else _compat.CombinedGraphPass(passes)
    return {**inner, "post_grad_custom_pre_pass": both}


def _separate_build_is_ours(options: dict[str, Any], opts: dict[str, Any]) -> bool:
    """Whether ``opts`` build in two files because ``_with_cpp_wrapper`` set it."""
    mine = options.get("options") or {}
    now = opts.get("options") or {}
    return (
        opts.get("fullgraph") is True
        and "cpp_wrapper_build_separate" not in mine
        and now.get("cpp_wrapper_build_separate") is True
    )


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _on_cpu(args: Any) -> bool:
    return any(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in pytree.tree_leaves(args)
    )


def _only_on_cpu(args: Any) -> bool:
    devices = {t.device.type for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)}
    return devices == {"cpu"}


def _with_cpp_wrapper(options: dict[str, Any]) -> dict[str, Any]:
    """Inductor's options with ``cpp_wrapper=True``, unless the caller set it (any value).

    With it ``cpp_wrapper_build_separate=True``, again unless the caller set it: the
    wrapper (one large C++ function) and the kernels compile as two files, the wrapper
    at ``-O1`` and the kernels at ``-O3``, where one file would put the wrapper through
    ``-O3`` too, which shortens cold compiles (docs/design.md, "Compile time"). Torch
    leaves the option off by default: where the C++ compiler fails on the two files,
    ``compile_step_fn`` warns once and builds the graph as one file.

    And the wrapper at ``-Og`` (:data:`WRAPPER_OPT_LEVEL`, unless the caller set it):
    GCC's time on the one large function grows faster than its size at ``-O1``. The
    24-layer benchmark GPT's wrapper (611 KB of C++) took 15.7 s at ``-O1``, its
    kernels 3.4 s at ``-O3``; at 12 layers (322 KB) 6.5 s at ``-O1`` and 3.6 s at
    ``-Og``, with a steady step within the noise (interleaved, one process: ``-Og``'s
    speed over ``-O1``'s 1.02 on M1's MLP, 0.99 on the 12-layer GPT; ``-O0`` cost M1
    10%). docs/design.md, "The update on a CPU runs outside the graphs".
    """
    if options.get("backend", "inductor") != "inductor":
        return options
    inner = dict(options.get("options") or {})
    inner.setdefault("cpp_wrapper", True)
    if _compat.inductor_has_option("cpp_wrapper_build_separate"):
        inner.setdefault("cpp_wrapper_build_separate", True)
    if inner.get("cpp_wrapper_build_separate") is True and _compat.inductor_has_option(WRAPPER_OPT):
        inner.setdefault(WRAPPER_OPT, WRAPPER_OPT_LEVEL)
    return {**options, "options": inner}


WRAPPER_OPT = "aot_inductor.compile_wrapper_opt_level"
WRAPPER_OPT_LEVEL = "Og"
"""GCC's optimization level for the C++ wrapper of a CPU graph built as two files."""


def _check_isa_cache() -> None:
    """Warn once where inductor's cache may hand this process another ISA's kernels."""
    isa = os.environ.get("ATEN_CPU_CAPABILITY")
    if isa and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        warn_once(
            f"compiled: ATEN_CPU_CAPABILITY={isa} is set, but inductor's cache does not "
            "tell kernels built for one instruction set from another: a process that "
            "shares the cache with runs of another setting can load their kernels, which "
            "crashed or gave NaN. Give each setting its own TORCHINDUCTOR_CACHE_DIR"
        )


_ISA_PROBE: list[threading.Thread] = []


def probe_cpu_isa_early(options: dict[str, Any]) -> None:
    """Start inductor's probe of the C++ compiler's vector instruction sets now, in a thread.

    Before its first CPU kernel inductor compiles and loads a small program per
    candidate instruction set (AVX512, AVX2, ...), once per process and, for the
    compiler's part, once per cache directory, and the compile waits for it (seconds on
    a small CPU; docs/design.md, "Compile time"). Started when the step is first
    called, it runs in the C++ compiler's own processes beside dynamo's tracing and AOT
    autograd, which come first and need
    no compiler; by the time code generation asks for the answer it is known. The
    thread computes what inductor would (``cpu_vec_isa.valid_vec_isa_list``, cached
    for the process), with the same configuration; where the caller's options change
    the C++ toolchain (``cpp.*``) or the backend is not inductor, nothing is started and
    inductor probes in line as usual. Once per process.
    """
    if _ISA_PROBE or options.get("backend", "inductor") != "inductor":
        return
    inner = options.get("options") or {}
    if any(k == "cpp" or k.startswith("cpp.") for k in inner):
        return
    probe = _compat.cpu_isa_probe()
    if probe is None:  # inductor reorganized: it probes in line
        return

    def run() -> None:
        # On failure inductor probes again in line and reports it there.
        with contextlib.suppress(Exception):
            probe()

    thread = threading.Thread(target=run, name="fasttorch-cpu-isa-probe", daemon=True)
    _ISA_PROBE.append(thread)
    thread.start()


def _without_cpu_only_passes(options: dict[str, Any], args: Any) -> dict[str, Any]:
    """``options`` less the inductor passes marked ``cpu_only`` when no tensor is on CPU.

    Such a pass (``compiled``'s bf16 matrix-product rewrite) would find nothing to do in
    a GPU graph, but the rounding option it asks for (``emulate_precision_casts``, when
    it set it) would still change the GPU kernels. A pass this torch cannot run
    (``unavailable`` holds why) is dropped too, with that warning once, when the step
    has CPU tensors.
    """
    inner = options.get("options")
    if not isinstance(inner, dict):
        return options
    passes = _passes(inner.get("post_grad_custom_pre_pass"))
    mine = [p for p in passes if getattr(p, "cpu_only", False)]
    if _on_cpu(args):
        mine = [p for p in mine if getattr(p, "unavailable", None)]
        for p in mine:
            warn_once(p.unavailable)
    if not mine:
        return options
    inner = dict(inner)
    rest = [p for p in passes if p is not None and p not in mine]
    if rest:
        inner["post_grad_custom_pre_pass"] = (
            rest[0] if len(rest) == 1 else _compat.CombinedGraphPass(rest)
        )
    else:
        del inner["post_grad_custom_pre_pass"]
    if any(getattr(p, "set_emulate", False) for p in mine):
        inner.pop("emulate_precision_casts", None)
    return {**options, "options": inner}


# Inductor's fusion search tries up to this many partners for each node among the
# nodes that read the same buffer (64 by default). A step's update reads the same 0-d
# hyperparameter tensors (lr, betas, loss scale) in every per-parameter node, so each
# node meets 64 candidates, most of them useless, and the search dominates a cold compile
# of a model with many small tensors (docs/design.md, "Compile time"). Producer-consumer
# pairs share their own buffers and are still all found.
FUSION_ATTEMPTS = 4


def _with_fusion_cap(options: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` arguments with the inductor fusion-search cap added.

    Only for the inductor backend, and only where the caller did not set the option.
    ``torch.compile`` takes ``mode`` or ``options``, not both, so a mode becomes its
    options (``_compat.inductor_mode_options``, as torch.compile itself does).
    """
    if options.get("backend", "inductor") != "inductor":
        return options
    out = dict(options)
    inductor_opts = dict(out.pop("options", None) or {})
    mode = out.pop("mode", None)
    if mode is not None and mode != "default":
        inductor_opts = {**_compat.inductor_mode_options(mode, out.get("dynamic")), **inductor_opts}
    inductor_opts.setdefault("max_fusion_buffer_group_pairwise_attempts", FUSION_ATTEMPTS)
    out["options"] = inductor_opts
    return out


def _with_cacheable_autocast(options: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` arguments under which a graph with an autocast region is cached.

    AOT autograd's cache otherwise refuses a ``with_amp`` graph, so a warm start traced
    its forward and backward again in every process (``_compat.with_cacheable_autocast``
    says why that is safe). Only for the inductor backend, whose cache it is; call it
    after ``_with_fusion_cap``, which turns a mode into options.
    """
    if options.get("backend", "inductor") != "inductor":
        return options
    inner = _compat.with_cacheable_autocast(dict(options.get("options") or {}))
    return {**options, "options": inner}


# Backends every supported torch registers, so that naming one costs no listing of them
# all (torch._dynamo.list_backends imports each backend's module: 1.7 s on 2 cores,
# 2026-11-29, paid by every compiled() call before its step ever ran).
_BUILT_IN_BACKENDS = frozenset({"inductor", "eager", "aot_eager"})


def check_arguments(mode: object, backend: object, fullgraph: object, dynamic: object) -> None:
    """Raise now for a mode or backend torch.compile does not know: its first call would.

    That first call is the step's, after the state was given to it (and donated).
    """
    _checks.flag("compiled", "fullgraph", fullgraph)
    if dynamic is not None:
        _checks.flag("compiled", "dynamic", dynamic)
    if mode is not None:
        modes = _compat.compile_modes()
        if mode not in modes:
            raise ValueError(
                f"compiled: unknown mode={mode!r}; torch.compile's modes are "
                f"{', '.join(map(repr, modes))} (or None)"
            )
    if callable(backend) or backend in _BUILT_IN_BACKENDS:
        return
    backends = _compat.compile_backends()  # imports every backend module: 1.7 s
    if backend not in backends:
        raise ValueError(
            f"compiled: unknown backend={backend!r}; torch.compile knows "
            f"{', '.join(map(repr, backends))}, or pass a backend function (register a "
            "named one with torch._dynamo.register_backend before calling compiled)"
        )
