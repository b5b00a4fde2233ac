"""What fasttorch does to the user's ``nn.Module``: its training modes and FSDP2 shards.

A :class:`~fasttorch.TrainState` trains through its module (the template the state's
tensors run in). The module's own flags and FSDP2's unsharded copies are host-side facts
about it, kept here; ``fasttorch.state`` re-exports the names its users know.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

try:  # torch.distributed can be left out of a build (USE_DISTRIBUTED=0)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    FSDPModule = DTensor = ()  # type: ignore[assignment,misc]

__all__ = [
    "evaluating",
    "is_sharded",
    "local_tensor",
    "record_modes",
    "reshard",
    "restore_training",
    "set_modes",
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
        found = _SHARDED[module] = any(isinstance(m, FSDPModule) for m in module.modules())
    return found


def reshard(module: nn.Module) -> None:
    """Free the unsharded parameters FSDP2 still holds for ``module`` (no-op otherwise).

    After a forward without backward (evaluation, ``TrainState.apply``, sampling),
    FSDP2 keeps the root's parameters unsharded, waiting for a backward that never
    comes: the module's parameters are then plain tensors, not the state's shards.
    Resharding puts the shards (the state's own storage) back and frees the rest.
    """
    if is_sharded(module):
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


_SHARDED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """``p`` detached; for a ``DTensor``, this rank's shard (the same storage)."""
    if isinstance(p, DTensor):
        with torch.no_grad():
            return p.to_local().detach()
    return p.detach()
