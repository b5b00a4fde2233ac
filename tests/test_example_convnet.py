"""The vision example, examples/train_convnet.py, run small and eager."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest
import torch
from examples_kit import EXAMPLES, load_example, one_thread

import fasttorch

EXAMPLE = EXAMPLES / "train_convnet.py"

TINY = [
    "--no-compile",
    "--steps", "24",
    "--batch-size", "16",
    "--image-size", "16",
    "--width", "8",
    "--classes", "4",
    "--log-every", "8",
    "--eval-every", "0",
    "--eval-batches", "2",
    "--device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example(EXAMPLE)


_one_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiny_run_learns_and_writes_its_outputs(
    example: ModuleType, precision: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = example.main([*TINY, "--precision", precision, "--out", str(tmp_path)])
    assert summary["precision"] == precision and summary["steps"] == 24
    # Near log(classes) at the start; clearly better than chance at the end.
    assert summary["initial_loss"] > 0.8 * math.log(4)
    assert summary["val_loss"] < summary["val_loss_initial"] - 0.3
    assert summary["val_accuracy"] > 0.5 > summary["val_accuracy_initial"]
    assert summary["skipped_steps"] < 5  # fp16: GradScaler may skip a few early steps
    assert summary["images_per_s"] == pytest.approx(summary["steps_per_s"] * 16)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    svg = ET.parse(tmp_path / "loss.svg").getroot()
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert [len(line.attrib["points"].split()) for line in lines] == [4, 2]  # 1,8,16,24; 0,24
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split("|")[0].split()[1] for s in steps] == ["1/24", "8/24", "16/24", "24/24"]
    if precision == "fp16":
        assert all("scale " in s for s in steps)  # the loss scale is shown


def test_images_are_channels_last_and_the_stream_is_reproducible(example: ModuleType) -> None:
    a = example.Images(8, 16, 4, seed=3, device=torch.device("cpu"))
    b = example.Images(8, 16, 4, seed=3, device=torch.device("cpu"))
    first = [a() for _ in range(3)]
    b.position = 2  # resuming the stream at a position gives the same batch
    x, y = b()
    assert torch.equal(x, first[2][0]) and torch.equal(y, first[2][1])
    assert x.is_contiguous(memory_format=torch.channels_last) and x.shape == (8, 3, 16, 16)
    assert not torch.equal(first[0][0], first[1][0])


def test_the_step_updates_batchnorm_stats_and_keeps_channels_last(
    example: ModuleType, two_threads: None
) -> None:
    # Two threads, not the module's one: torch 2.13's CPU backward of this channels-last
    # ResNet on a single thread corrupts the heap (glibc aborts with "double free or
    # corruption", or a segfault), with plain torch.autograd.grad and no fasttorch code;
    # it aborted the whole pytest process in about half of the runs here.
    torch.manual_seed(0)
    model = example.ResNet(4, 4, 1).to(memory_format=torch.channels_last)
    ts = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
    before = ts.buffers["stem.1.running_mean"].clone()
    _, step = example.build_step("fp32", 1, 1.0, compile=False)
    ts, _ = step(ts, example.Images(8, 16, 4, seed=0, device=torch.device("cpu"))())
    assert not torch.equal(ts.buffers["stem.1.running_mean"], before)
    assert int(ts.buffers["stem.1.num_batches_tracked"]) == 1
    weight = ts.params["stem.0.weight"]
    assert weight.dim() == 4 and weight.is_contiguous(memory_format=torch.channels_last)
