"""bf16/fp16 matrix products on CPUs without bf16/fp16 units, computed in float32.

On an x86 CPU without AVX512-BF16 or AMX, ATen computes a bf16 matrix product by
widening to float32 inside its kernel, and does so several times slower than a float32
product of the same shape (fp16 without AMX-FP16/AVX512-FP16, dozens of times slower).
The product of two bf16 (or fp16) numbers is exact in float32, and both kernels
accumulate in float32 and round the result once, so computing ``mm(a.float(),
b.float()).to(bf16)`` gives the same values up to the order of the float32 sums, as any
two GEMM libraries do. CPU attention in bf16 is slower still (its backward most), and
is run in float32 the same way. :class:`HalfGemmInFloat32` is an inductor graph pass
that makes that rewrite for the CPU nodes of a compiled graph.
"""

from __future__ import annotations

import functools
import operator
import platform
from collections.abc import Iterable
from typing import Any, Literal

import torch

from fasttorch import _compat

__all__ = ["CpuGemm", "HalfGemmInFloat32", "half_gemm_dtypes", "native_cpu_gemm"]

CpuGemm = Literal["auto", "fp32", "native"]
_HALF = (torch.bfloat16, torch.float16)
_aten = torch.ops.aten
_prims = torch.ops.prims
# The matrix products of a post-grad graph (nn.Linear is addmm/mm, attention's
# projections bmm), and CPU attention's own kernels, forward and backward.
_GEMMS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default)
_ATTENTION = _compat.CPU_ATTENTION
_ATTENTION_BACKWARD = _compat.CPU_ATTENTION_BACKWARD


@torch.library.custom_op("fasttorch::widen", mutates_args=())
def widen(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, as an extern call: inductor fuses it into no kernel.

    The CPU matrix-product pass widens an activation again right before a later use
    with it, so that no float32 copy lives from the forward to the backward. A custom
    op, not an ATen one: an ATen op without a C shim makes inductor's C++ wrapper warn
    at every compile, and the proxy executor calls both alike.
    """
    return x.to(torch.float32)


@widen.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32)


_REWRITTEN = frozenset((*_GEMMS, _ATTENTION, _ATTENTION_BACKWARD))


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def native_cpu_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions for ``dtype`` (bf16, fp16) matrix products.

    Only x86 CPUs are judged: anything else (or an x86 CPU whose flags cannot be read)
    counts as native, so that ``cpu_gemm="auto"`` leaves it alone.
    """
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    if dtype == torch.bfloat16:
        return _compat.cpu_has_bf16_units()
    if dtype == torch.float16:
        flags = _cpu_flags()
        if not flags:
            return True
        return _compat.cpu_has_amx_fp16() or "avx512_fp16" in flags
    return True


def half_gemm_dtypes(cpu_gemm: CpuGemm) -> tuple[torch.dtype, ...]:
    """The dtypes whose CPU matrix products ``cpu_gemm`` computes in float32."""
    if cpu_gemm == "native":
        return ()
    if cpu_gemm == "fp32":
        return _HALF
    if cpu_gemm == "auto":
        return tuple(d for d in _HALF if not native_cpu_gemm(d))
    raise ValueError(f"cpu_gemm must be 'auto', 'fp32' or 'native', got {cpu_gemm!r}")


class HalfGemmInFloat32(_compat.CustomGraphPass):  # type: ignore[misc]
    """Compute the bf16/fp16 matrix products and attention of CPU nodes in float32.

    Each ``mm``/``addmm``/``bmm``/``baddbmm`` of ``dtypes`` on CPU becomes
    ``convert(op(convert(x, float32), ...), dtype)``: the same inputs, one rounding of
    the result, the same output dtype. CPU attention
    (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) is run in float32
    the same way, its outputs rounded once. Nodes on other devices and of other dtypes
    are left as they are.

    A compiled training step's graph holds the forward and the backward, and the
    backward reads activations the forward made (the weight-gradient products, the
    attention backward's query, key, value and output). A float32 copy made with the
    activation would live from the forward to the backward, twice the bytes of the bf16
    one, and inductor fuses any widening into the kernel that makes its source. So:

    * a source's first use widens it once, where it is made;
    * each later use of a source (an activation, or a weight's low-precision copy, met
      again in the backward) widens it again right before that use, with
      :func:`widen`, an extern call inductor cannot fuse into the forward, so the copy
      lives only for that product.

    The step's peak memory is then that of bf16, plus the one widened operand in use.

    ``uuid`` covers this file and the settings, so inductor's graph cache tells
    rewritten graphs from others.
    """

    # A step whose tensors are all on a GPU is compiled without this pass (see
    # fasttorch._compile.inductor_options._without_cpu_only_passes), nor the
    # rounding option it set.
    cpu_only = True

    def __init__(self, dtypes: Iterable[torch.dtype], *, set_emulate: bool = False) -> None:
        self.dtypes = tuple(dtypes)
        self.set_emulate = set_emulate  # compiled turned emulate_precision_casts on for it
        self.unavailable: str | None = None  # why this torch cannot run it, if it cannot

    def __call__(self, graph: torch.fx.Graph) -> None:
        wide: dict[torch.fx.Node, torch.fx.Node] = {}  # source -> its float32 copy
        seen: set[torch.fx.Node] = set()  # sources an earlier rewritten node used
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            val = node.meta.get("val")
            first = val[0] if isinstance(val, (tuple, list)) and val else val
            if not isinstance(first, torch.Tensor) or first.device.type != "cpu":
                continue
            dtype = first.dtype
            if dtype not in self.dtypes:
                continue
            if node.target not in _REWRITTEN:
                continue
            if not isinstance(val, torch.Tensor) and any(
                u.target is not operator.getitem for u in node.users
            ):
                continue  # outputs read other than by getitem: left as they are
            sources = [_source(a, dtype)[0] for a in node.args if _is(a, dtype)]
            # A later use of a source (the backward's use of an activation or a weight,
            # the attention backward's query, key, value and output) widens it again.
            if node.target is _ATTENTION_BACKWARD:
                again = {_source(a, dtype)[0] for a in node.args[1:5] if _is(a, dtype)}
            else:
                again = {s for s in sources if s in seen}
            seen.update(sources)
            with graph.inserting_before(node):
                args = tuple(_widen(graph, a, dtype, node, wide, again) for a in node.args)
                kwargs = {
                    k: _widen(graph, v, dtype, node, wide, again) for k, v in node.kwargs.items()
                }
                wide_node = graph.call_function(node.target, args, kwargs)
            _replace_outputs(graph, node, wide_node, dtype)
        graph.eliminate_dead_code()

    def uuid(self) -> Any:
        return _compat.graph_pass_hash((__file__,), ",".join(map(str, self.dtypes)))


def _replace_outputs(
    graph: torch.fx.Graph, node: torch.fx.Node, wide_node: torch.fx.Node, dtype: torch.dtype
) -> None:
    """Point ``node``'s users at ``wide_node``'s outputs, rounded back to ``dtype``."""
    val = node.meta["val"]
    if isinstance(val, torch.Tensor):
        wide_node.meta["val"] = _float32(val, dtype)
        with graph.inserting_after(wide_node):
            down = graph.call_function(_prims.convert_element_type.default, (wide_node, dtype))
        down.meta["val"] = val
        node.replace_all_uses_with(down)
    else:  # a tuple of outputs, read with getitem
        wide_node.meta["val"] = tuple(_float32(v, dtype) for v in val)
        for user in list(node.users):  # getitem nodes (checked by the caller)
            i = user.args[1]
            with graph.inserting_before(user):
                item = graph.call_function(operator.getitem, (wide_node, i))
                item.meta["val"] = wide_node.meta["val"][i]
                out = item
                if _is(user, dtype):
                    out = graph.call_function(_prims.convert_element_type.default, (item, dtype))
                    out.meta["val"] = user.meta["val"]
            user.replace_all_uses_with(out)
            graph.erase_node(user)
    graph.erase_node(node)


def _float32(val: Any, dtype: torch.dtype) -> Any:
    if isinstance(val, torch.Tensor) and val.dtype == dtype:
        return val.to(torch.float32)
    return val


# Views a product's operand may reach it through; the widening is made once at their
# source and the views are replayed on the float32 tensor.
_VIEWS = frozenset(
    {
        _aten.permute.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.view.default,
        _aten.reshape.default,
        _aten.expand.default,
        _aten.unsqueeze.default,
        _aten.squeeze.dim,
        _aten.alias.default,
    }
)


def _widen(
    graph: torch.fx.Graph,
    arg: Any,
    dtype: torch.dtype,
    node: torch.fx.Node,
    wide: dict[torch.fx.Node, torch.fx.Node],
    again: set[torch.fx.Node],
) -> Any:
    """``arg`` in float32, as a view of its source's float32 copy.

    A source's first use widens it once, where it is made, and later uses share that
    copy. A source in ``again`` (an activation the forward made, used again in the
    backward) is widened right before ``node`` by an extern call inductor cannot fuse
    into the kernel that made it, so the copy is not kept from the forward on.
    """
    if not isinstance(arg, torch.fx.Node) or not _is(arg, dtype):
        return arg
    src, views = _source(arg, dtype)
    if src in again:
        with graph.inserting_before(node):
            out = graph.call_function(torch.ops.fasttorch.widen.default, (src,))
        out.meta["val"] = src.meta["val"].to(torch.float32)
    else:
        if src not in wide:
            anchor = src
            if src.op == "placeholder":  # after every placeholder
                anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
            with graph.inserting_after(anchor):
                w = graph.call_function(_prims.convert_element_type.default, (src, torch.float32))
            w.meta["val"] = src.meta["val"].to(torch.float32)
            wide[src] = w
        out = wide[src]
    for v in reversed(views):
        op: Any = v.target
        with graph.inserting_before(node):
            view = graph.call_function(op, (out, *v.args[1:]), dict(v.kwargs))
        view.meta["val"] = op(out.meta["val"], *v.args[1:], **v.kwargs)
        out = view
    return out


def _source(arg: torch.fx.Node, dtype: torch.dtype) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The tensor ``arg`` is a view of, and the views from it to ``arg`` (outermost first)."""
    views = []
    src = arg
    while src.op == "call_function" and src.target in _VIEWS:
        base = src.args[0]
        if not (isinstance(base, torch.fx.Node) and _is(base, dtype)):
            break
        views.append(src)
        src = base
    return src, views


def _is(node: Any, dtype: torch.dtype) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == dtype
