"""Joining the process group of a spawned test worker (dist_worker, fsdp_worker, ...)."""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.distributed as dist

from fasttorch.distributed import setup


def join(rank: int, world: int, port: int, device: str = "cpu") -> Any:
    """Rank ``rank`` of ``world`` on 127.0.0.1:``port``, as torchrun would set it up;
    on the CPU one torch thread per rank (the ranks share the machine's cores)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    if device == "cpu":
        torch.set_num_threads(1)
    return setup(device)


def leave() -> None:
    """Leave the group: first free what still references it, then destroy it together.

    FSDP2's modules hold the group in reference cycles; a gloo group they still
    reference when the interpreter exits sometimes aborts the process there
    ("terminate called without an active exception"), which fails the spawn.
    """
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
