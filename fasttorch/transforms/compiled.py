"""``compiled``: the whole step under ``torch.compile``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

from fasttorch.steps import Step, check_wrap, compile_step_fn

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

    Args:
        step: a :class:`fasttorch.Step` or any ``(state, batch)`` callable.
        mode, fullgraph, dynamic, backend, options: as for :func:`torch.compile`;
            ``backend="aot_eager"`` checks graph capture without code generation.

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
