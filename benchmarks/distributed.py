"""fasttorch data parallel, replicated and sharded with FSDP2, against DDP with no_sync.

    python -m benchmarks.distributed            # rewrites docs/benchmarks_distributed.md
    python -m benchmarks.distributed --smoke    # tiny model, one round: the machinery only

Same model, initial weights and data in every variant; 4 microbatches per update,
gradients reduced on the last only (DDP: ``no_sync()`` on the first three; FSDP2:
``set_requires_gradient_sync(False)``), clip at 1.0, AdamW. The variants:

* DDP with ``no_sync``, the baseline of every ratio;
* fasttorch's replicated reducer (``replicate`` + ``sync_on_last``), eager and compiled;
* the hand-written FSDP2 loop (``fully_shard`` per block and on the root,
  ``reshard_after_forward=False``, ``set_reshard_after_backward`` off but on the last
  microbatch, ``clip_grad_norm_``, ``torch.optim.AdamW`` foreach);
* fasttorch over the same FSDP2 sharding (``TrainState.create`` on the sharded module,
  the same ``sync_on_last`` step), ``reshard_after_forward`` True and False, eager and
  compiled (over a sharded state ``compiled`` compiles the update only), and with the
  blocks compiled by ``block.compile()`` before ``fully_shard`` as torchtitan does.

They alternate within one process group, round after round (A B C A B C), each timed
over a block of steps after untimed warm-up; compilation happens before, untimed. The
table gives medians, ratios to DDP, the largest parameter difference from DDP after the
same steps (FSDP2's shards gathered whole) and each rank's bytes of parameters plus
optimizer state (its own shards under FSDP2).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fasttorch
from fasttorch.distributed import replicate, sync_on_last
from fasttorch.distributed.fsdp import as_dtensor

ROOT = Path(__file__).resolve().parent.parent
N_MICRO = 4
BASE = "DDP no_sync"
Batch = tuple[torch.Tensor, torch.Tensor]


class Block(nn.Module):
    """Linear, LayerNorm (or none), GELU: a unit of the user's own code, which
    ``block.compile()`` can capture (dynamo skips ``nn.Sequential``'s own frames)."""

    def __init__(self, d_in: int, d_out: int, norm: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.norm(self.lin(x)))


class MLP(nn.Module):
    """An input block, ``depth`` hidden blocks, an output layer: the units FSDP2 shards
    (each block, then the root, which holds the output layer)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = Block(64, width, norm=False)
        self.blocks = nn.ModuleList(Block(width, width, norm=True) for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)  # type: ignore[no-any-return]


def make_model(width: int, depth: int) -> MLP:
    torch.manual_seed(0)
    return MLP(width, depth)


def shard(model: nn.Module, reshard: bool, compile_blocks: str | None = None) -> nn.Module:
    """``model`` sharded with FSDP2 per block and on the root; the blocks compiled first
    (with backend ``compile_blocks``) when given, as torchtitan does."""
    units = [model.inp, *model.blocks]  # type: ignore[union-attr]
    for unit in units:
        if compile_blocks:
            unit.compile(backend=compile_blocks, fullgraph=True)
        fully_shard(unit, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def data(steps: int, micro_rows: int, rank: int) -> list[Batch]:
    g = torch.Generator().manual_seed(1000 + rank)
    rows = N_MICRO * micro_rows
    return [
        (torch.randn(rows, 64, generator=g), torch.randint(0, 10, (rows,), generator=g))
        for _ in range(steps)
    ]


def loss_fn(apply, batch):  # type: ignore[no-untyped-def]
    x, y = batch
    return nn.functional.cross_entropy(apply(x), y)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(tensors: Iterable[Any]) -> int:
    """Bytes of this rank's part of ``tensors`` (a DTensor's local shard)."""
    ts = [local(t) for t in tensors if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in ts)


class HandLoop:
    """The loop people write: DDP with ``no_sync``, or FSDP2 with the gradient sync off
    on all but the last microbatch; then ``clip_grad_norm_`` and AdamW (foreach)."""

    def __init__(self, model: nn.Module, fsdp: bool) -> None:
        if fsdp:
            self.model = shard(copy.deepcopy(model), reshard=False)
        else:
            self.model = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        self.fsdp = fsdp
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        if self.fsdp:
            self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
            # FSDP2's recipe for accumulation: keep the parameters gathered to the last
            # microbatch (set_reshard_after_backward's docstring), one all-gather per unit
            # per step.
            self.model.set_reshard_after_backward(last)  # type: ignore[operator]
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.model.no_sync()  # type: ignore[operator]

    def __call__(self, batch: Batch) -> None:
        micro = list(zip(batch[0].tensor_split(N_MICRO), batch[1].tensor_split(N_MICRO)))
        for i, mb in enumerate(micro):
            with self.no_sync(i == N_MICRO - 1):
                (loss_fn(self.model, mb) / N_MICRO).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def params(self) -> dict[str, torch.Tensor]:
        module = self.model if self.fsdp else self.model.module
        return {
            k: v.detach().full_tensor() if isinstance(v, DTensor) else v.detach()
            for k, v in module.named_parameters()  # type: ignore[operator]
        }

    def state_bytes(self) -> int:
        moments = [t for s in self.opt.state.values() for t in s.values()]
        return nbytes([*self.model.parameters(), *moments])


class FastVariant:
    """fasttorch's step, over a replicated state (``fsdp=None``) or a sharded one."""

    def __init__(
        self,
        model: nn.Module,
        backend: str | None,
        fsdp: dict[str, Any] | None = None,
    ) -> None:
        step = sync_on_last(fasttorch.grad_accumulate(fasttorch.step(loss_fn), N_MICRO))
        step = fasttorch.clip_scaled(step, 1.0)
        self.step = fasttorch.compiled(step, backend=backend) if backend else step
        opt = fasttorch.optim.adamw(1e-3, weight_decay=1e-2)
        model = copy.deepcopy(model)
        if fsdp is not None:
            model = shard(model, **fsdp)
        self.state = replicate(fasttorch.TrainState.create(model, opt))

    def __call__(self, batch: Batch) -> None:
        self.state, _ = self.step(self.state, batch)

    def params(self) -> dict[str, torch.Tensor]:
        like = dict(self.state.module.named_parameters())
        return {
            k: as_dtensor(t, like[k]).full_tensor() if isinstance(like[k], DTensor) else t
            for k, t in self.state.params.items()
        }

    def state_bytes(self) -> int:
        return nbytes(pytree.tree_leaves((self.state.params, self.state.opt_state)))


def variants(model: nn.Module, backend: str) -> dict[str, Callable[[], Any]]:
    """Name -> constructor, in the order each round runs them (the baseline first)."""
    return {
        BASE: lambda: HandLoop(model, fsdp=False),
        "fasttorch reducer": lambda: FastVariant(model, None),
        "fasttorch reducer, compiled": lambda: FastVariant(model, backend),
        "FSDP2 loop, reshard=False": lambda: HandLoop(model, fsdp=True),
        "fasttorch FSDP2, reshard=True": lambda: FastVariant(model, None, {"reshard": True}),
        "fasttorch FSDP2, reshard=False": lambda: FastVariant(model, None, {"reshard": False}),
        "fasttorch FSDP2, reshard=True, compiled": lambda: FastVariant(
            model, backend, {"reshard": True}
        ),
        "fasttorch FSDP2, reshard=False, compiled": lambda: FastVariant(
            model, backend, {"reshard": False}
        ),
        "fasttorch FSDP2, reshard=False, compiled + blocks compiled": lambda: FastVariant(
            model, backend, {"reshard": False, "compile_blocks": backend}
        ),
    }


COLLECTIVES = {  # the c10d ops a step issues, by the profiler's names, and their short names
    "c10d::allgather_": "AG",
    "c10d::_allgather_base_": "AG",
    "c10d::reduce_scatter_": "RS",
    "c10d::_reduce_scatter_base_": "RS",
    "c10d::allreduce_": "AR",
}


def count_collectives(variant: Callable[[Batch], None], batch: Batch) -> dict[str, int]:
    """The collectives one step issues (after warm-up: none of them compiles)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        variant(batch)
    out = dict.fromkeys(("AG", "RS", "AR"), 0)
    for e in prof.events():
        if e.name in COLLECTIVES:
            out[COLLECTIVES[e.name]] += 1
    return out


def worker(rank: int, port: int, cfg: dict[str, Any], out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    model = make_model(cfg["width"], cfg["depth"])
    built = {name: make() for name, make in variants(model, cfg["backend"]).items()}
    # Equal parameters: the same steps from the same weights. The first steps also
    # compile (untimed): their time, compilation included, is reported.
    check = data(cfg["check_steps"], cfg["micro_rows"], rank)
    first_s: dict[str, float] = {}
    for name, v in built.items():
        dist.barrier()
        t = time.perf_counter()
        for b in check:
            v(b)
        first_s[name] = time.perf_counter() - t
    ref = built[BASE].params()
    start = dict(model.named_parameters())
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)  # DDP's own steps
    diffs = {}
    for name, v in built.items():
        mine = v.params()
        diffs[name] = max(float((mine[k] - ref[k]).abs().max()) for k in ref)
    state_bytes = {name: v.state_bytes() for name, v in built.items()}
    collectives = {name: count_collectives(v, check[0]) for name, v in built.items()}
    # Timing: interleaved rounds of blocks, after warm-up.
    batches = data(cfg["block"], cfg["micro_rows"], rank)
    times: dict[str, list[float]] = {n: [] for n in built}
    for _ in range(cfg["rounds"]):
        for name, v in built.items():
            for b in batches[: cfg["warmup"]]:
                v(b)
            dist.barrier()
            t = time.perf_counter()
            for b in batches:
                v(b)
            dist.barrier()
            times[name].append((time.perf_counter() - t) / len(batches))
    every_bytes: list[Any] = [None, None]
    dist.all_gather_object(every_bytes, state_bytes)
    if rank == 0:
        res = {
            "times": times,
            "diffs": diffs,
            "first_s": first_s,
            "state_bytes": every_bytes,
            "collectives": collectives,
            "moved": moved,
        }
        Path(out).write_text(json.dumps(res))
    # FSDP2's modules hold the group in reference cycles: free them first (a gloo group
    # they still reference at exit can abort the process), then leave together.
    built.clear()
    del v
    gc.collect()
    dist.barrier()  # neither rank leaves the group while the other still uses it
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SMOKE = {
    "width": 32,
    "depth": 1,
    "micro_rows": 4,
    "rounds": 1,
    "block": 2,
    "warmup": 1,
    "check_steps": 2,
    "backend": "eager",
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--micro-rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block", type=int, default=30, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--check-steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--smoke", action="store_true", help=f"tiny and quick: {SMOKE}")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks_distributed.md"))
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE)
    return a


def header(check_steps: int) -> str:
    cols = [
        "variant",
        "ms/step (median)",
        "speed vs DDP",
        "ms/step per round",
        "max abs param diff vs DDP",
        "state MiB per rank",
        "collectives per step",
        f"first {check_steps} steps (s)",
    ]
    return f"| {' | '.join(cols)} |\n|{' --- |' * len(cols)}"


def table(res: dict[str, Any]) -> list[str]:
    base = statistics.median(res["times"][BASE])
    base_bytes = max(b[BASE] for b in res["state_bytes"])
    rows = []
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        diff = "reference" if name == BASE else f"{res['diffs'][name]:.1e}"
        per_rank = [b[name] for b in res["state_bytes"]]
        mem = "/".join(f"{b / 2**20:.2f}" for b in sorted(set(per_rank)))
        rows.append(
            f"| {name} | {med * 1e3:.2f} | {base / med:.2f}x | "
            f"{' '.join(f'{t * 1e3:.1f}' for t in ts)} | {diff} | "
            f"{mem} ({max(per_rank) / base_bytes:.2f}x) | "
            f"{' '.join(f'{n} {k}' for k, n in res['collectives'][name].items() if n)} | "
            f"{res['first_s'][name]:.1f} |"
        )
    return rows


def verdict(res: dict[str, Any], units: int) -> str:
    """The conclusion's lines, from the medians: "A at Nx B" is A's speed over B's."""
    med = {n: statistics.median(ts) for n, ts in res["times"].items()}
    mine, hand = "fasttorch FSDP2, reshard=False", "FSDP2 loop, reshard=False"
    best = min((n for n in med if n.startswith(mine)), key=med.__getitem__)

    def at(a: str, b: str) -> str:
        return f"{med[b] / med[a]:.2f}x"

    def calls(name: str) -> str:
        return " ".join(f"{n} {k}" for k, n in res["collectives"][name].items() if n)

    gathers = res["collectives"][mine]["AG"]
    per_micro = (
        f": one all-gather per unit ({units} units) per step, the parameters kept "
        f"gathered across the {N_MICRO} microbatches"
        if gathers == units
        else ""
    )
    met = "met" if med[BASE] / med[mine] >= 1.0 else "missed"
    return (
        f"- Is fasttorch over FSDP2 with `reshard_after_forward=False` as fast as DDP with "
        f"`no_sync`? Eager: {at(mine, BASE)} DDP's speed (target >= 1.0x: {met}). "
        f'Its fastest form here, "{best}": {at(best, BASE)}.\n'
        f"- Against fasttorch's replicated reducer: {at(mine, 'fasttorch reducer')} "
        f"(eager against eager); {at(best, 'fasttorch reducer, compiled')} (its fastest "
        f"form against the compiled reducer).\n"
        f"- Against the hand-written FSDP2 loop with the same sharding: {at(mine, hand)}; "
        f"that loop ran at {at(hand, BASE)} DDP's speed.\n"
        f"- `reshard_after_forward=True` (eager): {at('fasttorch FSDP2, reshard=True', mine)} "
        f"the speed of `False`.\n"
        f"- Per step DDP issued {calls(BASE)}; the FSDP2 loop {calls(hand)}; fasttorch "
        f"over FSDP2 {calls(mine)} (`reshard_after_forward=False`){per_micro}."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse(argv)
    cfg = vars(a)
    with tempfile.TemporaryDirectory() as tmp:
        res_path = os.path.join(tmp, "r.json")
        # A fresh inductor cache: the first steps' time is a cold compile on every run.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        mp.spawn(worker, args=(free_port(), cfg, res_path), nprocs=2, join=True)
        res: dict[str, Any] = json.loads(Path(res_path).read_text())
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    bad = [n for n, d in res["diffs"].items() if not math.isfinite(d)]
    n_params = sum(q.numel() for q in make_model(a.width, a.depth).parameters())
    text = f"""# Data parallel: fasttorch, replicated and over FSDP2, against DDP

Generated by `python -m benchmarks.distributed` on {datetime.date.today()}; do not edit
by hand. Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores,
Python {platform.python_version()}, torch {torch.__version__}. 2 gloo ranks on one
machine, {a.threads} torch thread(s) each, `OMP_WAIT_POLICY={os.environ.get("OMP_WAIT_POLICY")}`.
CPU only: no GPU was measured.

Work: an MLP of {n_params / 1e6:.2f}M parameters (width {a.width}, an input layer,
{a.depth} hidden blocks of Linear, LayerNorm and GELU, an output layer), fp32, 4
microbatches of {a.micro_rows} rows per rank and update, gradients reduced on the last
microbatch only (DDP: `no_sync()` on the first three; FSDP2:
`set_requires_gradient_sync(False)`), `clip_grad_norm_(1.0)`, AdamW (`foreach`; fasttorch:
its own AdamW, the same update). The FSDP2 variants shard with `fully_shard` the input
layer, each block and then the root (which holds the output layer): {a.depth + 2} units.
"compiled" is `fasttorch.compiled(step, backend="{a.backend}")`: over a replicated state
it compiles the forward, backward and update (the last microbatch's backward runs
eagerly, its hooks launching the all-reduces); over a sharded state FSDP2's hooks cannot
be in a graph, so it compiles the update only and the forward and backward run eagerly,
unless the blocks were compiled by `block.compile(backend="{a.backend}")` before
`fully_shard` (the last row; the root's output layer and the loss stay eager).

Each round runs every variant for {a.warmup} untimed steps, then a block of {a.block}
timed steps between barriers; variants alternate within each of {a.rounds} rounds, in
the order of the table. "max abs param diff" is the largest parameter difference from
DDP after {a.check_steps} identical steps from the same weights and data (FSDP2's
shards gathered whole with `DTensor.full_tensor()`); those first steps, compilation
included, are untimed, and their wall time is the last column (a cold compile: each run
starts from an empty inductor cache, probe of the C++ compiler's instruction sets
included, which the first compiled variant pays). "state MiB per rank" is
the bytes of parameters plus optimizer state (AdamW's two moments and step counters)
each rank holds: its own shards under FSDP2, and the ratio to DDP's. "collectives per
step" counts the all-gathers (AG), reduce-scatters (RS) and all-reduces (AR) of one step,
by `torch.profiler`'s c10d events on rank 0.

{header(a.check_steps)}
{chr(10).join(table(res))}

## Conclusion

Measured on this machine only (2 gloo ranks on a {os.cpu_count()}-core CPU, shared with
other processes; see the rounds for the spread):

{verdict(res, a.depth + 2)}
"""
    if bad:
        text += f"\nNon-finite parameters after the check steps: {', '.join(bad)}.\n"
    Path(a.out).write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
