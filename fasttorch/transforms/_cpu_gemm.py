"""bf16/fp16 matrix products on CPUs without bf16/fp16 units, computed in float32.

On an x86 CPU without AVX512-BF16 or AMX, ATen computes a bf16 matrix product by
widening to float32 inside its kernel, and does so several times slower than a float32
product of the same shape (fp16 without AMX-FP16/AVX512-FP16, dozens of times slower).
The product of two bf16 (or fp16) numbers is exact in float32, and both kernels
accumulate in float32 and round the result once, so computing ``mm(a.float(),
b.float()).to(bf16)`` gives the same values up to the order of the float32 sums, as any
two GEMM libraries do. :class:`HalfGemmInFloat32` is an inductor graph pass that makes
that rewrite for the CPU nodes of a compiled graph; inductor then fuses the widening
into the kernels that produce the operands.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["CpuGemm", "HalfGemmInFloat32", "half_gemm_dtypes", "native_cpu_gemm"]

CpuGemm = Literal["auto", "fp32", "native"]
_HALF = (torch.bfloat16, torch.float16)
_aten = torch.ops.aten
_prims = torch.ops.prims
# The matrix products of a post-grad graph (nn.Linear is addmm/mm, attention's
# projections bmm); scaled_dot_product_attention keeps its own kernel.
_GEMMS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default)


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
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    if dtype == torch.float16:
        flags = _cpu_flags()
        if not flags:
            return True
        return bool(torch.cpu._is_amx_fp16_supported()) or "avx512_fp16" in flags
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


class HalfGemmInFloat32(CustomGraphPass):
    """Rewrite ``mm``/``addmm``/``bmm``/``baddbmm`` of ``dtypes`` on CPU to float32.

    Each product becomes ``convert(op(convert(x, float32), ...), dtype)``: the same
    inputs, one rounding of the result, the same output dtype. Nodes on other devices
    and of other dtypes are left as they are. Each source tensor is widened once, where
    it is made, and shared by its products.

    A compiled training step's graph holds the forward and the backward, and the
    backward's weight-gradient products read activations the forward made. Their
    float32 copies would live from the forward to the backward, twice the bytes of the
    bf16 ones. So by default a product that meets a source an earlier product used is
    left in bf16, unless the source is a weight (one float32 copy per weight); with
    ``every=True`` every product is widened (faster, with those copies kept).

    ``uuid`` covers this file and the settings, so inductor's graph cache tells
    rewritten graphs from others.
    """

    # A step whose tensors are all on a GPU is compiled without this pass (see
    # fasttorch.steps._without_cpu_only_passes), nor the rounding option it set.
    cpu_only = True

    def __init__(
        self, dtypes: Iterable[torch.dtype], *, every: bool = False, set_emulate: bool = False
    ) -> None:
        self.dtypes = tuple(dtypes)
        self.every = every
        self.set_emulate = set_emulate  # compiled turned emulate_precision_casts on for it

    def __call__(self, graph: torch.fx.Graph) -> None:
        wide: dict[torch.fx.Node, torch.fx.Node] = {}  # source -> its float32 copy
        seen: set[torch.fx.Node] = set()  # sources some earlier product used
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _GEMMS:
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
                continue
            if val.dtype not in self.dtypes:
                continue
            sources = [_source(a, val.dtype)[0] for a in node.args if _is(a, val.dtype)]
            # A source an earlier product used (the forward's activation, met again by
            # the weight-gradient product in the backward) stays in bf16 unless it is a
            # weight: its float32 copy would be kept from the forward to the backward.
            if not self.every and any(s in seen and not _is_weight(s) for s in sources):
                continue
            seen.update(sources)
            with graph.inserting_before(node):
                args = tuple(_widen(graph, a, val.dtype, node, wide) for a in node.args)
                out = graph.call_function(node.target, args, dict(node.kwargs))
                out.meta["val"] = val.to(torch.float32)
                down = graph.call_function(_prims.convert_element_type.default, (out, val.dtype))
                down.meta["val"] = val
            node.replace_all_uses_with(down)
            graph.erase_node(node)
        graph.eliminate_dead_code()

    def uuid(self) -> Any:
        extra = ",".join(map(str, self.dtypes)) + f",every={self.every}"
        return get_hash_for_files((__file__,), extra=extra)


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
    gemm: torch.fx.Node,
    wide: dict[torch.fx.Node, torch.fx.Node],
) -> Any:
    """``arg`` in float32: one widening per source tensor, shared by all its products.

    A source used by the forward and the backward (a weight, a saved activation) gets
    one float32 copy made where the source is made. A copy per use would let inductor
    fuse every copy into the kernel that makes the source, and keep them all (one per
    layout) alive from the forward to the backward.
    """
    if not isinstance(arg, torch.fx.Node) or not _is(arg, dtype):
        return arg
    src, views = _source(arg, dtype)
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
        with graph.inserting_before(gemm):
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


def _is_weight(src: torch.fx.Node) -> bool:
    """A low-precision copy of a graph input (under autocast: of a parameter)."""
    if src.op == "placeholder":
        return True
    base = src.args[0] if src.target == _prims.convert_element_type.default else None
    return isinstance(base, torch.fx.Node) and base.op == "placeholder"


def _is(node: Any, dtype: torch.dtype) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == dtype
