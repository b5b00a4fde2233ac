"""Checks of ``vmapped``'s ``in_dims`` against the rule and against a batch, before vmap.

Raised at wrap time (the argument's type) and at the call (the batch's structure and
sizes), so a wrong ``in_dims`` says what was given instead of torch's shape error from
inside the vmapped step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fasttorch import _checks
from fasttorch.phases import Batch

InDims = Any  # None, an int, or a pytree prefix of the batch (as torch.func.vmap's)


_IN_DIMS_RULE = (
    "in_dims says where each member's batch is: None (one batch shared by every member), "
    "an int d (member i's batch is every tensor's index i along dimension d, usually 0), "
    "or a tuple/list/dict of those shaped like the batch"
)


def check_in_dims(in_dims: InDims, api: str) -> None:
    """Raise (at wrap time) unless ``in_dims`` is None, an int, or a container of those."""
    if in_dims is None or _checks.is_int(in_dims):
        return
    if isinstance(in_dims, (tuple, list)):
        for d in in_dims:
            check_in_dims(d, api)
        return
    if isinstance(in_dims, dict):
        for d in in_dims.values():
            check_in_dims(d, api)
        return
    raise _checks.ArgumentTypeError(
        f"{api}: in_dims={in_dims!r} ({type(in_dims).__name__}); {_IN_DIMS_RULE}"
    )


def check_batch_dims(in_dims: InDims, batch: Batch, n: int, api: str) -> None:
    """Raise (at the call, before vmap) if ``in_dims`` does not fit ``batch``: a structure
    that differs from the batch's, or a mapped tensor without ``n`` members at its dim."""

    def walk(dims: InDims, b: Any, where: str) -> None:
        if dims is None:
            return
        if isinstance(dims, (tuple, list, dict)):
            same = (
                isinstance(b, dict) and set(b) == set(dims)
                if isinstance(dims, dict)
                else isinstance(b, (tuple, list)) and len(b) == len(dims)
            )
            if not same:
                raise ValueError(
                    f"{api}: in_dims{where or ''}={dims!r} does not match the batch{where} "
                    f"({_describe(b)}); {_IN_DIMS_RULE}"
                )
            keys = dims.keys() if isinstance(dims, dict) else range(len(dims))
            for k in keys:
                walk(dims[k], b[k], f"{where}[{k!r}]")
            return
        for path, t in pytree.tree_flatten_with_path(b)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            at = f"batch{where}{pytree.keystr(path)}"
            if not -t.dim() <= dims < t.dim() or t.shape[dims] != n:
                size = f"of size {t.shape[dims]}" if -t.dim() <= dims < t.dim() else "absent"
                raise ValueError(
                    f"{api}: in_dims={in_dims!r} maps {at} (shape {tuple(t.shape)}) along "
                    f"dimension {dims}, {size}, but the population has {n} members. With "
                    f"in_dims={dims} every mapped tensor needs {n} entries along dimension "
                    f"{dims}, member i's at index i (stack the members' batches: "
                    "torch.stack(batches)); for one batch shared by every member pass "
                    "in_dims=None"
                )

    walk(in_dims, batch, "")


def _describe(b: Any) -> str:
    if isinstance(b, dict):
        return f"a dict with keys {sorted(map(str, b))}"
    if isinstance(b, (tuple, list)):
        return f"a {type(b).__name__} of {len(b)}"
    return type(b).__name__
