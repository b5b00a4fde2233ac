"""Starting data-parallel training: the process group, and a state put on it."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fasttorch._checks import warn_once
from fasttorch._core.state import initial_rng_state
from fasttorch.distributed.fsdp import sharded_leaves
from fasttorch.distributed.tensor_parallel import data_parallel_rank
from fasttorch.state import TrainState, check_alive

__all__ = ["backend_for", "replicate", "setup"]


def backend_for(device: torch.device | str) -> str:
    """The collective backend for a device: NCCL on CUDA, gloo on CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def setup(
    device: torch.device | str | None = None,
    *,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> tuple[int, int, torch.device]:
    """Join the process group ``torchrun`` describes; return ``(rank, world, device)``.

    The backend is picked from the device (:func:`backend_for`). With CUDA each process
    takes ``cuda:LOCAL_RANK``; left to choose (``device=None``) on a node that runs
    more processes than it has GPUs, every rank uses the CPU and gloo instead, and says
    so once. Outside torchrun (no ``WORLD_SIZE``) it does nothing and
    returns ``(0, 1, device)``. Launch with ``torchrun --standalone --nproc_per_node=N``
    on one machine, or ``--nnodes=M --node-rank=I --rdzv-endpoint=HOST:PORT`` across
    machines.
    """
    auto = device is None
    device = torch.device(device if device is not None else _default_device())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        return 0, 1, device
    if device.type == "cuda":
        device = _local_gpu(auto)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend_for(device), "timeout": timeout}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _local_gpu(auto: bool) -> torch.device:
    """``cuda:LOCAL_RANK``; the CPU for every rank of a node with too few GPUs (``auto``)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(local + 1)))
    count = torch.cuda.device_count()
    if max(local + 1, per_node) <= count:
        return torch.device("cuda", local)
    if auto:  # every rank of the node sees the same numbers, so all take the CPU
        warn_once(
            f"fasttorch.distributed.setup: {per_node} processes on this node but "
            f"{count} GPU(s): every rank runs on the CPU with gloo. Launch at most "
            f"{count} processes per node (torchrun --nproc_per_node={count}) to use "
            "the GPUs, or pass device='cpu' to choose the CPU and silence this"
        )
        return torch.device("cpu")
    raise ValueError(
        f"fasttorch.distributed.setup(device='cuda'): this process has LOCAL_RANK={local} "
        f"of {per_node} on its node but the node has {count} GPU(s), so cuda:{local} "
        f"does not exist. Launch at most {count} processes per node "
        f"(torchrun --nproc_per_node={count}), or use device='cpu' (gloo)"
    )


def replicate(state: TrainState, *, group: Any = None, src: int = 0) -> TrainState:
    """Put ``state`` on the process group: the same tensors everywhere, an RNG per rank.

    Every tensor leaf (parameters, buffers, optimizer and transform state) is broadcast
    from rank ``src`` in place, after checking that every rank has the same structure
    (names, shapes, dtypes), so a mismatch is a clear error rather than a hang. Each rank
    then gets its own RNG stream, derived from the state's generator and the rank, so
    dropout masks differ across ranks and are reproducible.

    In a sharded state (a module sharded with FSDP2) each rank keeps its own shards:
    they are parts of one model, which every rank must have built the same way (same
    seed) before ``fully_shard``. Everything else is broadcast as above. A model
    parallelized over a 2-D mesh (:func:`~fasttorch.distributed.parallelize`) draws one
    RNG stream per data-parallel rank, derived from rank ``src``'s generator: the ranks
    of a tensor-parallel group hold the same activations, so their dropout masks must
    agree. Call it again after loading a checkpoint saved on another mesh shape.

    Raises:
        RuntimeError: torch.distributed is not initialized, or ranks' states differ.
    """
    check_alive(state, "fasttorch.distributed.replicate")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fasttorch.distributed.replicate needs an initialized process group: launch "
            "with torchrun and call fasttorch.distributed.setup() first"
        )
    shards = sharded_leaves(state)
    leaves = [
        (pytree.keystr(path), x, shards.get(i))
        for i, (path, x) in enumerate(pytree.tree_flatten_with_path(state)[0])
        if isinstance(x, torch.Tensor) and x is not state.rng
    ]
    # A shard's signature is its parameter's global shape: shards differ in size.
    signature = [(k, tuple(x.shape if p is None else p.shape), str(x.dtype)) for k, x, p in leaves]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, signature, group=group)
    for rank, theirs in enumerate(gathered):
        if theirs != signature:
            first = next((a, b) for a, b in zip([*signature, None], [*theirs, None]) if a != b)
            raise RuntimeError(
                f"rank {rank}'s state differs from rank {dist.get_rank(group)}'s: "
                f"{first[1]} there, {first[0]} here. Build the same model, optimizer and "
                "transforms on every rank (and call step.init(state) on all or none)"
            )
    for _, x, p in leaves:
        if p is None:  # each rank keeps its own shards (FSDP2 sharded the same model)
            dist.broadcast(x, src=src, group=group)
    rng = state.rng
    data_rank = data_parallel_rank(state.module)
    if data_rank is not None:
        # Streams from rank src's generator: after a load on another mesh the ranks'
        # generators are those of the ranks saved, whose tensor-parallel groups differ.
        rng = rng.clone()
        dist.broadcast(rng, src=src, group=group)
    g = torch.Generator().manual_seed(0)
    g.set_state(rng.cpu() if rng.device.type != "cpu" else rng)
    base = int(torch.randint(0, 2**62, (1,), generator=g))
    rank = dist.get_rank(group) if data_rank is None else data_rank
    seed = (base + 1_000_003 * rank) % 2**63
    return state.replace(rng=initial_rng_state(state.device, seed))
