"""The update's arithmetic over every gradient as operators the compiler does not look into.

In a step that donates its state on a CPU and whose optimizer runs opaque (``adam(...,
opaque=True)``: :func:`fasttorch.phases.opaque_update`), the optimizer's one pass, torch's
fused CPU kernel, divides out the factor the gradients carry: the accumulation window's
total weight and the clip's coefficient are folded into it, not passes of their own.
What is left over the gradients, in a compiled step, is an operator below each: the
global norm, and a scaling where the optimizer cannot take the factor (an optimizer
beside it in ``groups`` that cannot, parameters the loss did not reach). Their bodies
are the eager step's own ``_foreach`` kernels. Inductor then neither traces nor
generates code per parameter tensor for them (at 12 layers, the per-tensor norms alone
were a C++ kernel of 300 KB that took 10 s to build), and eager and compiled steps give
the same bits.

The multiply writes into the gradients it is given (the update owns them: the window's
sums, donated or a scratch buffer), as the eager step does. ``torch.library`` is public
API.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fasttorch.optim._base import cpu_operator

__all__ = ["foreach_mul_", "global_norm"]


def _norm_impl(tensors: list[Tensor]) -> Tensor:
    """``clip_grad_norm_``'s global norm: the norm of the per-tensor norms."""
    norm: Tensor = torch.linalg.vector_norm(torch.stack(list(torch._foreach_norm(tensors))))
    return norm


def _mul_impl(tensors: list[Tensor], factor: Tensor) -> None:
    torch._foreach_mul_(tensors, factor)


def _norm_fake(tensors: list[Tensor]) -> Tensor:
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return tensors[0].new_empty((), dtype=dtype)


def _mul_fake(tensors: list[Tensor], factor: Tensor) -> None:
    """Nothing to compute: the operator writes into its arguments and returns nothing."""


# CPU kernels only (optim._base.cpu_operator says why not custom_op).
cpu_operator("global_norm(Tensor[] tensors) -> Tensor", _norm_impl, _norm_fake)
cpu_operator("foreach_mul_(Tensor(a!)[] tensors, Tensor factor) -> ()", _mul_impl, _mul_fake)


def global_norm(tensors: list[Tensor]) -> Tensor:
    """The global L2 norm of ``tensors`` (at least one), as one operator."""
    out: Tensor = torch.ops.fasttorch.global_norm(tensors)
    return out


def foreach_mul_(tensors: list[Tensor], factor: Tensor) -> None:
    """``tensors *= factor`` (a 0-d tensor), in place, as one operator."""
    torch.ops.fasttorch.foreach_mul_(tensors, factor)
