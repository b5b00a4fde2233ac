"""``check_cudagraphs``: would CUDA graphs capture a step's graphs? Answered on any device.

Part of the testing kit (:mod:`fasttorch.testing` re-exports it). The step's graphs are
compiled through an AOTAutograd backend that runs as ``aot_eager`` and puts each graph
through inductor's own CUDA-graph predicates (``fasttorch.compat.cudagraph_check_backend``),
so a laptop tells what an H100 would do with ``mode="reduce-overhead"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from fasttorch import _compat as compat
from fasttorch.optim._base import cpu_as_gpu
from fasttorch.state import TrainState
from fasttorch.steps import Step

__all__ = ["CudagraphReport", "check_cudagraphs"]


@attrs.frozen
class CudagraphReport:
    """What CUDA graphs would do with one compiled graph of a step.

    Attributes:
        name: the step's function the graph comes from: ``"full"`` (a whole step),
            ``"micro"`` and ``"close"`` (a ``grad_accumulate`` window's microbatch and
            update), or the function's own name.
        kind: ``"inference"`` (a graph with no autograd across its boundary, as every
            fasttorch step's), ``"forward"`` or ``"backward"``.
        captured: inductor's checks find no reason to skip CUDA graphs.
        reasons: every reason they give, in inductor's own words.
        notes: what would make the graph record again after capture: symbolic shapes
            (one recording per distinct size), static inputs that moved between calls.
        inputs, static_inputs, mutated_inputs: the graph's inputs, those with a fixed
            address (parameters, marked tensors), and those it writes to without one.
        calls: how many times the graph ran.
    """

    name: str
    kind: str
    captured: bool
    reasons: tuple[str, ...]
    notes: tuple[str, ...]
    inputs: int
    static_inputs: int
    mutated_inputs: int
    calls: int

    @property
    def ok(self) -> bool:
        """Captured, and replayed without recording again."""
        return self.captured and not self.notes


def check_cudagraphs(
    step: Any,
    state: TrainState,
    batches: Sequence[Any],
    *,
    between: Callable[[TrainState], TrainState] | None = None,
) -> list[CudagraphReport]:
    """Compile ``step``'s graphs and report, per graph, whether CUDA graphs capture it.

    Runs ``step`` over ``batches`` (on a copy of ``state``: the given state is left as
    it is) with every graph compiled as ``compiled(step, mode="reduce-overhead")``
    would compile it, up to code generation: the same AOTAutograd graphs and metadata,
    judged by inductor's own predicates (mutated inputs that are not static, input
    storage mutation, ops incompatible with CUDA graphs, tensors on several devices or
    on the CPU, non-tensor inputs, symbolic shapes). It runs on any device, the CPU
    included: tensors on the state's device are taken for CUDA tensors, so a tensor that
    a GPU run would keep on the CPU (a ``torch.tensor(...)`` built without a device
    inside the loss function) is only seen when the state is on a GPU. A graph that is
    compiled again (a recompile) gets a report of its own.

    The plain PyTorch equivalent is to train on a GPU under ``torch.compile(...,
    mode="reduce-overhead")`` and read ``torch._dynamo.utils.counters["inductor"]
    ["cudagraph_skips"]`` and inductor's "skipping cudagraphs due to ..." log lines.

    Args:
        step: a :class:`fasttorch.Step` (compiled or not: its compile options are
            kept, its backend replaced) or any ``(state, batch)`` callable.
        state: the initial state (copied; not donated).
        batches: the batches to run, at least one (two or more show re-recording:
            static inputs that move, sizes that change).
        between: called with the state between two calls, as your loop does between
            steps (``lambda s: s.replace(opt_state=set_hyperparams(...))``); returns
            the state for the next call.

    Returns:
        One :class:`CudagraphReport` per compiled graph, in compile order.

    Example:
        >>> import torch, fasttorch
        >>> from fasttorch.testing import check_cudagraphs
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.adamw(0.1))
        >>> reports = check_cudagraphs(fasttorch.step(loss_fn), state, [torch.randn(8, 4)] * 2)
        >>> [(r.name, r.captured, r.mutated_inputs) for r in reports]
        [('full', True, 0)]
    """
    if len(batches) < 1:
        raise ValueError("check_cudagraphs: give at least one batch, got none")
    if not isinstance(state, TrainState):
        raise TypeError(
            f"check_cudagraphs expects a fasttorch.TrainState, got {type(state).__name__}"
        )
    found: list[tuple[str, list[compat.CudagraphVerdict]]] = []
    run = _checked(step, state.device.type, found)
    copy = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
    # A GPU step's form: no opaque update, which only a CPU step runs (optim's kernels).
    with cpu_as_gpu():
        for i, batch in enumerate(batches):
            if i > 0 and between is not None:
                copy = between(copy)
            copy, _ = run(copy, batch)
    return [_report(name, v) for name, verdicts in found for v in verdicts]


def _checked(
    step: Any, device_type: str, found: list[tuple[str, list[compat.CudagraphVerdict]]]
) -> Callable[..., Any]:
    """``step`` with each of its functions compiled through the judging backend."""
    from fasttorch.transforms.compiled import Compiler, GraphCall, compile_step_fn

    def jit(fn: Callable[..., Any], *, cpp_wrapper: bool = False) -> Callable[..., Any]:
        name = getattr(getattr(fn, "func", fn), "__name__", "fn").lstrip("_")
        verdicts: list[compat.CudagraphVerdict] = []
        found.append((name, verdicts))
        backend = compat.cudagraph_check_backend(verdicts, assume_cuda=device_type)
        return compile_step_fn(fn, static_state=static, backend=backend, **options)

    options: dict[str, Any] = {"fullgraph": True, "dynamic": None}
    if not isinstance(step, Step):
        static = False
        return jit(step)
    static = step.donate
    if isinstance(step.jit, Compiler):
        options = {
            k: step.jit.options[k]
            for k in ("fullgraph", "dynamic", "regions")
            if k in step.jit.options
        }
        return attrs.evolve(step, jit=jit)
    runner = step.runner if isinstance(step.runner, GraphCall) else GraphCall(step.runner)
    return attrs.evolve(step, jit=jit, runner=runner, transforms=(*step.transforms, "compiled"))


def _report(name: str, v: compat.CudagraphVerdict) -> CudagraphReport:
    notes = []
    if v.dynamic:
        notes.append(
            "symbolic shapes: CUDA graph trees record this graph once per distinct size "
            "(and inductor skips it with config.triton.cudagraph_skip_dynamic_graphs)"
        )
    if v.moved_static:
        notes.append(
            f"static inputs moved on {v.moved_static} of {v.calls} calls: each move "
            "records the CUDA graph again (inductor stops after "
            "config.triton.cudagraph_unexpected_rerecord_limit). Donate the state and "
            "set hyperparameters with set_hyperparams(..., in_place=True)"
        )
    return CudagraphReport(
        name=name,
        kind=v.kind,
        captured=not v.reasons,
        reasons=tuple(v.reasons),
        notes=tuple(notes),
        inputs=v.inputs,
        static_inputs=v.static_inputs,
        mutated_inputs=v.mutated_inputs,
        calls=v.calls,
    )
