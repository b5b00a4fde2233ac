"""Donation: a step that consumes its input state writes the results into its tensors.

As ``jax.jit(donate_argnums=0)``: a donating step computes new values, then
:func:`commit` copies them into the input state's own tensors and returns the new state
over them, so memory stays 1x; the input state object is marked dead
(``fasttorch.state.mark_donated``) and any later use raises ``DonatedStateError``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fasttorch import struct

__all__ = ["commit", "kept_leaves"]


def commit(donate: bool, old: Any, new: Any) -> Any:
    """With donation, write ``new``'s tensors into ``old``'s and return ``new`` over them.

    Phases compute new values (in eager mode some update tensors they own in place);
    this is where a donated state's tensors take the results. Under ``compiled`` the
    copies fuse into the kernels that produce the values. The walk stops at subtrees
    that are the same object, so an update that already happened in place costs nothing.
    """
    if not donate:
        return new
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    out = _reuse(old, new, dst, src, torch.compiler.is_compiling())
    if len(dst) > 0:
        _copy_by_dtype(dst, src)
    return out


def _copy_by_dtype(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``_foreach_copy_`` once per dtype: on CUDA a list of mixed dtypes (a state's int64
    counters beside its float32 tensors) is copied one launch per tensor."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src):
        ds, ss = groups.setdefault(d.dtype, ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


def _same(a: Any, b: Any, compiling: bool) -> bool:
    """``a is b``, for tensors always; for containers only outside a graph.

    Inside a compiled step, ``is`` between two dicts or records does not trace on every
    torch release (2.11's dynamo refuses it). There containers count as distinct and the
    walk goes on to their tensors, where ``is`` traces: the same copies result.
    """
    if isinstance(b, torch.Tensor) or not compiling:
        return a is b
    return False


def _reuse(
    old: Any, new: Any, dst: list[torch.Tensor], src: list[torch.Tensor], compiling: bool
) -> Any:
    """``new`` with its tensors swapped for ``old``'s where they differ (copies queued)."""
    if _same(old, new, compiling):
        return new
    if isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype:
            dst.append(old)
            src.append(new)
            return old
        return new
    if isinstance(new, dict) and isinstance(old, dict):
        return {
            k: _reuse(old[k], v, dst, src, compiling) if k in old else v for k, v in new.items()
        }
    if isinstance(new, struct.Record) and type(old) is type(new):
        changes = {}
        for name in struct.data_fields(new):
            a, b = getattr(old, name), getattr(new, name)
            if not _same(a, b, compiling):
                changes[name] = _reuse(a, b, dst, src, compiling)
        return new.replace(**changes) if changes else new
    if isinstance(new, (list, tuple)) and isinstance(old, (list, tuple)) and len(old) == len(new):
        items = [_reuse(a, b, dst, src, compiling) for a, b in zip(old, new)]
        return type(new)(items) if isinstance(new, list) else tuple(items)
    return new


def kept_leaves(args: Any) -> list[torch.Tensor]:
    """The tensors of the records in ``args`` that a donating step keeps from call to call.

    A record declares it with a class attribute ``kept_across_calls = True`` (the
    train state, an across-calls accumulation window); :func:`commit` writes every
    result into those tensors, so they are the same objects, at the same addresses, on
    every call. ``compiled`` marks them static for CUDA graphs.
    """
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, struct.Record) and getattr(type(a), "kept_across_calls", False):
            out.extend(t for t in pytree.tree_leaves(a) if isinstance(t, torch.Tensor))
    return out
