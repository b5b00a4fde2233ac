"""Dynamo: tracing the backward, its counters, the recompile budget and its reports,
the backends ``compiled`` accepts and the seconds a compile spends tracing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = [
    "compile_backends",
    "compile_phase_seconds",
    "compiled_in_place",
    "dynamo_counters",
    "dynamo_reset",
    "guard_failures",
    "is_compile_error",
    "is_optimized_module",
    "recompile_budget",
    "recompile_budget_enforced",
    "recompile_limit_hit",
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


def is_compile_error(err: BaseException) -> bool:
    """Whether ``err`` is dynamo's or its backend's, raised while compiling a frame.

    Why: ``compiled(regions="auto")`` compiles a step again without regions when the
    first compile with them fails, and must tell such a failure (nothing ran yet, under
    ``fullgraph=True``) from an error of the step itself. Dynamo's errors
    (``Unsupported``, ``BackendCompilerFailed``, ``TorchRuntimeError``, ...) derive from
    ``torch._dynamo.exc.TorchDynamoException``; ``FailOnRecompileLimitHit`` does not.
    """
    base = getattr(getattr(torch._dynamo, "exc", None), "TorchDynamoException", None)
    return isinstance(base, type) and isinstance(err, base)


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
    return {"dynamo": max(0.0, whole - backend), "backend": backend}
