"""Tensor subclasses in a checkpoint: saved as their inner tensors, rebuilt from the template.

A state may hold tensor subclasses (torchao's quantized optimizer states: 8-bit codes,
block scales and a quantization map behind one tensor of the parameter's shape). DCP
and ``torch.load(weights_only=True)`` know plain tensors, so each subclass leaf is
saved as its inner tensors under ``<key>/<inner name>`` (its ``__tensor_flatten__``).
A load reads those plain tensors and rebuilds each subclass with the template's own
class and flatten context (``__tensor_unflatten__``): what is built, and how, comes
from the program, never from the checkpoint's files.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


def is_subclass(t: Any) -> bool:
    """Whether ``t`` is a tensor subclass that flattens into inner tensors (a
    ``DTensor``, which DCP saves itself, is not one of them)."""
    return (
        isinstance(t, torch.Tensor)
        and hasattr(type(t), "__tensor_flatten__")
        and type(t).__name__ != "DTensor"
    )


def expand(keys: list[str], leaves: list[Any]) -> tuple[list[str], list[Any]]:
    """``keys`` and ``leaves`` with each subclass leaf replaced by its inner tensors
    (recursively), under ``<key>/<inner name>``."""
    out_keys: list[str] = []
    out_leaves: list[Any] = []
    for key, leaf in zip(keys, leaves):
        _expand(key, leaf, out_keys, out_leaves)
    return out_keys, out_leaves


def _expand(key: str, leaf: Any, keys: list[str], leaves: list[Any]) -> None:
    if not is_subclass(leaf):
        keys.append(key)
        leaves.append(leaf)
        return
    names, _ = leaf.__tensor_flatten__()
    for name in names:
        _expand(f"{key}/{name}", getattr(leaf, name), keys, leaves)


class Spec:
    """How to rebuild a state from expanded leaves: its pytree spec and the template's
    own leaves (whose subclasses give the class and the flatten context)."""

    def __init__(self, tree: Any, leaves: list[Any]) -> None:
        self.tree = tree
        self.leaves = leaves

    def unflatten(self, values: list[Any]) -> Any:
        """The state over ``values`` (in :func:`expand`'s order), subclasses rebuilt."""
        it = iter(values)
        return pytree.tree_unflatten([_rebuild(t, it) for t in self.leaves], self.tree)


def _rebuild(template: Any, values: Any) -> Any:
    if not is_subclass(template):
        return next(values)
    names, ctx = template.__tensor_flatten__()
    inner = {name: _rebuild(getattr(template, name), values) for name in names}
    if all(inner[n] is getattr(template, n) for n in names):
        return template  # loaded in place: the template's own object
    return type(template).__tensor_unflatten__(inner, ctx, template.shape, template.stride())
