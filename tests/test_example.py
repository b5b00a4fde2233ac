"""The main example job, examples/train_charlm.py, run small and eager."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_charlm.py"

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
    "torch",
    "params",
    "data_bytes",
    "vocab_size",
    "steps",
    "initial_loss",
    "final_loss",
    "val_loss_initial",
    "val_loss",
    "skipped_steps",
    "compile_s",
    "steps_per_s",
    "wall_s",
}


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_charlm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread, and on a shared two-core box
    spinning OpenMP waiters make them up to 10x slower (the script sets
    OMP_WAIT_POLICY=PASSIVE for that, which is too late once conftest imported torch)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _check(summary: dict[str, Any], steps: int) -> None:
    assert set(summary) == SUMMARY_KEYS
    for key in SUMMARY_KEYS - {"device", "torch"}:
        assert math.isfinite(summary[key]), (key, summary[key])
    assert summary["steps"] == steps
    assert summary["params"] > 0 and summary["data_bytes"] == 200_000
    assert 0 < summary["vocab_size"] <= 256
    # Near log(vocab) at the start, clearly lower at the end, on train and held-out data.
    assert summary["initial_loss"] > 0.8 * math.log(summary["vocab_size"])
    assert summary["final_loss"] < summary["initial_loss"] - 0.5
    assert summary["val_loss"] < summary["val_loss_initial"] - 0.5
    assert summary["steps_per_s"] > 0 and summary["wall_s"] > 0


def test_tiny_bf16_eager(example: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    summary = example.main(TINY)
    _check(summary, 30)
    assert summary["skipped_steps"] == 0
    out = capsys.readouterr().out
    assert "torch" in out and "params" in out and "held-out loss" in out
    assert out.count("steps/s") >= 3


def test_tiny_fp16_accumulated(example: ModuleType) -> None:
    summary = example.main([*TINY, "--precision", "fp16", "--accum", "2"])
    _check(summary, 30)
    # GradScaler may skip a few overflowing steps early on, never most of them.
    assert summary["skipped_steps"] < 5


def test_batch_must_split_into_microbatches(example: ModuleType) -> None:
    with pytest.raises(SystemExit):
        example.main([*TINY, "--batch-size", "15", "--accum", "2"])
