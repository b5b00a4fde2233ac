"""``compiled``: the whole step under ``torch.compile``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

from fasttorch.steps import Step, check_wrap, compile_step_fn
from fasttorch.transforms._cpu_gemm import CpuGemm, HalfGemmInFloat32, half_gemm_dtypes

__all__ = ["compiled"]

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def compiled(
    step: Any,
    *,
    mode: Mode | None = None,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    options: dict[str, Any] | None = None,
    cpu_gemm: CpuGemm = "auto",
) -> Any:
    """Compile the whole step: forward, backward, loss scaling, clipping and update.

    The step's pure functions go to ``torch.compile`` once, with ``fullgraph=True`` by
    default: a graph break is an error, not a silent slowdown. Learning rate, loss
    scale and step count are tensors in the state, so they change without recompiling.
    With ``grad_accumulate`` two graphs are compiled (one microbatch's forward and
    backward; the window's unscale, clip and update) and reused, never one graph
    unrolled over the microbatches, and the model's code is compiled once. Input
    checks, the RNG scope and donation stay outside the graph.

    ``compiled`` must be the outermost of the phase transforms. It also accepts any
    ``(state, batch) -> (state, metrics)`` callable (a custom step), compiled whole.

    Equivalent to writing the loop body as one function and ``torch.compile``-ing it,
    which ``torch.compile(model)`` alone does not give: the optimizer and clipping only
    fuse when they are in the same graph as the backward.

    On a CPU without bf16 (fp16) matrix units, ATen's bf16 (fp16) matrix products and
    attention are several times slower than float32 ones of the same shape. There, by
    default, ``compiled`` computes the graph's bf16/fp16 ``mm``/``addmm``/``bmm``/
    ``baddbmm`` and CPU attention in float32 from the same inputs and rounds each result
    once to bf16/fp16: products of bf16 numbers are exact in float32 and both kernels
    accumulate in float32, so the values agree up to the order of the sums (as between
    any two GEMM libraries); attention is more precise, as ATen's bf16 kernel rounds the
    attention weights to bf16. An activation the backward reads again is widened again
    right before that use rather than kept in float32, so the step's peak memory stays
    that of bf16 plus the one widened operand in use. ``cpu_gemm`` chooses:

    * ``"auto"``: for each of bf16 and fp16 that the CPU lacks units for (AVX512-BF16 or
      AMX for bf16, AMX-FP16 or AVX512-FP16 for fp16; only x86 CPUs are judged);
    * ``"fp32"``: bf16 and fp16, on any CPU;
    * ``"native"``: none.

    GPU tensors are never touched: a step whose tensors are all on a GPU is compiled
    without the pass or the rounding option it sets (decided on the first call). It is
    an inductor graph pass, so it applies to the inductor backend.

    Args:
        step: a :class:`fasttorch.Step` or any ``(state, batch)`` callable.
        mode, fullgraph, dynamic, backend, options: as for :func:`torch.compile`;
            ``backend="aot_eager"`` checks graph capture without code generation.
        cpu_gemm: ``"auto"``, ``"fp32"`` or ``"native"``: how bf16/fp16 matrix
            products and attention on CPU tensors are computed (see above).

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> fast = fasttorch.compiled(fasttorch.step(loss_fn), backend="aot_eager")
        >>> state, metrics = fast(state, torch.randn(8, 4))
        >>> int(state.step)
        1
    """
    opts: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": backend}
    if mode is not None:
        opts["mode"] = mode
    options = _with_cpu_gemm(options, cpu_gemm, backend)
    if options is not None:
        opts["options"] = options
    if getattr(step, "__fasttorch_profiled__", False):  # set by fasttorch.profiled
        raise ValueError(
            "compiled cannot wrap a profiled step: the profiler steps on the host, which "
            "inside a graph is a graph break. Write profiled(compiled(step), dir=...) instead"
        )
    if isinstance(step, Step):
        check_wrap(step, "compiled")
        return step.with_phases("compiled", compile_options=opts)
    if not callable(step):
        raise TypeError(f"compiled expects a step or a callable, got {type(step).__name__}")
    if getattr(step, "__fasttorch_compiled__", False):
        raise ValueError("compiled: this callable is already compiled; apply compiled once")
    fn = compile_step_fn(step, **opts)

    @functools.wraps(step)
    def run(state: Any, batch: Any) -> Any:
        return fn(state, batch)

    run.__fasttorch_compiled__ = True  # type: ignore[attr-defined]
    return run


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
    out = dict(options or {})
    # Inductor would otherwise skip the bf16 rounding between a value's producer and
    # the widening convert when both fuse, and multiply unrounded float32 values.
    set_emulate = "emulate_precision_casts" not in out
    out.setdefault("emulate_precision_casts", True)
    mine = HalfGemmInFloat32(dtypes, set_emulate=set_emulate)
    theirs = out.get("post_grad_custom_pre_pass")
    if theirs is None:
        out["post_grad_custom_pre_pass"] = mine
    else:
        out["post_grad_custom_pre_pass"] = [
            mine,
            *(theirs if isinstance(theirs, (list, tuple)) else [theirs]),
        ]
    return out
