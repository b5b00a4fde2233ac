"""Numbers and trees the phases and the window share: constants, norms, aux sums.

Small helpers with no notion of a step: a 0-d constant cached in eager mode, the loss
scale's reciprocal, gradients scaled and their global norm as ``torch.optim`` computes
them, a window's weighted ``aux`` sums, and a batch's size and description. Transform
authors import the public ones from :mod:`fasttorch.phases`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import torch
import torch.utils._pytree as pytree

from fasttorch import _opaque
from fasttorch.optim._base import computed_once, in_cpu_graph

__all__ = [
    "add_weighted_aux",
    "batch_size",
    "constant",
    "describe",
    "divide_aux",
    "global_norm",
    "reciprocal",
    "scale_grads",
]

Batch: TypeAlias = Any
Tensors: TypeAlias = dict[str, torch.Tensor]


_CONSTANTS: dict[tuple[float, torch.dtype, torch.device, bool], torch.Tensor] = {}


def constant(x: float, *, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` as a 0-d tensor; in eager mode the same tensor each time.

    Nothing is allocated per step for a sample count or a ``1/n``, and an eager window
    sees by identity, not by reading values, that its microbatches weigh the same, so
    it skips multiplying and dividing by factors that are exactly 1. A tensor that
    anything wrote into (its version moved) is replaced.
    """
    if torch.compiler.is_compiling():
        return torch.tensor(x, dtype=dtype, device=device)
    key = (x, dtype, device, torch.is_inference_mode_enabled())
    t = _CONSTANTS.get(key)
    if t is None or t._version != 0:
        if len(_CONSTANTS) >= 256:
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = torch.tensor(x, dtype=dtype, device=device)
    return t


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` computed as ``GradScaler`` does (in float64, then float32)."""
    return scale.double().reciprocal().float()


def scale_grads(
    grads: Mapping[str, torch.Tensor], factor: torch.Tensor, *, opaque: bool = False
) -> Tensors:
    """``grads`` times ``factor``: in place in eager mode (the update phase owns them).

    In a graph, out of place: an in-place multiply of a graph input (the accumulation
    window's gradients) would be written back into it, a copy of every gradient for
    nothing. The same multiplication either way, so the same bits. With ``opaque``
    (:func:`fasttorch.phases.opaque_update`), in a CPU graph, in place as one operator
    the compiler does not look into (:mod:`fasttorch._opaque`).
    """
    ts = list(grads.values())
    if opaque and in_cpu_graph(ts):
        _opaque.foreach_mul_(ts, factor)
        return dict(grads)
    if in_cpu_graph(ts):
        # by a factor computed once (computed_once); one traced call for all tensors
        (factor,) = computed_once(factor)
    if torch.compiler.is_compiling():
        return dict(zip(grads, torch._foreach_mul(ts, factor)))
    torch._foreach_mul_(ts, factor)
    return dict(grads)


def global_norm(tensors: Mapping[str, torch.Tensor], *, opaque: bool = False) -> torch.Tensor:
    """Global L2 norm, computed as ``torch.nn.utils.clip_grad_norm_`` does.

    In a CPU graph the per-tensor norms are ``linalg.vector_norm`` reductions, which
    inductor generates and fuses with what computes the gradients (the mean over an
    accumulation window); ``_foreach_norm`` has no CPU lowering and would need every
    gradient written out first for the ATen call. On CPU ``_foreach_norm`` is that same
    per-tensor call in eager mode. With ``opaque`` (:func:`scale_grads`), in a CPU graph
    the eager computation as one operator.
    """
    ts = list(tensors.values())
    if opaque and in_cpu_graph(ts):
        return _opaque.global_norm(ts)
    if in_cpu_graph(ts):
        norms = [torch.linalg.vector_norm(t) for t in ts]
    else:
        norms = list(torch._foreach_norm(ts))
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


def describe(batch: Batch) -> str:
    """A short description of a batch's structure: types, shapes, dtypes, devices."""

    def leaf(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"Tensor{tuple(x.shape)}:{str(x.dtype).removeprefix('torch.')}@{x.device}"
        return type(x).__name__

    text = str(pytree.tree_map(leaf, batch))
    return text if len(text) < 300 else text[:297] + "..."


def batch_size(batch: Batch) -> int:
    """Leading dimension of the batch's first tensor (1 for a batch without one)."""
    for x in pytree.tree_leaves(batch):
        if isinstance(x, torch.Tensor) and x.ndim > 0:
            return int(x.shape[0])
    return 1


def add_weighted_aux(total: Any, aux: Any, w: torch.Tensor) -> Any:
    """``total + aux * w`` over a window's ``aux`` trees (floating leaves; others kept)."""
    if aux is None:
        return None
    scaled = pytree.tree_map(lambda a: a * w if _is_float(a) else a, aux)
    if total is None:
        return scaled
    return pytree.tree_map(lambda t, a: t + a if _is_float(a) else a, total, scaled)


def divide_aux(total: Any, w: torch.Tensor) -> Any:
    """``total / w`` on the floating leaves: the weighted mean of :func:`add_weighted_aux`."""
    return pytree.tree_map(lambda t: t / w if _is_float(t) else t, total)


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def check_batch(
    batch: Batch, device: torch.device, api: str, params: dict[str, torch.Tensor] | None = None
) -> None:
    """Raise a clear error for batch leaves that are not tensors on ``device``.

    With ``params``, also for an empty batch (a leading dimension of 0 in its first
    tensor, the one whose size is the default sample count) and for floating tensors
    wider than every parameter (a float64 batch for float32 parameters). Both are
    host-side checks of metadata: nothing is read from the device.
    """
    leaves, _ = pytree.tree_flatten_with_path(batch)
    if not leaves:
        raise TypeError(f"{api}: the batch holds no tensors (got {describe(batch)})")
    sized = False
    for path, x in leaves:
        where = f"batch{pytree.keystr(path)}"
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{api}: {where} is a {type(x).__name__}; every leaf of the batch must be "
                f"a tensor (the batch is {describe(batch)}). Convert it with "
                "torch.as_tensor, or keep configuration out of the batch"
            )
        if x.device != device:
            raise ValueError(
                f"{api}: {where} is on {x.device} but the state is on {device}; move "
                "the batch to the state's device first (batch.to(device, non_blocking=True))"
            )
        if params is None:
            continue
        if not sized and x.ndim > 0:
            sized = True
            if x.shape[0] == 0:
                raise ValueError(
                    f"{api}: {where} has 0 rows (the batch is {describe(batch)}): an empty "
                    "batch would still apply an update (weight decay, momentum, the step "
                    "count). Skip empty batches before calling the step"
                )
        if x.is_floating_point():
            _check_width(x, where, params, batch, api)


def _check_width(
    x: torch.Tensor, where: str, params: dict[str, torch.Tensor], batch: Batch, api: str
) -> None:
    """Raise if floating ``x`` is wider than every parameter (one comparison as a rule)."""
    first = next(iter(params.values()))
    if x.dtype.itemsize <= first.dtype.itemsize:
        return
    dtypes = {p.dtype for p in params.values()}
    if x.dtype in dtypes or all(x.dtype.itemsize <= d.itemsize for d in dtypes):
        return
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    raise ValueError(
        f"{api}: {where} is {str(x.dtype).removeprefix('torch.')} but the parameters are "
        f"{names} (the batch is {describe(batch)}); a batch wider than the parameters "
        "fails inside the model (in a compiled step, as an error from generated code) or "
        f"computes in the wider type. Convert the batch first: x.to({first.dtype})"
    )
