"""Dynamo: tracing the backward, its counters, the recompile budget and its reports,
the backends ``compiled`` accepts and the seconds a compile spends tracing.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, NamedTuple

import torch

__all__ = [
    "TracedError",
    "compile_backends",
    "compile_phase_seconds",
    "compile_settings",
    "compiled_in_place",
    "dynamo_counters",
    "dynamo_reset",
    "guard_failures",
    "is_compile_error",
    "is_optimized_module",
    "load_precompiled",
    "portable_guards",
    "precompile",
    "precompile_available",
    "precompiled_guard_failure",
    "recompile_budget",
    "recompile_budget_enforced",
    "recompile_limit_hit",
    "save_precompiled",
    "traced_error",
    "tracing_autograd_ops",
]


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


def compiled_in_place(module: Any) -> bool:
    """Whether ``module.compile()`` was called on ``module`` (its ``__call__`` is compiled).

    Why: ``compiled(regions=...)`` leaves such a block alone; ``nn.Module.compile`` keeps
    the compiled call in the private ``_compiled_call_impl`` (``torch/nn/modules/module.py``),
    with no public query. Read with ``getattr``: a release without it answers ``False``.
    """
    return getattr(module, "_compiled_call_impl", None) is not None


def is_compile_error(err: BaseException | None) -> bool:
    """Whether ``err`` is dynamo's or its backend's, raised while compiling a frame.

    Why: ``compiled(regions="auto")`` compiles a step again without regions when the
    first compile with them fails, and must tell such a failure (nothing ran yet, under
    ``fullgraph=True``) from an error of the step itself. Dynamo's errors
    (``Unsupported``, ``BackendCompilerFailed``, ``TorchRuntimeError``, ...) derive from
    ``torch._dynamo.exc.TorchDynamoException``; ``FailOnRecompileLimitHit`` does not.
    """
    base = getattr(getattr(torch._dynamo, "exc", None), "TorchDynamoException", None)
    return isinstance(base, type) and isinstance(err, base)


class TracedError(NamedTuple):
    """An error of the traced code that dynamo wrapped: see :func:`traced_error`."""

    kind: type[BaseException] | None  # the traced code's exception type; None: unknown
    message: str
    frames: list[Any]  # traceback.FrameSummary, outermost first


def traced_error(err: BaseException) -> TracedError | None:
    """The traced code's own error inside dynamo's ``err``, and the traced frames.

    Why: an error of the traced code itself (a float label to ``cross_entropy``, a
    shape mismatch, a ``raise`` in the loss function) reaches the caller as dynamo's
    ``TorchRuntimeError`` or ``Unsupported`` ("observed exception"): forty lines whose
    cause is buried. The original exception is on the chain of contexts (a fake-tensor
    run's), or only its type and repr are (an "observed" one: the private
    ``torch._dynamo.exc.observed_exception_map`` gives its type back); the traced
    code's stack is the wrappers' ``real_stack`` (a ``traceback.StackSummary``).
    ``kind`` is ``None`` for what dynamo refuses itself (an unsupported construct).
    ``None`` when ``err`` is not dynamo's.
    """
    if not is_compile_error(err):
        return None
    frames = list(getattr(err, "real_stack", None) or [])
    observed = getattr(getattr(torch._dynamo, "exc", None), "observed_exception_map", {})
    kinds = {v: k for k, v in observed.items()} if isinstance(observed, dict) else {}
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        # torch 2.10 keeps only the type ("ExceptionVariable(<class ...>)"), not the
        # message: dynamo's own error, which has it, is then the better report.
        text = (str(cause.args[0]) if cause.args else "").removeprefix("raised exception ")
        lost = text.startswith("ExceptionVariable(")
        if not is_compile_error(cause) and not lost:
            return TracedError(type(cause), str(cause), frames)
        kind = kinds.get(type(cause))
        if kind is not None and not lost:
            return TracedError(kind, text, frames)
        cause = cause.__cause__ or cause.__context__
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return TracedError(None, first, frames)


def compile_backends() -> tuple[str, ...]:
    """The backend names ``torch.compile`` knows now (registered ones included).

    Why: as :func:`compile_modes`, for ``backend=``; ``torch._dynamo.list_backends``
    (``torch/_dynamo/backends/registry.py``), with no tag excluded so that the debug
    backends (``"aot_eager"``) count as valid.
    """
    import torch._dynamo

    return tuple(torch._dynamo.list_backends(exclude_tags=()))


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
    # A function traced ahead (precompile) is timed as "fullgraph_capture", dynamo and
    # backend together; its backend part is AOT autograd's dispatcher, which the
    # ordinary path times inside call_user_compiler (so only the excess is counted).
    ahead = sum(metrics.get("fullgraph_capture", []))
    if ahead:
        aot = sum(metrics.get("create_aot_dispatcher_function", []))
        ahead_backend = min(ahead, max(0.0, aot - backend))
        whole += ahead
        backend += ahead_backend
    return {"dynamo": max(0.0, whole - backend), "backend": backend}


# -- Warm starts without tracing: a whole traced step kept on disk ------------------------

# Guards that dynamo can write to disk and that hold in any process: the tensors'
# metadata and aliasing, and the global modes a graph was traced under. Guards on Python
# objects (identity, closures, attribute values) cannot be written; fasttorch's
# fingerprint of the step (fasttorch._compile.fingerprint) stands in for them.
_PORTABLE_GUARDS = frozenset(
    {
        "TENSOR_MATCH",
        "SHAPE_ENV",
        "GRAD_MODE",
        "GLOBAL_STATE",
        "DETERMINISTIC_ALGORITHMS",
        "DEFAULT_DEVICE",
        "TORCH_FUNCTION_STATE",
        "AUTOGRAD_SAVED_TENSORS_HOOKS",
    }
)


def precompile_available() -> bool:
    """Whether this torch can trace a function ahead and load it in another process.

    Why: ``compiled(..., cache_dir=)`` keeps the traced step itself (dynamo's bytecode,
    its tensor guards and AOT autograd's compiled forward and backward) so that a new
    process skips dynamo's tracing, which is most of a warm start (20 s of 25 s for
    the 12-layer benchmark GPT, docs/design.md). It uses the ``aot_compile`` method of
    a ``torch.compile`` function and ``torch.compiler.load_compiled_function``
    (experimental, ``torch/_dynamo/aot_compile.py``), plus dynamo's ``guard_filter_fn``
    option; where any of them is missing, warm starts trace again.
    """
    try:
        from torch._dynamo import aot_compile
    except ImportError:
        return False
    fn = getattr(aot_compile, "AOTCompiledFunction", None)
    load = getattr(torch.compiler, "load_compiled_function", None)
    methods = ("guard_check", "disable_guard_check", "save_compiled_function", "prepare_f_locals")
    if fn is None or not callable(load) or not all(callable(getattr(fn, m, None)) for m in methods):
        return False
    # The closure's objects travel as external data; torch 2.10's loader takes none.
    return all(
        "external_data" in inspect.signature(f).parameters
        for f in (load, fn.save_compiled_function)
    )


def portable_guards(entries: Any) -> list[bool]:
    """A ``guard_filter_fn`` that keeps the guards :data:`_PORTABLE_GUARDS` names."""
    return [e.guard_type in _PORTABLE_GUARDS and not e.is_global for e in entries]


def precompile(compiled_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Trace and compile ``compiled_fn`` (``torch.compile(..., fullgraph=True)`` whose
    options hold ``guard_filter_fn=portable_guards``) for these inputs, without running it.
    """
    return compiled_fn.aot_compile((args, kwargs))


def save_precompiled(fn: Any, path: str, external: dict[str, Any]) -> None:
    """Write ``precompile``'s result to ``path`` (atomically: a temporary file in the same
    directory, then a rename, ``torch/_dynamo/aot_compile.py`` ``atomic_write_binary``).

    ``external``: the objects the function closes over, written as references by name
    and handed back by the loading process (they are live objects: a step, a module).
    """
    fn.save_compiled_function(path, external_data=external)


def load_precompiled(path: str, f_globals: dict[str, Any], external: dict[str, Any]) -> Any:
    """Read what :func:`save_precompiled` wrote, with this process's closure objects.

    Why the contexts: rebuilding the tensor guards runs dynamo's guard builder, which
    asks for a compile and tracing context (``TracingContext.get()``), as
    ``torch._dynamo.aot_compile.AOTCompiledModel.deserialize`` provides.
    """
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext, TracingContext, compile_context, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with (
        open(path, "rb") as f,
        compile_context(CompileContext(convert_frame.get_compile_id({}))),
        get_metrics_context(),
        tracing(TracingContext(FakeTensorMode())),
    ):
        fn: Any = torch.compiler.load_compiled_function(
            f, f_globals=f_globals, external_data=external
        )
    fn.disable_guard_check()  # the caller checks, to fall back instead of raising
    return fn


def precompiled_guard_failure(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """``None`` if the loaded function's guards accept these inputs, else dynamo's reason."""
    if fn.guard_check(*args, **kwargs):
        return None
    manager = getattr(getattr(fn, "_artifacts", None), "guard_manager", None)
    verbose = getattr(manager, "check_verbose", None)
    generic = "a tensor's shape, dtype, device or layout differs"
    if not callable(verbose):
        return generic
    info = verbose(fn.prepare_f_locals(*args, **kwargs))
    parts = [str(p) for p in getattr(info, "verbose_code_parts", None) or ()]
    return "; ".join(parts) or generic


def compile_settings() -> dict[str, Any]:
    """Dynamo's, AOT autograd's and inductor's settings in this process, for a cache key.

    Why: a function traced and compiled ahead depends on them as an FX graph cache entry
    does (inductor's key holds its config, ``torch/_inductor/codecache.py``); each
    config module's ``get_config_copy`` (``torch/utils/_config_module.py``).
    """
    out: dict[str, Any] = {}
    for name in ("torch._dynamo.config", "torch._functorch.config", "torch._inductor.config"):
        module = importlib.import_module(name)
        copy = getattr(module, "get_config_copy", None)
        if callable(copy):
            plain = (bool, int, float, str, type(None))
            out[name] = {k: v for k, v in sorted(copy().items()) if isinstance(v, plain)}
    return out


def no_recompile_limit() -> contextlib.AbstractContextManager[Any]:
    """Dynamo's recompile limit lifted while a per-tensor kernel compiles for each shape.

    Why: torchao's low-bit optimizers compile one kernel (``single_param_adam``) per
    parameter shape and dtype, and lift the limit the same way in their ``step()``
    (``torchao/optim/adam.py``), through ``torch._dynamo.utils.disable_cache_limit``;
    ``fasttorch.optim.from_torchao`` runs the same kernel eagerly. Without the context
    manager (a torch that lacks it), a model with more shapes than the limit runs the
    rest of its kernels eagerly: same values, slower.
    """
    utils = getattr(torch._dynamo, "utils", None)
    disable = getattr(utils, "disable_cache_limit", None)
    return disable() if disable is not None else contextlib.nullcontext()  # type: ignore[no-any-return]
