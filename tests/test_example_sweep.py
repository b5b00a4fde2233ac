"""examples/sweep_charlm.py: a learning-rate sweep, each member its own plain loop."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from examples_kit import EXAMPLES, load_example, one_thread
from reference import reference_run
from tolerance import loss_atol, reference_error

TINY = [
    "--steps", "4",
    "--members", "3",
    "--batch-size", "4",
    "--block-size", "16",
    "--n-embd", "16",
    "--log-every", "1",
    "--eval-batches", "2",
    "--max-bytes", "40000",
]  # fmt: skip


def _xent(apply, batch):
    """The example's loss in its input's dtype (float64 in tolerance's float64 run)."""
    x, y = batch
    return torch.nn.functional.cross_entropy(apply(x).flatten(0, 1), y.flatten())


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example(EXAMPLES / "sweep_charlm.py")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_thread()


def test_each_member_follows_its_own_plain_loop(example: ModuleType, tmp_path: Path) -> None:
    summary = example.main([*TINY, "--out", str(tmp_path)])
    args = example.parse_args(TINY)
    lrs = example.learning_rates(args.lr_min, args.lr_max, args.members)
    assert summary["learning_rates"] == lrs and summary["best_lr"] in lrs
    assert all(math.isfinite(v) for v in summary["val_loss"])
    # The plain loop each member replaces: the same initial model, data and clipping.
    text, _ = example.stdlib_source(args.max_bytes)
    vocab = example.ByteVocab(text)
    train, _ = example.split_tokens(vocab.encode(text), args.block_size, 0.1)
    torch.manual_seed(args.seed)
    model = example.CharGPT(len(vocab), args.block_size, 1, 16, 2, 0.0, tie_weights=True)
    batches = example.Batches(train, args.block_size, args.batch_size, args.seed)
    windows = [[batches()] for _ in range(args.steps)]
    curves = json.loads((tmp_path / "summary.json").read_text())
    assert curves["final_train_loss"] == summary["final_train_loss"]
    svg = ET.parse(tmp_path / "loss.svg").getroot()
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == args.members  # one loss curve per learning rate
    for i, lr in enumerate(lrs):

        def make_opt(ps, lr=lr):
            return torch.optim.AdamW(ps, lr=lr)

        _, log = reference_run(model, windows, make_opt=make_opt, loss_fn=_xent, clip=args.clip)
        error = reference_error(model, windows, make_opt=make_opt, loss_fn=_xent, clip=args.clip)
        want = torch.tensor([e["loss"] for e in log])
        # The last logged loss of member i: its forward before its last update (rule 2).
        got = summary["final_train_loss"][i]
        assert abs(got - float(want[-1])) <= loss_atol(error, want), (lr, got, want)
