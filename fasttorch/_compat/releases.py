"""Release checks: what can only be told from torch's version number.

Each says why there is no feature to detect instead.
"""

from __future__ import annotations

import torch

__all__ = [
    "AUTOGRAD_GRAD_IN_GRAPH",
    "cpu_gemm_pass_works",
]


def _release() -> tuple[int, ...]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


# Whether dynamo traces the eager gradient path (detached leaves with requires_grad_(),
# then torch.autograd.grad) inside a graph. A release check: the only test is to compile
# one, which cannot happen while the step itself is being traced. 2.11's dynamo refuses
# Tensor.requires_grad_() (graph break gb0125) and 2.10's refuses torch.autograd.grad;
# 2.12 and later trace both. Read as a constant by the gradient phase.
AUTOGRAD_GRAD_IN_GRAPH = _release() >= (2, 12)


def cpu_gemm_pass_works() -> bool:
    """Whether this inductor builds ``compiled``'s float32 CPU matrix-product pass right.

    Why a release check: there is no feature to detect. Inductor 2.10's C++ codegen
    fails on the pass with ``emulate_precision_casts`` (``CppVecOverrides.to_dtype()``
    lacks ``use_compute_types``); 2.11 and 2.12 build it but their compiled step
    differs from the hand-written loop by ~2e-2 (2.6e-4 on 2.15), a rounding
    difference whose cause was not found. 2.13 is the first release tested good.
    """
    return _release() >= (2, 13)
