"""What a checkpoint calls the entries of a state.

Clean keys (no ``_orig_mod.`` or ``module.`` prefix), the entries kept per rank, the
FSDP2 shards among the leaves, the plain static fields of records (``AccumState.micro``),
and the names of the model and optimizer classes that the manifest records. What is
kept per rank is what the sub-state records declare (``per_rank``,
:mod:`fasttorch.substates`): no transform is known here by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fasttorch import _compat, struct
from fasttorch.checkpoint._errors import CheckpointError, CheckpointMismatchError
from fasttorch.distributed.fsdp import sharded_leaves
from fasttorch.state import TrainState, is_sharded
from fasttorch.substates import per_rank_keys

# Entries whose values legitimately differ between ranks whatever the transforms (the
# generator state): saved under "rank{r}/". Sub-states add theirs (_per_rank).
PER_RANK = ("rng",)
_DATA = "data"


def _wrapper_prefixes(module: torch.nn.Module) -> tuple[str, ...]:
    prefixes = ["_orig_mod."]
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    m: Any = module
    prefix = ""
    while True:
        if _compat.is_optimized_module(m):
            prefix += "_orig_mod."
            m = m._orig_mod
        elif isinstance(m, wrappers):
            prefix += "module."
            m = m.module
        else:
            break
    if prefix:
        prefixes.append(prefix)
    return tuple(prefixes)


def _clean(name: str, prefixes: tuple[str, ...]) -> str:
    for p in prefixes[1:]:
        name = name.removeprefix(p)
    # A compiled submodule leaves "_orig_mod." anywhere in the name.
    return name.replace("._orig_mod.", ".").removeprefix("_orig_mod.")


def _part(k: Any, rename: dict[str, str]) -> str:
    if isinstance(k, pytree.GetAttrKey):
        return k.name
    if isinstance(k, pytree.MappingKey):
        return rename.get(str(k.key), str(k.key))
    if isinstance(k, pytree.SequenceKey):
        return str(k.idx)
    return str(k)


def _per_rank(state: TrainState) -> tuple[str, ...]:
    """The entries of ``state`` kept per rank: ``PER_RANK`` and the sub-states whose
    record declares ``per_rank`` (an open accumulation window)."""
    return (*PER_RANK, *(f"substates/{k}" for k in per_rank_keys(state.substates)))


def _is_per_rank(key: str, per_rank: tuple[str, ...] = PER_RANK) -> bool:
    """Whether entry ``key`` is one of ``per_rank`` (``_per_rank(state)``) or inside one."""
    return any(key == p or key.startswith(p + "/") for p in per_rank)


def _flatten(state: TrainState) -> tuple[list[str], list[Any], Any]:
    """Clean keys, leaves and tree spec of ``state`` (a tensor subclass leaf, torchao's
    quantized optimizer state, is one leaf: ``checkpoint._subclasses``)."""
    prefixes = _wrapper_prefixes(state.module)
    rename = {n: _clean(n, prefixes) for n in (*state.params, *state.buffers)}
    if len(set(rename.values())) != len(rename):
        raise CheckpointError(
            "two parameter names of the model become the same once the wrapper prefixes "
            f"'_orig_mod.'/'module.' are removed: {sorted(rename)}"
        )
    pairs, tree = pytree.tree_flatten_with_path(state)
    keys = ["/".join(_part(k, rename) for k in path) for path, _ in pairs]
    leaves = [leaf for _, leaf in pairs]
    for key, leaf in zip(keys, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise CheckpointError(
                f"state entry {key!r} is a {type(leaf).__name__}; every leaf of a "
                "TrainState must be a tensor (keep Python values in static fields)"
            )
    return keys, leaves, tree


def _describe(t: torch.Tensor, like: DTensor | None = None) -> dict[str, Any]:
    """Shape and dtype of an entry; of the whole tensor for a shard laid out as ``like``."""
    shape = t.shape if like is None else like.shape
    return {"shape": list(shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _export_keys(state: TrainState) -> dict[str, Any]:
    """How the saved entries map onto ``module.state_dict()``'s keys, for the export.

    ``non_persistent``: the buffers it leaves out (``persistent=False``, such as a
    rotary ``inv_freq``), saved with the state but not exported. ``aliases``: its keys
    that name a tensor the state keeps under another name (a tied weight), each with
    the entry it comes from.
    """
    module = state.module
    prefixes = _wrapper_prefixes(module)
    exported = module.state_dict(keep_vars=True)
    entry = {id(t): n for n, t in (*module.named_parameters(), *module.named_buffers())}
    group = {n: "params" if n in state.params else "buffers" for n in entry.values()}
    aliases = {}
    for key, t in exported.items():
        name = entry.get(id(t))
        if name is not None and name != key:
            aliases[_clean(key, prefixes)] = f"{group[name]}/{_clean(name, prefixes)}"
    return {
        "non_persistent": [
            f"buffers/{_clean(n, prefixes)}" for n in state.buffers if n not in exported
        ],
        "aliases": aliases,
    }


def _class_name(module: torch.nn.Module) -> str:
    """The model's class name; the user's own under FSDP2's ``FSDP<Name>`` subclass."""
    mro = type(module).__mro__
    return next(c for c in mro if not issubclass(c, FSDPModule)).__name__


def _shards(state: TrainState, keys: list[str]) -> dict[int, DTensor]:
    """The leaves of a sharded state that are FSDP2 shards, by index (none if replicated).

    Each maps to its module parameter, whose mesh, placements and global shape DCP
    needs to write the shard under the whole tensor's key, or to read this rank's part
    of it. The FSDP2 modules are resharded first: after a forward without gradients
    (``state.apply``, ``eval_step``) the root can hold its parameters unsharded, and
    its ``named_parameters`` are then plain whole tensors, not the ``DTensor`` shards.
    A per-rank entry (an open accumulation window) is saved as this rank's own.
    """
    if not is_sharded(state.module):
        return {}
    per_rank = _per_rank(state)
    return {i: p for i, p in sharded_leaves(state).items() if not _is_per_rank(keys[i], per_rank)}


_SCALARS = (bool, int, float, str, type(None))


def _statics(obj: Any, path: str, out: dict[str, Any]) -> None:
    """Collect the plain-valued static fields of records (``AccumState.micro``)."""
    if isinstance(obj, struct.Record):
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            where = f"{path}/{f.name}" if path else f.name
            if f.metadata.get("fasttorch_static", False):
                if isinstance(value, _SCALARS):
                    out[where] = value
            else:
                _statics(value, where, out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _statics(v, f"{path}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _statics(v, f"{path}/{i}", out)


def _restore_statics(obj: Any, path: str, facts: dict[str, Any]) -> Any:
    if isinstance(obj, struct.Record):
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            where = f"{path}/{f.name}" if path else f.name
            if f.metadata.get("fasttorch_static", False):
                if isinstance(value, _SCALARS) and where in facts and facts[where] != value:
                    if type(facts[where]) is not type(value):  # a hand-edited manifest
                        raise CheckpointMismatchError(
                            f"checkpoint static field {where!r} is {facts[where]!r} "
                            f"({type(facts[where]).__name__}); the template's is "
                            f"{value!r} ({type(value).__name__})"
                        )
                    changes[f.name] = facts[where]
            else:
                new = _restore_statics(value, where, facts)
                if new is not value:
                    changes[f.name] = new
        return obj.replace(**changes) if changes else obj
    if isinstance(obj, dict):
        new_d = {k: _restore_statics(v, f"{path}/{k}", facts) for k, v in obj.items()}
        return obj if all(new_d[k] is obj[k] for k in obj) else new_d
    return obj


def _optimizer_name(optimizer: Any) -> str:
    """The optimizer as the user chose it: ``AdamW`` for fasttorch.optim.adamw (an
    ``Adam`` with decoupled weight decay), ``TorchOptimizer(RMSprop)`` for from_torch."""
    name = type(optimizer).__name__
    if getattr(optimizer, "decoupled_weight_decay", False) is True:
        name += "W"
    cls = getattr(optimizer, "cls", None)
    if isinstance(cls, type):
        name += f"({cls.__name__})"
    return name
