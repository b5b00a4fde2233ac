"""examples/example_utils.py: the loss chart keeps its legend inside the picture."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from example_utils import CHAR_WIDTH, loss_svg

# The main job's curve names (examples/train_charlm.py, train_convnet.py), and a longer one.
LABELS = ["train (mean per log window)", "held-out", "held-out EMA", "x" * 40]
LEGEND = re.compile(r'<text x="([0-9.]+)" y="[0-9.]+">([^<]+)</text>')


def _legend(labels: list[str]) -> tuple[float, list[tuple[float, str]]]:
    curves = {name: [[0.0, 3.0 - i], [50.0, 2.5], [100.0, 2.0]] for i, name in enumerate(labels)}
    svg = loss_svg(curves, 100, "title", "loss")
    width = float(re.search(r'<svg [^>]*width="([0-9.]+)"', svg).group(1))
    found = [(float(x), text) for x, text in LEGEND.findall(svg)]
    assert [text for _, text in found] == labels
    return width, found


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_legend_fits_in_the_svg_width(n):
    width, found = _legend(LABELS[:n])
    for x, text in found:
        assert x + CHAR_WIDTH * len(text) <= width, text


def test_the_legend_fits_as_a_real_font_draws_it():
    font_module = pytest.importorskip("PIL.ImageFont")
    try:
        font = font_module.load_default(size=12)  # a scalable sans-serif (Pillow >= 10.1)
    except TypeError:
        pytest.skip("this Pillow has no scalable default font")
    width, found = _legend(LABELS)
    for x, text in found:
        assert x + font.getlength(text) <= width, text
        assert font.getlength(text) <= CHAR_WIDTH * len(text), text  # the bound holds
