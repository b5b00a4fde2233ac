"""The GAN example, examples/train_gan.py, run small."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest
from examples_kit import EXAMPLES, load_example, one_thread

EXAMPLE = EXAMPLES / "train_gan.py"

TINY = [
    "--steps", "80",
    "--batch-size", "16",
    "--image-size", "8",
    "--width", "8",
    "--log-every", "10",
    "--device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example(EXAMPLE)


_one_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiny_run_moves_the_generator_toward_the_data(
    example: ModuleType, precision: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*TINY, "--precision", precision, "--out", str(tmp_path)]
    summary = example.main(args)
    assert summary["steps"] == 80 and summary["precision"] == precision
    # The generator's images start far from the real ones and end much closer.
    assert summary["pixel_gap"] < 0.6 * summary["pixel_gap_initial"], summary
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    svg = ET.fromstring((tmp_path / "loss.svg").read_text())
    assert svg.tag.endswith("svg")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 8 and lines[-1].startswith("step    80/80")


def test_compiled_tiny_run(example: ModuleType, tmp_path: Path) -> None:
    """The same job compiled (aot_eager keeps it quick): every member's graphs, no error."""
    import fasttorch

    original = fasttorch.compiled
    try:
        fasttorch.compiled = lambda s, **kw: original(s, backend="aot_eager")  # type: ignore[assignment]
        args = [*TINY, "--compile", "--steps", "4", "--log-every", "2", "--out", str(tmp_path)]
        summary = example.main(args)
    finally:
        fasttorch.compiled = original
    assert summary["compiled"] and summary["steps"] == 4
