"""An inductor graph pass for graphs with regions: region outputs that alias its inputs.

A region's forward subgraph returns the tensors its backward needs, and among them are
often its own inputs, or views of them: a LayerNorm's or a linear layer's ``x``, a
weight transposed twice. The graph that calls the region takes each output for a new
buffer, so inductor's wrapper (torch 2.13) frees the input after the call while the
output still points at its memory: with ``allow_buffer_reuse`` a later buffer is
allocated over it, with ``inplace_buffers`` a later kernel writes into it (``h = h +
block(h)``), and the backward reads a changed input (docs/design.md, "Regions and
aliases").

:class:`RegionAliases` rewrites the calling graph so that it does not read such an
output: its users read the input itself, through the same views, applied in the
calling graph. Inductor then sees the input live for as long as the output was used and
neither frees nor overwrites it; the region's code is unchanged. Where a view cannot be
repeated outside the region (a size computed inside it), the region returns a copy of
the view instead: the one case that copies a tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

import torch

from fasttorch import _compat

__all__ = ["RegionAliases", "aliased_outputs"]

_INVOKE = torch.ops.higher_order.invoke_subgraph
_clone = torch.ops.aten.clone.default


def _is_view(node: Any) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and getattr(node.target, "is_view", False) is True
    )


def _placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _outputs(graph: torch.fx.Graph) -> list[Any]:
    return list(cast(tuple, graph.output_node().args[0]))


def _view_chain(out: Any) -> tuple[list[torch.fx.Node], Any]:
    """The views from a subgraph's input to ``out`` (outermost first), and that input;
    ``([], None)`` where ``out`` is not a view of an input."""
    chain: list[torch.fx.Node] = []
    node = out
    while _is_view(node):
        chain.append(node)
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "placeholder":
        return chain, node
    return [], None


def aliased_outputs(sub: torch.fx.GraphModule) -> dict[int, tuple[list[torch.fx.Node], int]]:
    """The outputs of region graph ``sub`` that are its inputs or views of them: output
    index -> (the views, outermost first; the input's position)."""
    holders = _placeholders(sub.graph)
    found = {}
    for i, out in enumerate(_outputs(sub.graph)):
        chain, base = _view_chain(out)
        if base is not None:
            found[i] = (chain, holders.index(base))
    return found


def _repeat(
    graph: torch.fx.Graph, chain: list[torch.fx.Node], base: Any, operands: tuple[Any, ...]
) -> Any:
    """``chain``'s views applied to ``base`` in ``graph`` (at its insertion point), or
    ``None`` where one of them reads a value of the region other than an input."""
    for v in chain:
        for a in (*v.args[1:], *v.kwargs.values()):
            for leaf in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(leaf, torch.fx.Node) and leaf.op != "placeholder":
                    return None
    # A size the region takes as an input (a dynamic shape) is the caller's operand.
    holders = {h: operands[k] for k, h in enumerate(_placeholders(chain[0].graph))} if chain else {}

    def outer(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(outer(x) for x in a)
        return holders.get(a, a) if isinstance(a, torch.fx.Node) else a

    cur = base
    for v in reversed(chain):
        args = (cur, *(outer(a) for a in v.args[1:]))
        target = cast(Callable[..., Any], v.target)
        cur = graph.call_function(target, args, {k: outer(a) for k, a in v.kwargs.items()})
        cur.meta = dict(v.meta)
    return cur


def _copy_in_region(sub: torch.fx.GraphModule, i: int) -> None:
    """Region graph ``sub`` returns a copy of its ``i``-th output."""
    output = sub.graph.output_node()
    outs = _outputs(sub.graph)
    with sub.graph.inserting_before(output):
        copy = sub.graph.call_function(_clone, (outs[i],))
    val = outs[i].meta.get("val")
    copy.meta = {**outs[i].meta, "val": _clone(val) if isinstance(val, torch.Tensor) else val}
    outs[i] = copy
    output.args = (tuple(outs),)
    sub.recompile()


def _subgraph(gm: Any, call: torch.fx.Node) -> torch.fx.GraphModule:
    """The region graph ``call`` runs, checked to be called as torch 2.12-2.13 call it
    (``invoke_subgraph(graph, identifier, *operands)``): a pass that misread a call
    would leave its aliases in place, so a call of another form is an error."""
    first = call.args[0] if call.args else None
    named = isinstance(first, torch.fx.Node) and isinstance(first.target, str)
    sub = getattr(gm, cast(str, cast(torch.fx.Node, first).target), None) if named else None
    if (
        not isinstance(first, torch.fx.Node)
        or first.op != "get_attr"
        or not isinstance(sub, torch.fx.GraphModule)
        or len(_placeholders(sub.graph)) != len(call.args) - 2
    ):
        raise RuntimeError(
            f"compiled(regions=...): torch {torch.__version__} calls a nested compile "
            f"region as {call.format_node()}, which fasttorch's graph pass for regions "
            "(RegionAliases) does not know, and without it inductor can compute wrong "
            "gradients for regions. Pass regions=False"
        )
    return sub


class RegionAliases(_compat.CustomGraphPass):
    """Point the readers of a region's aliasing outputs at the region's inputs."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not _INVOKE:
                continue
            sub = _subgraph(gm, node)
            operands = tuple(node.args[2:])
            for i, (chain, k) in aliased_outputs(sub).items():
                items = [u for u in node.users if u.target is operator.getitem and u.args[1] == i]
                for item in items:
                    with graph.inserting_before(item):
                        same = _repeat(graph, chain, operands[k], operands)
                    if same is None:  # a view the calling graph cannot repeat
                        _copy_in_region(sub, i)
                        break
                    item.replace_all_uses_with(same)
                    graph.erase_node(item)

    def uuid(self) -> Any:
        return _compat.graph_pass_hash((__file__,), "")
