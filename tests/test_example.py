"""The main example job, examples/train_charlm.py, run small and eager."""

from __future__ import annotations

import json
import math
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from examples_kit import EXAMPLES, load_example, one_thread
from tolerance import gamma

from fasttorch import checkpoint

EXAMPLE = EXAMPLES / "train_charlm.py"

TINY = [
    "--no-compile",
    "--steps", "30",
    "--batch-size", "16",
    "--block-size", "32",
    "--n-layer", "1",
    "--n-embd", "32",
    "--n-head", "2",
    "--lr", "1e-2",
    "--log-every", "10",
    "--eval-batches", "4",
    "--max-bytes", "200000",
    "--device", "cpu",
]  # fmt: skip

SUMMARY_KEYS = {
    "device",
    "world",
    "fsdp",
    "tp",
    "torch",
    "params",
    "data_bytes",
    "vocab_size",
    "steps",
    "resumed_from",
    "initial_loss",
    "final_loss",
    "val_loss_initial",
    "val_loss",
    "val_loss_ema",
    "skipped_steps",
    "compile_s",
    "eval_s",
    "steps_per_s",
    "tokens_per_s",
    "wall_s",
    "peak_memory_bytes",
    "state_bytes",
    "checkpoint",
    "curves",
}
OPTIONAL = {"device", "torch", "resumed_from", "val_loss_ema", "checkpoint", "curves"}


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example(EXAMPLE)


_one_thread = pytest.fixture(autouse=True)(one_thread)


def _check(summary: dict[str, Any], steps: int) -> None:
    assert set(summary) == SUMMARY_KEYS
    for key in SUMMARY_KEYS - OPTIONAL:
        assert math.isfinite(summary[key]), (key, summary[key])
    assert summary["steps"] == steps
    assert summary["params"] > 0 and summary["data_bytes"] == 200_000
    assert 0 < summary["vocab_size"] <= 256
    # Near log(vocab) at the start, clearly lower at the end, on train and held-out data.
    assert summary["initial_loss"] > 0.8 * math.log(summary["vocab_size"])
    assert summary["final_loss"] < summary["initial_loss"] - 0.5
    assert summary["val_loss"] < summary["val_loss_initial"] - 0.5
    assert summary["steps_per_s"] > 0 and summary["wall_s"] > 0
    # float64 bookkeeping: two rates from one count and one time, a few roundings each.
    rel = gamma(4, torch.float64)
    assert summary["tokens_per_s"] == pytest.approx(summary["steps_per_s"] * 16 * 32, rel=rel)
    assert summary["peak_memory_bytes"] > 2**20
    assert not summary["fsdp"] and summary["state_bytes"] > 3 * 4 * summary["params"]  # AdamW
    # The chart's points: the last train window ends at the last step, and the last
    # held-out point is the final held-out loss.
    assert summary["curves"]["train"][-1][0] == steps
    assert summary["curves"]["held-out"][-1] == [steps, summary["val_loss"]]


def _outputs(out: Path, summary: dict[str, Any], curves: int) -> list[ET.Element]:
    """summary.json holds the returned summary; loss.svg is an SVG with one polyline
    per curve (train, held-out, and held-out EMA with --ema)."""
    assert json.loads((out / "summary.json").read_text()) == summary
    svg = ET.parse(out / "loss.svg").getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == curves
    for line in lines:
        for point in line.attrib["points"].split():
            x, y = map(float, point.split(","))
            assert 0 <= x <= float(svg.attrib["width"]) and 0 <= y <= float(svg.attrib["height"])
    return lines


def test_tiny_bf16_eager(
    example: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    summary = example.main([*TINY, "--out", str(tmp_path)])
    _check(summary, 30)
    assert summary["skipped_steps"] == 0
    assert summary["val_loss_ema"] is None and summary["checkpoint"] is None
    out = capsys.readouterr().out
    assert "torch" in out and "params" in out and "held-out loss" in out
    # Not a terminal: one plain line per log step (1, 10, 20, 30), in the shape parsed
    # by tests/test_distributed.py; steps/s on all but the first, which times itself.
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split("|")[0].split()[1] for s in steps] == ["1/30", "10/30", "20/30", "30/30"]
    assert "first step" in steps[0] and all("steps/s" in s and "mem " in s for s in steps[1:])
    lines = _outputs(tmp_path, summary, curves=2)
    assert len(lines[0].attrib["points"].split()) == 4  # train: one point per log step
    assert len(lines[1].attrib["points"].split()) == 2  # held-out: before and after


def test_tiny_fp16_accumulated(example: ModuleType, tmp_path: Path) -> None:
    summary = example.main([*TINY, "--precision", "fp16", "--accum", "2", "--out", str(tmp_path)])
    _check(summary, 30)
    # GradScaler may skip a few overflowing steps early on, never most of them.
    assert summary["skipped_steps"] < 5


def test_eval_and_ema(
    example: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    summary = example.main([*TINY, "--ema", "0.9", "--eval-every", "10", "--out", str(tmp_path)])
    _check(summary, 30)
    out = capsys.readouterr().out
    evals = [line for line in out.splitlines() if line.startswith("eval ")]
    assert [line.split()[1] for line in evals] == ["10", "20", "30"]
    assert all("held-out loss" in e and "held-out EMA loss" in e for e in evals)
    # The average lags the weights, but has learned too; it is a different model.
    ema = summary["val_loss_ema"]
    assert math.isfinite(ema) and ema < summary["val_loss_initial"] - 0.5
    assert ema != summary["val_loss"]
    _outputs(tmp_path, summary, curves=3)


def test_resume_continues_bit_exactly(example: ModuleType, tmp_path: Path) -> None:
    """Stop after 10 steps (keep only that checkpoint), resume: the same run as one go."""
    flags = [*TINY, "--ema", "0.9", "--eval-every", "10", "--ckpt-every", "10"]
    whole = example.main([*flags, "--ckpt-dir", str(tmp_path / "a"), "--out", str(tmp_path)])
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "step_000000010",
        "step_000000020",
        "step_000000030",
    ]
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step_000000010", tmp_path / "b" / "step_000000010")
    resumed = example.main(
        [*flags, "--ckpt-dir", str(tmp_path / "b"), "--resume", "--out", str(tmp_path / "r")]
    )
    assert resumed["resumed_from"] == 10 and whole["resumed_from"] is None
    for key in ("initial_loss", "final_loss", "val_loss_initial", "val_loss", "val_loss_ema"):
        assert resumed[key] == whole[key], key  # bit for bit
    a = checkpoint.model_state_dict(whole["checkpoint"])
    b = checkpoint.model_state_dict(resumed["checkpoint"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The curve saved with the checkpoint carries on: the same points as in one go.
    _outputs(tmp_path / "r", resumed, curves=3)
    assert (tmp_path / "r" / "loss.svg").read_text().count("<circle") == (
        tmp_path / "loss.svg"
    ).read_text().count("<circle")


def test_resume_without_a_checkpoint_starts_fresh(example: ModuleType, tmp_path: Path) -> None:
    summary = example.main(
        [
            *TINY,
            "--steps",
            "3",
            "--ckpt-dir",
            str(tmp_path / "c"),
            "--resume",
            "--out",
            str(tmp_path),
        ]
    )
    assert summary["resumed_from"] is None
    assert Path(summary["checkpoint"]).name == "step_000000003"


def test_profile_writes_a_trace(example: ModuleType, tmp_path: Path) -> None:
    trace_dir = tmp_path / "trace"
    example.main([*TINY, "--steps", "6", "--profile", str(trace_dir), "--out", str(tmp_path)])
    (trace,) = trace_dir.glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name") == "ProfilerStep#2" for e in events) >= 1  # steps 3-5 recorded


def test_batch_must_split_into_microbatches(example: ModuleType) -> None:
    with pytest.raises(SystemExit):
        example.main([*TINY, "--batch-size", "15", "--accum", "2"])


def test_resume_needs_a_checkpoint_dir(example: ModuleType) -> None:
    with pytest.raises(SystemExit):
        example.main([*TINY, "--resume"])


def test_tensorboard_event_file(example: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = example.main(
        [*TINY, "--steps", "20", "--tensorboard", str(tmp_path / "tb"), "--out", str(tmp_path)]
    )
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/loss_avg", "train/lr", "train/grad_norm"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 10, 20]  # the log steps
    assert acc.Scalars("train/loss")[-1].value == pytest.approx(summary["final_loss"], rel=1e-6)
    held_out = acc.Scalars("eval/held-out")
    assert [e.step for e in held_out] == [0, 20]
    assert held_out[-1].value == pytest.approx(summary["val_loss"], rel=1e-6)  # float32 file
