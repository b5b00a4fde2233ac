"""Tensor parallelism with FSDP2 on a 2-D mesh: ``parallelize(model, mesh, plan)``.

torch owns the parallelism, as in torchtitan: ``parallelize_module`` applies the user's
plan (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ...) over the
mesh's tensor-parallel dimension, then ``fully_shard`` shards each block, and the root,
over its data-parallel dimension. A parameter is then a ``DTensor`` on both dimensions
(or, left out of the plan, on the data-parallel one), and a ``TrainState`` holds this
rank's piece of it: the step trains it with ``sync_on_last`` as any FSDP2 state
(:mod:`fasttorch.distributed.fsdp`). What tensor parallelism changes there, this module
says:

* the ranks of one tensor-parallel group hold the same data (the same batch, the same
  loss): :func:`data_parallel_rank` is a rank's place among the data-parallel ranks,
  from which :func:`~fasttorch.distributed.replicate` seeds its RNG (dropout on the
  activations the group shares must draw the same mask on each of them);
* a parameter left replicated over the tensor-parallel dimension (a norm, a row-wise
  layer's bias) is held whole by every rank of the group, so the global gradient norm
  counts its square once, not once per rank (:func:`norm_shares`).
"""

from __future__ import annotations

import fnmatch
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fasttorch._core.state import imported_class

__all__ = ["HEAD_ATTRIBUTES", "data_parallel_rank", "norm_shares", "parallelize"]

HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "num_key_value_heads")
"""Attributes that give a module's number of attention heads (nanoGPT, torchtitan,
``nn.MultiheadAttention``, transformers): each must split evenly over the
tensor-parallel ranks, as the heads are what a column-wise ``q``/``k``/``v`` shards."""

# The data-parallel rank of a module parallelized here (replicate's RNG streams).
_DATA_RANK: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def parallelize(
    model: nn.Module,
    mesh: Any,
    plan: Mapping[str, Any],
    *,
    blocks: str | None = None,
    dp: str = "dp_shard",
    tp: str = "tp",
    compile: Mapping[str, Any] | None = None,
    **fsdp: Any,
) -> nn.Module:
    """Shard ``model`` over a 2-D mesh: ``plan`` over ``mesh[tp]``, FSDP2 over ``mesh[dp]``.

    Applies ``torch.distributed.tensor.parallel.parallelize_module(model, mesh[tp],
    plan)``, then ``fully_shard(block, mesh=mesh[dp], **fsdp)`` for each child of the
    submodule named ``blocks`` (a transformer's ``nn.ModuleList`` of blocks), then
    ``fully_shard(model, ...)`` (the root: embeddings, final norm, head), as torchtitan's
    ``parallelize_llama`` does; with ``compile``, each block is compiled between the plan
    and ``fully_shard`` (torchtitan's order), the part of the forward and backward that
    compiles under FSDP2's hooks. Every rank must have built the same model (same seed)
    before. Train the result as any FSDP2 state: ``TrainState.create``,
    :func:`~fasttorch.distributed.replicate`, a step with ``sync_on_last``; give the
    ranks of one tensor-parallel group the same batch (their data-parallel rank is
    ``mesh[dp].get_local_rank()`` of ``mesh[dp].size()``).

    Checked before anything is sharded, on every rank alike (so no rank hangs in a
    collective the others skipped): the mesh has both dimensions; each plan key
    (``parallelize_module``'s module paths, ``*`` matching any name, e.g.
    ``"blocks.*.attn.q"``) names at least one module (torch only warns); the
    tensor-parallel degree divides each planned ``Linear``'s or ``Embedding``'s split
    dimension and the heads of each module above a planned one (:data:`HEAD_ATTRIBUTES`).

    Equivalent to::

        parallelize_module(model, mesh["tp"], plan)
        for block in model.blocks:
            block.compile(**compile)  # with compile= only
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])

    Args:
        model: the model, on its device, not yet sharded.
        mesh: a ``DeviceMesh`` with dimensions named ``dp`` and ``tp``, e.g.
            ``init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp_shard", "tp"))``.
        plan: ``{module path: ParallelStyle}``, paths from the root of ``model``.
        blocks: the submodule whose children are FSDP2 units (``None``: the root only).
        dp: the data-parallel (FSDP2) dimension's name.
        tp: the tensor-parallel dimension's name.
        compile: keyword arguments of ``nn.Module.compile`` for each block (e.g.
            ``{"fullgraph": True}``); ``None``: not compiled.
        fsdp: keyword arguments of ``fully_shard`` (``mp_policy``,
            ``reshard_after_forward``).

    Returns:
        ``model``, parallelized and sharded in place.

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh``, or ``plan`` not a dict of
            ``ParallelStyle``.
        ValueError: a dimension, plan key or ``blocks`` names nothing, a split does not
            divide, or ``model`` is already sharded.

    Example:
        >>> import torch
        >>> from torch.distributed.tensor.parallel import ColwiseParallel
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        >>> try:  # a mesh needs a process group: launch with torchrun (docs/tensor_parallel.md)
        ...     parallelize(model, None, {"0": ColwiseParallel()})
        ... except TypeError as e:
        ...     print(str(e).split(". ")[0])
        fasttorch.distributed.parallelize: mesh must be a DeviceMesh, got NoneType
    """
    _check_plan_types(plan)
    matched = _resolve(model, plan)
    mesh = _check_mesh(mesh, dp, tp)
    degree = mesh[tp].size()
    _check_splits(model, matched, degree)
    units = _units(model, blocks)
    if compile is not None and not units:
        raise ValueError(
            "fasttorch.distributed.parallelize: compile= compiles each block, but "
            f"blocks={blocks!r} names none. Pass blocks= (the module whose children are "
            "the blocks), or compile the step only (fasttorch.compiled)"
        )
    _check_not_sharded(model)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh[tp], dict(plan))
    for unit in units:
        if compile is not None:
            unit.compile(**compile)
        fully_shard(unit, mesh=mesh[dp], **fsdp)
    fully_shard(model, mesh=mesh[dp], **fsdp)
    _DATA_RANK[model] = mesh[dp].get_local_rank()
    return model


def data_parallel_rank(module: nn.Module) -> int | None:
    """The data-parallel rank :func:`parallelize` gave ``module`` (``None``: not given).

    The ranks of one tensor-parallel group share it: they hold the same data, and so
    must draw the same random numbers (dropout on their shared activations).

    Example:
        >>> import torch
        >>> print(data_parallel_rank(torch.nn.Linear(2, 2)))  # not parallelized here
        None
    """
    return _DATA_RANK.get(module)


def norm_shares(params: Mapping[str, torch.Tensor], group: Any = None) -> dict[str, float]:
    """Each parameter's share of its square in a sum of squares over the ranks of ``group``.

    A ``DTensor`` sharded on ``k`` of its mesh's ranks (the product of the sizes of the
    mesh dimensions it is sharded on) is held by ``world / k`` ranks per piece: each
    counts ``k / world`` of its local sum of squares, so the all-reduced sum counts every
    element once. A plain FSDP2 shard (sharded on the whole world) counts 1; a
    parameter replicated over the tensor-parallel ranks ``1 / tp``. Only the shares
    that are not 1 are returned. (A collective's group size is read: it runs under
    torchrun, as in tests/tp_worker.py.)
    """
    world = dist.get_world_size(group)
    dtensor = imported_class("torch.distributed.tensor", "DTensor")
    out = {}
    for name, p in params.items():
        k = 1
        if isinstance(p, dtensor):
            sizes = p.device_mesh.mesh.shape
            # not is_shard(): FSDP2's _StridedShard (dim 0 split by TP, then by FSDP2) is
            # no Shard in every release; a parameter is never Partial
            split = [n for n, pl in zip(sizes, p.placements, strict=True) if not pl.is_replicate()]
            k = math.prod(split)
        if k != world:
            out[name] = k / world
    return out


def _check_plan_types(plan: object) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            "fasttorch.distributed.parallelize: plan must be a non-empty dict "
            "{module path: ParallelStyle} (parallelize_module's plan), got "
            f"{type(plan).__name__}. Write e.g. {{'blocks.*.attn.q': ColwiseParallel(), "
            "'blocks.*.attn.proj': RowwiseParallel()}"
        )
    for key, value in plan.items():
        if not isinstance(key, str) or not isinstance(value, ParallelStyle):
            raise TypeError(
                f"fasttorch.distributed.parallelize: plan entry {key!r}: "
                f"{type(value).__name__} is not a ParallelStyle. Each key is a module path "
                "(str), each value a torch.distributed.tensor.parallel style "
                "(ColwiseParallel(), RowwiseParallel(), SequenceParallel(), ...)"
            )


def _resolve(model: nn.Module, plan: Mapping[str, Any]) -> list[tuple[str, str, nn.Module, Any]]:
    """``(key, path, module, style)`` for each module each plan key names, as
    ``parallelize_module`` resolves keys (``fnmatch`` per dotted part)."""
    paths = {name: m for name, m in model.named_modules() if name}
    out: list[tuple[str, str, nn.Module, Any]] = []
    for key, style in plan.items():
        parts = key.split(".") if key else []
        hits = [
            (p, m)
            for p, m in paths.items()
            if len(p.split(".")) == len(parts)
            and all(fnmatch.fnmatch(a, b) for a, b in zip(p.split("."), parts, strict=True))
        ]
        if key == "":
            hits = [("", model)]
        if not hits:
            near = [p for p in paths if p.split(".")[-1] == parts[-1].split("*")[-1]][:5]
            raise ValueError(
                f"fasttorch.distributed.parallelize: plan key {key!r} names no module of "
                f"{type(model).__name__} (torch's parallelize_module would only warn and "
                "leave it unsharded). Keys are module paths from the root, '*' matching "
                f"one name: {', '.join(near) or ', '.join(list(paths)[:8])} are some of "
                "its modules"
            )
        out.extend((key, p, m, style) for p, m in hits)
    return out


def _check_mesh(mesh: Any, dp: str, tp: str) -> Any:
    kind = imported_class("torch.distributed.device_mesh", "DeviceMesh")
    if kind == () or not isinstance(mesh, kind):
        raise TypeError(
            "fasttorch.distributed.parallelize: mesh must be a DeviceMesh, got "
            f"{type(mesh).__name__}. Make one with torch.distributed.device_mesh."
            f"init_device_mesh(device_type, (dp, tp), mesh_dim_names=({dp!r}, {tp!r}))"
        )
    names = tuple(mesh.mesh_dim_names or ())
    missing = [n for n in (dp, tp) if n not in names]
    if missing:
        raise ValueError(
            f"fasttorch.distributed.parallelize: the mesh's dimensions are {names or 'unnamed'}"
            f" (sizes {tuple(mesh.mesh.shape)}), without {missing}: parallelize shards "
            f"over a data-parallel dimension dp={dp!r} and a tensor-parallel one tp={tp!r}. "
            f"Name them: init_device_mesh(device_type, (dp, tp), mesh_dim_names=({dp!r}, "
            f"{tp!r})), with a size of 1 for either one not used; or pass dp=/tp= with "
            "your mesh's names"
        )
    return mesh


def _check_splits(
    model: nn.Module, matched: list[tuple[str, str, nn.Module, Any]], degree: int
) -> None:
    """Each planned layer's split dimension, and the heads above it, divide by ``degree``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    api = "fasttorch.distributed.parallelize"
    for key, path, m, style in matched:
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        col = isinstance(style, ColwiseParallel)
        if isinstance(m, nn.Linear):
            what, size = ("out_features", m.out_features) if col else ("in_features", m.in_features)
        elif isinstance(m, nn.Embedding):
            what, size = (
                ("embedding_dim", m.embedding_dim) if col else ("num_embeddings", m.num_embeddings)
            )
        else:
            raise ValueError(
                f"{api}: plan key {key!r} names a {type(m).__name__}, not a Linear or "
                f"Embedding ({path!r}). {type(style).__name__} splits the weight of a Linear "
                "or an Embedding; name those layers, or use PrepareModuleInput/Output for "
                "the modules around them"
            )
        if size % degree:
            raise ValueError(
                f"{api}: {type(style).__name__} splits {path!r} ({type(m).__name__} with "
                f"{what}={size}) over tp={degree} ranks, which does not divide it. Choose a "
                f"tensor-parallel degree that divides {size}, or a width that tp divides"
            )
    _check_heads(model, [path for _, path, _, _ in matched], degree)


def _check_heads(model: nn.Module, planned: list[str], degree: int) -> None:
    for path, m in model.named_modules():
        inside = [p for p in planned if path == "" or p.startswith(path + ".")]
        for attr in HEAD_ATTRIBUTES:
            heads = getattr(m, attr, None)
            if inside and isinstance(heads, int) and heads % degree:
                raise ValueError(
                    f"fasttorch.distributed.parallelize: {type(m).__name__} "
                    f"{path or '(the root)'!r} has {attr}={heads} heads, which tp={degree} "
                    f"ranks do not split evenly (the plan splits {inside[0]!r} inside it, "
                    "each rank taking whole heads). Choose a tensor-parallel degree that "
                    f"divides {heads}"
                )


def _units(model: nn.Module, blocks: str | None) -> list[nn.Module]:
    if blocks is None:
        return []
    try:
        parent = model.get_submodule(blocks)
    except AttributeError:
        names = [n for n, _ in model.named_children()]
        raise ValueError(
            f"fasttorch.distributed.parallelize: blocks={blocks!r} names no submodule of "
            f"{type(model).__name__} (its children: {names}). Name the module whose "
            "children are the FSDP2 units (a transformer's ModuleList of blocks), or pass "
            "blocks=None to shard the root as one unit"
        ) from None
    return list(parent.children())


def _check_not_sharded(model: nn.Module) -> None:
    dtensor = imported_class("torch.distributed.tensor", "DTensor")
    for name, p in model.named_parameters():
        if isinstance(p, dtensor):
            raise ValueError(
                f"fasttorch.distributed.parallelize: {type(model).__name__}'s parameter "
                f"{name!r} is already a DTensor (sharded or parallelized before). Build "
                "the model anew (same seed on every rank) and parallelize it once"
            )
