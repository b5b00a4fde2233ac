"""The main job sharded with FSDP2 (``--fsdp``): under torchrun on 2 gloo ranks it trains
as the replicated 2-rank run does, eager and with its blocks compiled, on 1/2 of the
parameter and optimizer bytes per rank; alone it shards over a group of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from examples_kit import EXAMPLES, load_example, one_thread
from tolerance import LoopError, loss_atol, reference_error

EXAMPLE = EXAMPLES / "train_charlm.py"
STEPS, BATCH, BLOCK, LAYERS, WIDTH, LR, SEED, WORLD, ACCUM = 8, 8, 16, 2, 32, 1e-2, 0, 2, 2
ARGS = [
    "--steps", str(STEPS),
    "--batch-size", str(BATCH),
    "--accum", str(ACCUM),
    "--block-size", str(BLOCK),
    "--n-layer", str(LAYERS),
    "--n-embd", str(WIDTH),
    "--n-head", "2",
    "--dropout", "0",  # inductor's and eager's dropout masks differ
    "--precision", "fp32",
    "--lr", str(LR),
    "--seed", str(SEED),
    "--log-every", "1",  # summary["curves"]["train"]: every step's loss, unrounded
    "--eval-every", "4",  # held-out loss of the sharded state mid-run, then training on
    "--eval-batches", "2",
    "--max-bytes", "200000",
    "--threads", "1",
    "--device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example(EXAMPLE)


_one_thread = pytest.fixture(autouse=True)(one_thread)


def torchrun(out: Path, *flags: str, nproc: int = WORLD) -> tuple[dict[str, Any], str]:
    """The example under ``torchrun --standalone --nproc_per_node=2``: summary and stdout."""
    root = EXAMPLES.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(
        [*launcher, f"--nproc_per_node={nproc}", str(EXAMPLE), *ARGS, *flags, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "summary.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The replicated 2-rank run, eager: the reference of the eager and compiled sharded
    runs (rule 2 holds for any two fp32 orders of the same mathematics, and a compiled
    replicated run would cost 20-40 s more of compilation on two cores)."""
    summary, _ = torchrun(tmp_path_factory.mktemp("replicated"), "--no-compile")
    assert summary["world"] == WORLD and not summary["fsdp"]
    return summary


@pytest.fixture(scope="module")
def loop_error(example: ModuleType) -> tuple[LoopError, torch.nn.Module]:
    """Rule 2 of tests/tolerance.py for this job: the error of the hand-written fp32 loop
    (the same model, batches, AdamW groups, schedule and clipping) against the same loop
    in float64. Sharded and replicated runs compute the same mathematics in a different
    order (FSDP2 reduce-scatters the gradients where the replicated run all-reduces them,
    the global norm is summed from shards, compiled blocks fuse their kernels), so each is
    within this error of the exact result and the two within ``FACTOR`` x it of each other
    (tolerance.loss_atol). One window more than the runs train: its loss is computed with
    the parameters after every update, as the final held-out loss is."""
    raw, _ = example.stdlib_source(200_000)
    vocab = example.ByteVocab(raw)
    tokens = vocab.encode(raw)
    train, _ = example.split_tokens(tokens, BLOCK, 0.1)
    draw = example.Batches(train, BLOCK, BATCH, SEED)  # the global batch every rank draws
    # Each rank's rows split in ACCUM microbatches: WORLD * ACCUM microbatches in order.
    windows = [list(zip(*(t.tensor_split(WORLD * ACCUM) for t in draw()))) for _ in range(9)]
    torch.manual_seed(SEED)
    model = example.CharGPT(len(vocab), BLOCK, LAYERS, WIDTH, 2, 0.0, tie_weights=True)
    names = [name for name, _ in model.named_parameters()]  # the copies' order too
    skip = example.no_decay(model)
    schedule = example.lr_schedule(LR, 3e-4, max(1, STEPS // 10), STEPS)

    def make_opt(params: Any) -> torch.optim.Optimizer:
        named = list(zip(names, params))
        return torch.optim.AdamW(
            [
                {"params": [p for n, p in named if not skip(n, p)], "weight_decay": 0.1},
                {"params": [p for n, p in named if skip(n, p)], "weight_decay": 0.0},
            ],
            lr=LR,
        )

    def loss_fn(apply: Any, batch: Any) -> torch.Tensor:  # the example's, in any dtype
        x, y = batch
        return F.cross_entropy(apply(x).flatten(0, 1), y.flatten())

    error = reference_error(
        model,
        windows,
        make_opt=make_opt,
        loss_fn=loss_fn,
        clip=1.0,
        lr_at=lambda i: float(schedule(torch.tensor(i))),
    )
    return error, model


def assert_same_run(sharded: dict[str, Any], replicated: dict[str, Any], error: LoopError) -> None:
    """Every step's train loss and every held-out loss within rule 2's bound."""
    for name, points in replicated["curves"].items():
        theirs = sharded["curves"][name]
        assert [s for s, _ in theirs] == [s for s, _ in points], name
        losses = torch.tensor([v for _, v in points])
        bound = loss_atol(error, losses)
        # Finer than the 4 decimals the progress line prints, which
        # tests/test_distributed.py compares: else this check would add nothing to that.
        assert bound < 1e-4, (name, bound, error)
        diff = max(abs(a - b) for (_, a), (_, b) in zip(theirs, points))
        assert diff <= bound, (name, diff, bound, theirs, points)
    assert len(sharded["curves"]["train"]) == STEPS
    assert [s for s, _ in sharded["curves"]["held-out"]] == [0, 4, 8]
    assert sharded["final_loss"] < sharded["initial_loss"] - 0.3  # and it learns


def shard_bytes(model: torch.nn.Module, rank: int) -> tuple[int, int]:
    """Bytes of the whole parameters, and of ``rank``'s shards: FSDP2 gives rank r rows
    ``[r * ceil(d0 / WORLD), ...)`` of each parameter's dim 0."""
    whole = mine = 0
    for p in model.parameters():
        rows = -(-p.shape[0] // WORLD)
        kept = max(0, min(rows, p.shape[0] - rank * rows))
        whole += p.numel() * p.element_size()
        mine += kept * (p.numel() // p.shape[0]) * p.element_size()
    return whole, mine


def check_sharded(
    summary: dict[str, Any], out: str, replicated: dict[str, Any], model: torch.nn.Module
) -> None:
    assert summary["world"] == WORLD and summary["fsdp"]
    assert "sharded: FSDP2 over 2 ranks (fully_shard per block x2, then the root)" in out
    # Rank 0 holds its shard of each parameter and of AdamW's two moments; the scalars
    # (step count, hyperparameters) are the replicated state's.
    whole, mine = shard_bytes(model, 0)
    assert summary["state_bytes"] == replicated["state_bytes"] - 3 * (whole - mine)
    assert summary["state_bytes"] < 0.55 * replicated["state_bytes"]


def test_sharded_eager_matches_replicated(
    tmp_path: Path, replicated: dict[str, Any], loop_error: tuple[LoopError, torch.nn.Module]
) -> None:
    summary, out = torchrun(tmp_path, "--fsdp", "--no-compile")
    error, model = loop_error
    check_sharded(summary, out, replicated, model)
    assert "compiled:" not in out
    assert_same_run(summary, replicated, error)


@pytest.mark.slow
def test_sharded_compiled_blocks_match_replicated(
    tmp_path: Path, replicated: dict[str, Any], loop_error: tuple[LoopError, torch.nn.Module]
) -> None:
    """Blocks compiled by inductor before fully_shard, the update by fasttorch.compiled;
    against the eager replicated run (see ``replicated``)."""
    summary, out = torchrun(tmp_path, "--fsdp")
    error, model = loop_error
    check_sharded(summary, out, replicated, model)
    assert "compiled: each block's forward and backward (block.compile() before" in out
    assert_same_run(summary, replicated, error)


def test_one_process_shards_over_a_group_of_one(
    example: ModuleType,
    tmp_path: Path,
    replicated: dict[str, Any],
    loop_error: tuple[LoopError, torch.nn.Module],
) -> None:
    """Without torchrun, ``--fsdp`` starts a process group of one rank for FSDP2's mesh
    (and ends it); the run is the 2-rank run's mathematics with 2 microbatches of 4 rows
    in place of 4 of 2: rule 2 again."""
    summary = example.main([*ARGS, "--fsdp", "--no-compile", "--out", str(tmp_path)])
    assert not torch.distributed.is_initialized()
    assert summary["world"] == 1 and summary["fsdp"]
    assert summary["state_bytes"] == replicated["state_bytes"]  # one rank holds it all
    assert_same_run(summary, replicated, loop_error[0])


def test_without_torch_distributed_the_error_says_so(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"--fsdp shards with torch.distributed.*without --fsdp"):
        example.main([*ARGS, "--fsdp"])


def test_sharded_resume_is_bit_exact_and_evaluates_the_ema(
    tmp_path: Path, loop_error: tuple[LoopError, torch.nn.Module]
) -> None:
    """``--fsdp --ckpt-dir``: stop at step 4 (keep only that checkpoint), resume on 2
    ranks: the same run as in one go, bit for bit (DCP reshards nothing here: the same
    2 ranks). ``--ema``: its held-out loss is the replicated run's EMA loss (rule 2),
    not the live weights' (the averages are copied into the module's shards for it)."""
    import shutil

    from fasttorch import checkpoint

    flags = ["--fsdp", "--no-compile", "--ema", "0.9", "--ckpt-every", "4"]
    whole, _ = torchrun(tmp_path / "whole", *flags, "--ckpt-dir", str(tmp_path / "a"))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "step_000000004",
        "step_000000008",
    ]
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step_000000004", tmp_path / "b" / "step_000000004")
    resumed, _ = torchrun(
        tmp_path / "resumed", *flags, "--ckpt-dir", str(tmp_path / "b"), "--resume"
    )
    assert resumed["resumed_from"] == 4 and whole["resumed_from"] is None
    for key in ("initial_loss", "final_loss", "val_loss_initial", "val_loss", "val_loss_ema"):
        assert resumed[key] == whole[key], key  # bit for bit
    # Both checkpoints hold the whole parameters (2 -> 1: read in this plain process).
    a = checkpoint.model_state_dict(whole["checkpoint"])
    b = checkpoint.model_state_dict(resumed["checkpoint"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    plain, _ = torchrun(tmp_path / "plain", "--no-compile", "--ema", "0.9")
    error, _ = loop_error
    for key in ("val_loss", "val_loss_ema"):
        bound = loss_atol(error, torch.tensor([plain[key]]))
        assert abs(whole[key] - plain[key]) <= bound, (key, whole[key], plain[key], bound)
    assert whole["val_loss_ema"] != whole["val_loss"]


@pytest.mark.gpu
def test_sharded_on_gpus_with_nccl(tmp_path: Path) -> None:
    """``--fsdp --device cuda``: a GPU per rank (2 where there are 2, else one rank) with
    NCCL, bf16, blocks compiled by inductor: it trains, and each rank holds its shards."""
    nproc = min(2, torch.cuda.device_count())
    flags = ["--fsdp", "--device", "cuda", "--precision", "bf16"]
    summary, out = torchrun(tmp_path, *flags, nproc=nproc)
    assert summary["world"] == nproc and summary["fsdp"]
    assert f"sharded: FSDP2 over {nproc} rank" in out
    assert summary["final_loss"] < summary["initial_loss"] - 0.3
    for key in ("val_loss", "final_loss"):
        assert summary[key] == summary[key], key  # not NaN


def test_tensor_parallel_2x2_matches_replicated(
    tmp_path: Path, replicated: dict[str, Any], loop_error: tuple[LoopError, torch.nn.Module]
) -> None:
    """``--tp 2`` on 4 ranks: a 2 x 2 mesh, each block split by heads over 2 ranks and
    FSDP2 over the 2 pairs, each pair on its half of the batch (eager: the compiled
    update is tests/test_tensor_parallel.py's, without inductor). Rule 2 against the
    replicated run (tensor parallelism splits sums over ranks, the fused qkv layer is
    three layers holding its rows)."""
    summary, out = torchrun(tmp_path, "--tp", "2", "--no-compile", nproc=4)
    error, _ = loop_error
    assert summary["world"] == 4 and summary["fsdp"] and summary["tp"] == 2
    assert "sharded: a 2 x 2 mesh, tensor parallel over 2 ranks inside each block" in out
    assert summary["state_bytes"] < 0.3 * replicated["state_bytes"]  # 1/4 of most tensors
    assert_same_run(summary, replicated, error)
