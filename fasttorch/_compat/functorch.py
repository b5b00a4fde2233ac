"""functorch (``torch.func``): vmap batching rules for the foreach kernels
(``fasttorch.vmapped``), and whether code runs inside a ``torch.func`` transform.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "in_functorch_transform",
    "register_foreach_batching",
]


_FOREACH_BATCHING: list[Any] = []  # the Library holding the rules, once registered


def register_foreach_batching(per_tensor: Any) -> None:
    """Give every ``aten::_foreach_*`` overload a vmap batching rule: ``per_tensor``.

    Why: functorch has no batching rule, and no fallback, for the foreach kernels
    ("Batching rule not implemented for aten::_foreach_mul.Scalar. We could not
    generate a fallback"), which fasttorch's optimizers, clipping, accumulation and EMA
    call; a population runs them under ``torch.func.vmap``. ``per_tensor(op, args,
    kwargs)`` runs one as the per-tensor ops it stands for, which vmap batches. The
    rule is registered at the ``FuncTorchBatched`` dispatch key (a key name, through
    the public ``torch.library.Library``), so it applies in eager mode and while
    ``torch.compile`` traces a vmapped function with fake tensors alike (a
    ``TorchFunctionMode`` is not consulted there). It only adds rules where vmap had
    none: foreach calls outside vmap are untouched. Upstream: functorch's
    ``BatchRulesDecompositions.cpp`` lists no ``_foreach_*`` op (torch 2.10 to 2.13).
    Registered once per process.
    """
    if _FOREACH_BATCHING:
        return
    lib = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    for name in dir(torch):
        packet = getattr(torch.ops.aten, name, None) if name.startswith("_foreach_") else None
        if packet is None:
            continue
        op = name.removeprefix("_foreach_")
        for overload in packet.overloads():
            qualified = name if overload == "default" else f"{name}.{overload}"

            def rule(*args: Any, _op: str = op, **kwargs: Any) -> Any:
                return per_tensor(_op, args, kwargs)

            lib.impl(qualified, rule, "FuncTorchBatched")  # type: ignore[no-untyped-call]
    _FOREACH_BATCHING.append(lib)


def in_functorch_transform() -> bool:
    """Whether the code runs inside a ``torch.func`` transform (``vmap``, ``grad``).

    Why: the eager optimizers read a few hyperparameters to the host once per change
    (CUDA's fused kernels and ``_foreach_lerp_``'s fast route take Python floats); under
    ``torch.func.vmap`` those tensors hold one value per member and cannot be read
    (``.item()`` of a batched tensor raises), so the tensor form is used there. torch
    has no public query; ``torch._C._functorch.peek_interpreter_stack`` is what
    ``torch._functorch`` itself consults (torch/_functorch/pyfunctorch.py). Where it is
    missing, False: the read then raises vmap's own error.
    """
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
