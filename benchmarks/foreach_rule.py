"""CUDA's rule for a ``_foreach_*`` call's multi-tensor path, checked on any device.

On CUDA a ``_foreach_*`` op runs one kernel over all its tensors (the "fast route")
only when ATen's ``check_fast_path_restrictions`` holds, else one kernel per tensor
(aten/src/ATen/native/ForeachUtils.h, cuda/ForeachBinaryOpScalarTensor.cu):

* every tensor of every list has the first tensor's dtype and device, strided,
  non-overlapping and dense;
* corresponding tensors across the lists have the same sizes and strides;
* a 0-d tensor operand (``_foreach_mul_(list, t)``) has the lists' dtype (a CPU one is
  read to the host instead; on a GPU the state's scalars live on the device);
* a float Python scalar with an integer or bool list, or a division of an integer
  list, promotes: slow.

:class:`ForeachLint` applies these to every ``_foreach_*`` call it sees, on whatever
device the tensors are, so a CPU run tells what a GPU run would launch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _is_tensor_list(x: Any) -> bool:
    return (
        isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, torch.Tensor) for t in x)
    )


def _dense(t: torch.Tensor) -> bool:
    # Non-overlapping and dense: a permutation of a contiguous layout.
    if t.layout != torch.strided:
        return False
    dims = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in dims:
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def slow_reason(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why the ``_foreach_*`` op ``name`` would take CUDA's per-tensor path, or None."""
    operands = [*args, *kwargs.values()]
    lists = [list(a) for a in operands if _is_tensor_list(a)]
    if not lists:
        return None
    first = lists[0][0]
    for ts in lists:
        if len(ts) != len(lists[0]):
            return "lists of different lengths"
        for t, ref in zip(ts, lists[0]):
            if t.dtype != first.dtype:
                return f"a {t.dtype} tensor in a {first.dtype} call"
            if t.device != first.device:
                return "tensors on different devices"
            if not _dense(t):
                return "a tensor that is not dense"
            if t.shape != ref.shape:
                return f"shapes differ across lists ({tuple(ref.shape)} vs {tuple(t.shape)})"
            if t.stride() != ref.stride():
                return "strides differ across lists"
    integral = not first.is_floating_point() and not first.is_complex()
    for a in operands:
        if isinstance(a, torch.Tensor):
            if a.dtype != first.dtype:
                return f"a {a.dtype} 0-d tensor scalar with {first.dtype} lists"
        elif isinstance(a, float) and integral:
            return "a float scalar with integer lists"
    if integral and "div" in name:
        return "a division of integer lists"
    return None


class ForeachLint(TorchDispatchMode):
    """Records every ``_foreach_*`` call that CUDA would run one tensor at a time.

    Attributes:
        slow: (op name, reason, number of tensors) per slow call, in order.
        calls: how many times each ``_foreach_*`` / ``_fused_*`` op was called.
    """

    def __init__(self) -> None:
        super().__init__()
        self.slow: list[tuple[str, str, int]] = []
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name.startswith(("_foreach_", "_fused_")):
            self.calls[str(func)] += 1
        if name.startswith("_foreach_"):
            reason = slow_reason(name, args, kwargs)
            if reason is not None:
                n = len(next(a for a in args if _is_tensor_list(a)))
                self.slow.append((str(func), reason, n))
        return func(*args, **kwargs)
