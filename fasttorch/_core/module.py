"""What fasttorch does to the user's ``nn.Module``: its training modes, FSDP2 shards and
tied weights, and the call that runs it over a state's tensors.

A :class:`~fasttorch.TrainState` trains through its module (the template the state's
tensors run in). The module's own flags and FSDP2's unsharded copies are host-side facts
about it, kept here; ``fasttorch.state`` re-exports the names its users know.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any, TypeAlias

import torch
from torch import nn


def imported_class(module: str, name: str) -> Any:
    """Class ``name`` of ``module`` if that module was imported, else ``()`` (which no
    object is an instance of).

    FSDP2's ``FSDPModule`` and ``DTensor`` are looked up, not imported: importing
    ``torch.distributed.fsdp`` costs about 1.4 s (it brings ``torch.distributed.tensor``),
    a third of ``import fasttorch``, and a module can be sharded, or a tensor a
    ``DTensor``, only once the program imported them. A torch built without
    distributed support has neither.
    """
    found = sys.modules.get(module)
    return () if found is None else getattr(found, name, ())


__all__ = [
    "Ties",
    "call_with",
    "evaluating",
    "imported_class",
    "is_sharded",
    "local_tensor",
    "record_modes",
    "reshard",
    "restore_training",
    "set_modes",
    "tied_names",
    "training_modes",
]


def training_modes(module: nn.Module) -> tuple[bool, ...]:
    """Each submodule's ``training`` flag, in ``module.modules()`` order."""
    return tuple(m.training for m in module.modules())


def set_modes(module: nn.Module, modes: tuple[bool, ...]) -> None:
    """Give each submodule the flag ``training_modes`` read (``module.train()`` when the
    module's structure changed since)."""
    subs = list(module.modules())
    if len(subs) != len(modes):
        module.train()
        return
    for m, mode in zip(subs, modes):
        m.training = mode


def restore_training(module: nn.Module) -> None:
    """Put a module left in evaluation mode back in the modes it was trained in.

    An evaluation (``module.eval()``) switches every submodule off; what the user froze
    (a BatchNorm in ``eval()``) was recorded by ``TrainState.create`` and stays frozen.
    """
    modes = _MODES.get(module)
    if modes is None:
        module.train()
    else:
        set_modes(module, modes)


def record_modes(module: nn.Module) -> None:
    """Remember each submodule's mode, the modes steps train ``module`` in
    (``TrainState.create``; :func:`restore_training` puts them back)."""
    _MODES[module] = training_modes(module)


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Run the block with ``module`` in evaluation mode; each submodule's own mode after."""
    modes = training_modes(module)
    module.eval()
    try:
        yield
    finally:
        set_modes(module, modes)


_MODES: weakref.WeakKeyDictionary[nn.Module, tuple[bool, ...]] = weakref.WeakKeyDictionary()


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` was sharded with FSDP2's ``fully_shard`` (its root or a child)."""
    found = _SHARDED.get(module)
    if found is None:
        kind = imported_class("torch.distributed.fsdp", "FSDPModule")
        found = _SHARDED[module] = any(isinstance(m, kind) for m in module.modules())
    return found


def reshard(module: nn.Module) -> None:
    """Free the unsharded parameters FSDP2 still holds for ``module`` (no-op otherwise).

    After a forward without backward (evaluation, ``TrainState.apply``, sampling),
    FSDP2 keeps the root's parameters unsharded, waiting for a backward that never
    comes: the module's parameters are then plain tensors, not the state's shards.
    Resharding puts the shards (the state's own storage) back and frees the rest.
    """
    if is_sharded(module):
        kind = imported_class("torch.distributed.fsdp", "FSDPModule")
        for m in module.modules():
            if isinstance(m, kind):
                m.reshard()


_SHARDED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """``p`` detached; for a ``DTensor``, this rank's shard (the same storage)."""
    if isinstance(p, imported_class("torch.distributed.tensor", "DTensor")):
        with torch.no_grad():
            local: torch.Tensor = p.to_local().detach()
            return local
    return p.detach()


Ties: TypeAlias = tuple[tuple[str, str], ...]
"""``(alias, name)`` pairs: a tensor the module holds under ``alias`` and, first, ``name``."""


def tied_names(module: nn.Module) -> Ties:
    """Each name of ``module``'s parameters and buffers whose tensor an earlier name holds.

    A tied weight (a GPT's head and its token embedding) is one tensor under two names;
    ``named_parameters()`` lists it under the first only, as a state keeps it. Parameters
    come before buffers, in ``named_parameters``' order.

    Example:
        >>> m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        >>> m["b"].weight = m["a"].weight
        >>> tied_names(m)
        (('b.weight', 'a.weight'),)
    """
    first: dict[int, str] = {}
    pairs = []
    for name, t in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        if first.setdefault(id(t), name) != name:
            pairs.append((name, first[id(t)]))
    return tuple(pairs)


def call_with(
    module: nn.Module,
    tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    ties: Ties | None,
    args: Any,
    kwargs: Any,
) -> Any:
    """``torch.func.functional_call(module, tensors, args, kwargs)``, with known ties.

    ``functional_call`` finds every other name of each tensor it swaps in by walking all
    submodules' parameters and buffers on each call, so that a tied weight is swapped
    under each of its names. Dynamo traces that walk in every compiled step (about 2 s of
    a 12-layer GPT step's tracing, 2026-11-27). Given the module's ``ties``, recorded
    once by ``TrainState.create`` (:func:`tied_names`), the aliases are added here and the
    walk is skipped (``tie_weights=False``): the same tensors under the same names.
    ``ties=None`` (not known) walks as before.
    """
    if ties is None:
        return torch.func.functional_call(module, tensors, args, kwargs)
    params, buffers = tensors
    named = {**params, **buffers}
    named.update({alias: named[name] for alias, name in ties if name in named})
    return torch.func.functional_call(module, named, args, kwargs, tie_weights=False)
