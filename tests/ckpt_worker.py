"""Scripts the checkpoint tests run in fresh processes (plain python or torchrun).

    python tests/ckpt_worker.py MODE JSON_ARGS

Every mode builds the same model and step (``build``) so that a fresh process can
resume a checkpoint written by another, and writes what the test compares with
``torch.save`` into ``args["out"]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

import fasttorch
from fasttorch import checkpoint


class Net(torch.nn.Module):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.drop = torch.nn.Dropout(dropout)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.norm(self.inp(x)))))


def mse(apply: Any, batch: Any) -> Any:
    x, y = batch
    return torch.nn.functional.mse_loss(apply(x).float(), y)


def noisy_mse(apply: Any, batch: Any) -> Any:
    # Draws from the state's RNG without touching the gradients: ranks that seed
    # their RNG differently keep identical (replicated) parameters.
    return mse(apply, batch), {"noise": torch.rand(())}


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def build(kind: str, seed: int = 0) -> tuple[Any, fasttorch.TrainState]:
    """The step and a fresh (template) state; identical in every process."""
    torch.manual_seed(0)
    if kind == "full":  # every transform, compiled: fp16, accumulation across calls
        s = fasttorch.with_amp(fasttorch.step(mse), "fp16", init_scale=2.0**20)
        s = fasttorch.grad_accumulate(s, 2, across_calls=True)
        s = fasttorch.clip_scaled(fasttorch.ema(fasttorch.skip_nonfinite(s), 0.9), 1.0)
        s = fasttorch.compiled(s, backend="aot_eager")
        model: torch.nn.Module = Net()
    elif kind == "ranks":  # per-rank RNG, replicated parameters
        s = fasttorch.grad_accumulate(fasttorch.step(noisy_mse), 2, across_calls=True)
        s = fasttorch.clip_scaled(s, 1.0)
        model = Net(dropout=0.0)
    elif kind == "dp":  # data parallel through fasttorch.distributed
        from fasttorch.distributed import sync_on_last

        s = sync_on_last(fasttorch.clip_scaled(fasttorch.step(mse), 1.0))
        model = Net()
    elif kind == "crash":
        s = fasttorch.with_amp(fasttorch.step(mse), "fp16", init_scale=2.0**20)
        s = fasttorch.clip_scaled(fasttorch.skip_nonfinite(s), 1.0)
        model = Net()
    else:
        raise ValueError(kind)
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-2), seed=seed)
    return s, s.init(state)


def leaves(state: fasttorch.TrainState) -> dict[str, torch.Tensor]:
    pairs, _ = pytree.tree_flatten_with_path(state)
    return {pytree.keystr(p): t.detach().clone() for p, t in pairs}


def run(step: Any, state: Any, start: int, n: int) -> tuple[Any, list[dict[str, Any]]]:
    seen = []
    for i in range(start, start + n):
        state, metrics = step(state, batch(i))
        seen.append(pytree.tree_map(lambda t: t.detach().clone(), metrics))
    return state, seen


# --------------------------------------------------------------------------- kill injection


class SimulatedKill(BaseException):
    """Stands for a kill: nothing the library catches as an error catches it."""


FS_CALLS = ("rename", "replace", "unlink", "remove", "rmdir", "fsync")


@contextlib.contextmanager
def kill_at(k: int) -> Iterator[list[tuple[str, str]]]:
    """Raise SimulatedKill instead of the k-th filesystem change (rename, unlink, rmdir,
    fsync: every step of a save or prune, DCP's own included) made inside the block.
    Yields the list of calls made, the k-th last."""
    calls: list[tuple[str, str]] = []
    real = {n: getattr(os, n) for n in FS_CALLS}

    def wrap(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, str(args[0]) if args else ""))
            if len(calls) == k:
                raise SimulatedKill(f"killed before os.{name}{args}")
            return real[name](*args, **kwargs)

        return call

    try:
        for n in FS_CALLS:
            setattr(os, n, wrap(n))
        yield calls
    finally:
        for n, f in real.items():
            setattr(os, n, f)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


# --------------------------------------------------------------------------- modes


def resume(a: dict[str, Any]) -> None:
    """Load a.ckpt into a fresh template, run a.steps more calls."""
    step, template = build(a["kind"], a.get("seed", 0))
    state, data = checkpoint.load(a["ckpt"], template)
    micro = getattr(state.substates.get("grad_accumulate"), "micro", None)
    state, metrics = run(step, state, data["next"], a["steps"])
    torch.save({"leaves": leaves(state), "metrics": metrics, "micro": micro}, a["out"])


def dist_save(a: dict[str, Any]) -> None:
    """2 ranks: N calls, sync + async save, M more calls; record per rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    r = rank()
    step, state = build("ranks", seed=100 + r)
    state, _ = run(step, state, 0, a["n"])
    checkpoint.save(a["dir"], state, data={"next": a["n"]}, name="sync")
    at_n = leaves(state)
    handle = checkpoint.async_save(a["dir"], state, data={"next": a["n"]}, name="async")
    state, metrics = run(step, state, a["n"], a["m"])  # while the save runs
    handle.wait(timeout=60)
    out = {"at_n": at_n, "leaves": leaves(state), "metrics": metrics}
    torch.save(out, f"{a['out']}.rank{r}")
    dist.barrier()
    dist.destroy_process_group()


def dist_resume(a: dict[str, Any]) -> None:
    """2 fresh ranks: resume the 2-rank checkpoints; load a 1-rank one (resharding)."""
    import warnings

    import torch.distributed as dist

    dist.init_process_group("gloo")
    r = rank()
    step, template = build("ranks", seed=100 + r)
    out: dict[str, Any] = {}
    for name in ("sync", "async"):
        state, data = checkpoint.load(Path(a["dir"]) / name, template)
        state, metrics = run(step, state, data["next"], a["m"])
        out[name] = {"leaves": leaves(state), "metrics": metrics}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, data = checkpoint.load(a["single"], template)
    out["single"] = {
        "leaves": leaves(state),
        "data": data,
        "warnings": [str(w.message) for w in caught],
    }
    if a.get("dp"):
        out["dp"] = dp_check(Path(a["dir"]))
    torch.save(out, f"{a['out']}.rank{r}")
    dist.barrier()
    dist.destroy_process_group()


def dp_check(root: Path) -> bool:
    """fasttorch.distributed data parallel: 3 + save + 3 == 6 uninterrupted, per rank."""
    from fasttorch.distributed import replicate

    r = rank()

    def shard(i: int) -> Any:
        x, y = batch(i)
        return x[r * 4 : (r + 1) * 4], y[r * 4 : (r + 1) * 4]

    step, state = build("dp", seed=200 + r)
    state = replicate(state)
    for i in range(3):
        state, _ = step(state, shard(i))
    path = checkpoint.save(root / "dp", state, data={"next": 3})
    ref = state
    for i in range(3, 6):
        ref, _ = step(ref, shard(i))
    expect = leaves(ref)
    step2, template = build("dp", seed=200 + r)
    state, data = checkpoint.load(path, template)
    for i in range(data["next"], 6):
        state, _ = step2(state, shard(i))
    got = leaves(state)
    return all(torch.equal(expect[k], got[k]) for k in expect)


def crash(a: dict[str, Any]) -> None:
    """Train to a.total, checkpointing every a.every; die once at a.die_at."""
    torch.set_num_threads(a["threads"])
    step, state = build("crash")
    start = 0
    found = checkpoint.latest(a["dir"])
    if found is not None:
        state, data = checkpoint.load(found, state)
        start = data["next"]
    with Path(a["log"]).open("a") as log:
        log.write(f"start {start} from {found}\n")
    for i in range(start, a["total"]):
        if i == a["die_at"] and not Path(a["marker"]).exists():
            Path(a["marker"]).write_text("died once\n")
            os._exit(1)
        state, _ = step(state, batch(i))
        if (i + 1) % a["every"] == 0:
            checkpoint.save(a["dir"], state, data={"next": i + 1}, keep_last=2)
    torch.save(leaves(state), a["out"])


def kill(a: dict[str, Any]) -> None:
    """Save a small checkpoint, then SIGKILL ourselves in the middle of a big one."""
    state = fasttorch.TrainState.create(torch.nn.Linear(8, 4), fasttorch.optim.sgd(0.1))
    checkpoint.save(a["dir"], state, data={"next": 1}, name="good")
    big = fasttorch.TrainState.create(torch.nn.Linear(4096, 4096), fasttorch.optim.adam(0.1))
    root = Path(a["dir"])

    def killer() -> None:
        while True:  # as soon as the new checkpoint's first file exists
            for d in root.glob(".tmp.*"):
                if any(f.suffix == ".distcp" for f in d.iterdir()):
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0005)

    if a["where"] == "write":
        threading.Thread(target=killer, daemon=True).start()
    else:  # just before the rename that publishes the checkpoint
        real = os.rename

        def rename(src: Any, dst: Any) -> None:
            if Path(src).name.startswith(".tmp."):
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst)

        checkpoint.os.rename = rename  # type: ignore[attr-defined]
    checkpoint.save(a["dir"], big, name="big")
    print("not killed", flush=True)


def dist_kill(a: dict[str, Any]) -> None:
    """2 ranks: rank 0 is stopped before each filesystem change of publishing a same-name
    replacement, k = 1, 2, ...; after each, both ranks find, load and check the
    checkpoint. Then a failed write on rank 1, then rank 1 dies in the middle of a save."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    dist.init_process_group("gloo")
    r = rank()
    root = Path(a["dir"])
    saved = []
    states = []
    for i in range(2):  # per-rank RNG, shared parameters
        step, state = build("ranks", seed=100 + r)
        state, _ = run(step, state, 0, i + 1)
        states.append(state)
        saved.append(leaves(state))
    checkpoint.save(root / "base", states[0], name="ck", data={"v": 0, "rank": r})
    errors: list[str] = []
    publish = checkpoint._save._publish
    k = 1
    while True:
        d = root / f"k{k:03d}"
        if r == 0:
            shutil.copytree(root / "base", d)
        dist.barrier()
        calls: list[Any] = []
        outcome = "done"

        def killed_publish(plan: Any, k: int = k, calls: list[Any] = calls) -> None:
            with kill_at(k) as seen:
                try:
                    publish(plan)
                finally:
                    calls.extend(seen)

        if r == 0:
            checkpoint._save._publish = killed_publish  # type: ignore[assignment]
        try:
            checkpoint.save(d, states[1], name="ck", data={"v": 1, "rank": r})
        except SimulatedKill:
            outcome = "killed"
        except checkpoint.CheckpointError as e:
            outcome = "rank 0 failed" if "rank 0 could not complete" in str(e) else repr(e)
        finally:
            checkpoint._save._publish = publish  # type: ignore[assignment]
        done = calls[:-1] if outcome == "killed" else calls  # the last one did not happen
        published = any(n == "rename" and Path(p).name.startswith(".tmp.ck") for n, p in done)
        box: list[Any] = [(outcome, published, len(calls))]
        dist.broadcast_object_list(box, src=0)
        outcome0, published, n_calls = box[0]
        if r == 1 and outcome != ("rank 0 failed" if outcome0 == "killed" else "done"):
            errors.append(f"k={k}: rank 1 got {outcome} while rank 0 was {outcome0}")
        found = checkpoint.latest(d)
        if found is None:
            errors.append(f"k={k}: latest() found nothing")
        else:
            state, data = checkpoint.load(found, states[0])
            want = 1 if published or outcome0 == "done" else 0
            got = leaves(state)
            if data != {"v": want, "rank": r} or any(
                not torch.equal(got[x], saved[want][x]) for x in got
            ):
                errors.append(f"k={k}: {found.name} holds {data}, expected version {want}")
        dist.barrier()
        if r == 0:
            checkpoint.prune(d, keep_last=1)
            left = sorted(p.name for p in d.iterdir())
            if left != ["ck"]:
                errors.append(f"k={k}: prune left {left}")
        dist.barrier()
        if outcome0 == "done":
            steps = n_calls
            break
        k += 1

    # A write error on rank 1: every rank raises CheckpointError.
    real_write = FileSystemWriter.write_data

    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError("disk full (simulated)")

    if r == 1:
        FileSystemWriter.write_data = failing_write  # type: ignore[method-assign]
    write_error = ""
    try:
        checkpoint.save(root / "fail", states[1], data={"v": 1, "rank": r})
    except Exception as e:
        write_error = f"{type(e).__name__}: {e}"
    FileSystemWriter.write_data = real_write  # type: ignore[method-assign]
    out = {"errors": errors, "steps": steps, "write_error": write_error, "peer_died": ""}
    dist.barrier()

    # Rank 1 dies in the middle of a save: rank 0 raises CheckpointError.
    if r == 1:
        torch.save(out, f"{a['out']}.rank{r}")

        def die(self: Any, plan: Any, planner: Any) -> Any:
            os._exit(0)

        FileSystemWriter.write_data = die  # type: ignore[method-assign]
    try:
        checkpoint.save(root / "dead", states[1], data={"v": 1, "rank": r})
    except Exception as e:
        out["peer_died"] = f"{type(e).__name__}: {e}"
    torch.save(out, f"{a['out']}.rank{r}")
    os._exit(0)  # the group is broken: no collective shutdown


if __name__ == "__main__":
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(args.get("threads", 1))
    {
        "resume": resume,
        "dist_save": dist_save,
        "dist_resume": dist_resume,
        "crash": crash,
        "kill": kill,
        "dist_kill": dist_kill,
    }[mode](args)
