"""Tensor subclasses in a checkpoint: their values, resharded; their codes, bit for bit.

A state may hold tensor subclasses (torchao's quantized optimizer states: 8-bit,
4-bit or float8 codes, block scales and a quantization map behind one tensor of the
parameter's shape). torchao quantizes each tensor it is given by its own size, so in
a state sharded with FSDP2 each rank's state is the quantization of its local shard,
blocks counted from the shard's first value: the layout (and even whether the state
is quantized at all) depends on the number of ranks. A checkpoint therefore holds,
for each such leaf ``<key>``:

* ``<key>``: its values (``dequantize()``, in the dtype it shows), a plain tensor,
  saved as the parameter's ``DTensor`` shard when the leaf is one, so DCP reshards it
  onto any number of ranks like any other per-parameter entry;
* ``<key>/<inner>`` (``rank{r}/<key>/<inner>`` for a shard: each rank's own): the
  inner tensors (its ``__tensor_flatten__``), listed in the manifest's ``quantized``.

A load reads the inner tensors where the layout is the saved one (the same number of
ranks, the leaf a shard in both or neither, and this rank's inner shapes and dtypes
those of the checkpoint): the state resumes bit for bit. Elsewhere it reads the
values, resharded, and requantizes them into the template's own state with torchao's
``copy_`` (its quantization, in the template's layout): each value within the
quantization's own rounding of what was saved (docs/checkpointing.md); on the same
ranks with another layout (another block size) it does so with a warning, and a
leaf of another class (8-bit saved, 4-bit in the template) is refused. What is built,
and how, comes from the program (the template's class and flatten context), never
from the checkpoint's files.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fasttorch.checkpoint._errors import CheckpointError, CheckpointMismatchError

# The manifest's list of the leaves whose inner tensors are saved.
FIELD = "quantized"


def is_subclass(t: Any) -> bool:
    """Whether ``t`` is a quantized state: a tensor subclass that flattens into inner
    tensors and dequantizes itself (torchao's ``OptimState8bit``, ``OptimState4bit``,
    ``OptimStateFp8``). Other subclasses (a ``DTensor``, a float8 training weight that
    FSDP2 all-gathers in float8) are saved as the tensors they are, by DCP."""
    cls = type(t)
    return (
        isinstance(t, torch.Tensor)
        and hasattr(cls, "__tensor_flatten__")
        and getattr(cls, "dequantize", torch.Tensor.dequantize) is not torch.Tensor.dequantize
    )


def values(t: torch.Tensor) -> torch.Tensor:
    """The plain values of ``t``: a subclass dequantized (in the dtype it shows)."""
    if is_subclass(t):
        return t.dequantize(t.dtype)  # type: ignore[call-arg, no-any-return]
    return t


def empty_like(t: torch.Tensor, device: Any = None) -> torch.Tensor:
    """An uninitialized plain tensor of ``t``'s shape and dtype (a subclass has none
    of its own: torchao's states implement no ``empty_like``)."""
    if is_subclass(t):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device if device is None else device)
    return torch.empty_like(t, device=device)


def _inner(t: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each inner tensor of subclass ``t``, nested ones flattened
    as ``a/b``."""
    if not is_subclass(t):
        return [(prefix, t)]
    names, _ = t.__tensor_flatten__()
    out: list[tuple[str, torch.Tensor]] = []
    for n in names:
        out += _inner(getattr(t, n), f"{prefix}/{n}" if prefix else n)
    return out


def _name(key: str, inner: str, sharded: bool, rank: int) -> str:
    return f"rank{rank}/{key}/{inner}" if sharded else f"{key}/{inner}"


def inner_tensors(
    keys: list[str], leaves: list[Any], shards: dict[int, DTensor], rank: int
) -> dict[str, torch.Tensor]:
    """What a save writes besides the values: each subclass leaf's inner tensors,
    under this rank's own names for a shard."""
    out: dict[str, torch.Tensor] = {}
    for i, (key, t) in enumerate(zip(keys, leaves)):
        if is_subclass(t):
            for n, v in _inner(t, ""):
                out[_name(key, n, i in shards, rank)] = v.detach()
    return out


def saved(keys: list[str], leaves: list[Any]) -> dict[str, str]:
    """The manifest's ``quantized``: the class name of each subclass leaf, by key."""
    return {k: type(t).__name__ for k, t in zip(keys, leaves) if is_subclass(t)}


def _saved_classes(manifest: dict[str, Any], where: str) -> dict[str, str]:
    got = manifest.get(FIELD, {})
    if not isinstance(got, dict) or not all(isinstance(v, str) for v in got.values()):
        raise CheckpointError(
            f"checkpoint {where}: the manifest's {FIELD!r} must map entry names to class "
            f"names, got {got!r}"
        )
    return got


def request_inner(
    manifest: dict[str, Any],
    metadata: Any,
    keys: list[str],
    leaves: list[Any],
    shards: dict[int, DTensor],
    names: dict[str, str],
    scratch: dict[str, torch.Tensor],
    request: dict[str, Any],
    rank_world: tuple[int, int],
    where: str,
) -> dict[str, dict[str, torch.Tensor]]:
    """Read the inner tensors, not the values, of each subclass leaf whose layout is
    the saved one: ``request`` and ``scratch`` changed to that, and the inner scratch
    returned by key. ``metadata``: the checked DCP metadata (its entries' sizes)."""
    rank, world = rank_world
    quantized = _saved_classes(manifest, where)
    was_sharded = set(manifest.get("sharded", ()))
    same_world = int(manifest["world_size"]) == world
    entries = metadata.state_dict_metadata
    side: dict[str, dict[str, torch.Tensor]] = {}
    relaid: list[str] = []
    for i, (key, t) in enumerate(zip(keys, leaves)):
        if not is_subclass(t) or key not in quantized or key not in names:
            continue  # a plain value (another layout, or not read): requantized
        if quantized[key] != type(t).__name__:
            raise CheckpointMismatchError(
                f"checkpoint {where} does not fit the template: entry {key!r} is a "
                f"{quantized[key]} in the checkpoint but a {type(t).__name__} in the "
                f"template (saved by {manifest['optimizer']}, the template's optimizer "
                "quantizes otherwise). Build the template with the optimizer that saved it"
            )
        sharded = i in shards
        if sharded != (key in was_sharded) or (sharded and not same_world):
            continue
        inner = _inner(t, "")
        wanted = {n: _name(key, n, sharded, rank) for n, _ in inner}
        if not all(
            getattr(entries.get(wanted[n]), "size", None) == v.shape
            and getattr(getattr(entries.get(wanted[n]), "properties", None), "dtype", None)
            == v.dtype
            for n, v in inner
        ):
            relaid.append(key)  # another block size: requantized
            continue
        del request[names[key]]
        del scratch[key]
        side[key] = {n: torch.empty_like(v, device="cpu") for n, v in inner}
        for n in side[key]:
            request[wanted[n]] = side[key][n]
    if relaid:
        warnings.warn(
            f"checkpoint {where}: {relaid} were saved in another quantized layout than "
            "the template's on the same ranks (another block size?), so their values are "
            "requantized into the template's layout, within the quantization's rounding, "
            "not resumed bit for bit. Build the template with the optimizer options that "
            "saved it to resume exactly",
            UserWarning,
            stacklevel=4,
        )
    return side


def place(
    keys: list[str],
    leaves: list[Any],
    targets: list[Any],
    scratch: dict[str, torch.Tensor],
    side: dict[str, dict[str, torch.Tensor]],
    *,
    inplace: bool,
) -> list[Any]:
    """``targets`` with each subclass leaf loaded: its inner tensors copied (``side``),
    or its values (``scratch``) requantized by the class's own ``copy_``; into the
    template's own state (``inplace``) or a copy of it."""
    from fasttorch.optim import _inner as optim_inner  # not at import: checkpoint loads first

    out = list(targets)
    with torch.no_grad():
        for i, (key, t) in enumerate(zip(keys, leaves)):
            if not is_subclass(t):
                continue
            dst = t if inplace else optim_inner.clone(t)
            if key in side:
                for n, v in _inner(dst, ""):
                    v.copy_(side[key][n])
            elif key in scratch:
                dst.copy_(scratch[key].to(t.device))
            out[i] = dst
    return out
