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
    and of other dtypes are left as they are. ``uuid`` covers this file and the dtypes,
    so inductor's graph cache tells rewritten graphs from others.
    """

    def __init__(self, dtypes: Iterable[torch.dtype]) -> None:
        self.dtypes = tuple(dtypes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _GEMMS:
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
                continue
            if val.dtype not in self.dtypes:
                continue
            with graph.inserting_before(node):
                args = tuple(_widen(graph, a, val.dtype) for a in node.args)
                wide = graph.call_function(node.target, args, dict(node.kwargs))
                wide.meta["val"] = val.to(torch.float32)
                out = graph.call_function(_prims.convert_element_type.default, (wide, val.dtype))
                out.meta["val"] = val
            node.replace_all_uses_with(out)
            graph.erase_node(node)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,), extra=",".join(map(str, self.dtypes)))


def _widen(graph: torch.fx.Graph, arg: Any, dtype: torch.dtype) -> Any:
    if not isinstance(arg, torch.fx.Node):
        return arg
    val = arg.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != dtype:
        return arg
    wide = graph.call_function(_prims.convert_element_type.default, (arg, torch.float32))
    wide.meta["val"] = val.to(torch.float32)
    return wide
