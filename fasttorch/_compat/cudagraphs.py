"""CUDA graphs: what fasttorch does so that ``mode="reduce-overhead"`` captures a donated
step, and the check that proves it on any device (``fasttorch.testing.check_cudagraphs``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CudagraphVerdict",
    "cudagraph_check_backend",
    "cudagraph_skips",
    "is_static_address",
    "mark_static_addresses",
]


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
