"""The update's arithmetic over every gradient as operators the compiler does not look into.

In a compiled CPU step that donates its state and whose optimizer runs opaque
(``adam(..., opaque=True)``: :func:`fasttorch.phases.opaque_update`), the rest of the
update over the gradients goes the same way: the accumulation window's mean, the global
norm and the clip's scaling are each one call of an operator below, whose body is the
eager step's own ``_foreach`` kernels. Inductor then neither traces nor generates code
per parameter tensor for them (at 12 layers, the per-tensor norms alone were a C++ kernel
of 300 KB that took 10 s to build), and eager and compiled steps give the same bits.

The operators write into the gradients they are given (the update owns them: the
window's sums, donated or a scratch buffer), as the eager step does.
``torch.library.custom_op`` is public API.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["foreach_div_", "foreach_mul_", "global_norm"]


def _norm_impl(tensors: list[Tensor]) -> Tensor:
    """``clip_grad_norm_``'s global norm: the norm of the per-tensor norms."""
    norm: Tensor = torch.linalg.vector_norm(torch.stack(list(torch._foreach_norm(tensors))))
    return norm


_norm_op = torch.library.custom_op("fasttorch::global_norm", _norm_impl, mutates_args=())


@_norm_op.register_fake
def _norm_fake(tensors: list[Tensor]) -> Tensor:
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return tensors[0].new_empty((), dtype=dtype)


def _mul_impl(tensors: list[Tensor], factor: Tensor) -> None:
    torch._foreach_mul_(tensors, factor)


def _div_impl(tensors: list[Tensor], divisor: Tensor) -> None:
    torch._foreach_div_(tensors, divisor)


_mul_op = torch.library.custom_op("fasttorch::foreach_mul_", _mul_impl, mutates_args=("tensors",))
_div_op = torch.library.custom_op("fasttorch::foreach_div_", _div_impl, mutates_args=("tensors",))


@_mul_op.register_fake
def _mul_fake(tensors: list[Tensor], factor: Tensor) -> None:
    """Nothing to compute: the operator writes into its arguments and returns nothing."""


@_div_op.register_fake
def _div_fake(tensors: list[Tensor], divisor: Tensor) -> None:
    """Nothing to compute: the operator writes into its arguments and returns nothing."""


def global_norm(tensors: list[Tensor]) -> Tensor:
    """The global L2 norm of ``tensors`` (at least one), as one operator."""
    out: Tensor = torch.ops.fasttorch.global_norm(tensors)
    return out


def foreach_mul_(tensors: list[Tensor], factor: Tensor) -> None:
    """``tensors *= factor`` (a 0-d tensor), in place, as one operator."""
    torch.ops.fasttorch.foreach_mul_(tensors, factor)


def foreach_div_(tensors: list[Tensor], divisor: Tensor) -> None:
    """``tensors /= divisor`` (a 0-d tensor), in place, as one operator."""
    torch.ops.fasttorch.foreach_div_(tensors, divisor)
