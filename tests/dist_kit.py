"""Spawned process groups for the tests: starting one (with a deadline, so a hang
fails), and joining and leaving it from a worker (dist_worker, fsdp_worker, ...)."""

from __future__ import annotations

import gc
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fasttorch.distributed import setup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_group(fn: Any, world: int, out: Path, *extra: Any, deadline_s: float = 420) -> list[Any]:
    """Run ``fn(rank, world, port, str(out), *extra)`` in ``world`` spawned processes
    and return each rank's ``out/rank{r}.json``; fail the test if they are not done
    within ``deadline_s`` (a hang), killing them."""
    ctx = mp.start_processes(
        fn,
        args=(world, free_port(), str(out), *extra),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    start = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - start > deadline_s:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world}-rank group did not finish within {deadline_s} s (a hang)")
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


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
