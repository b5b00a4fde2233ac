"""What the example jobs share: the progress line, peak memory, and the loss chart.

Imported by ``train_charlm.py`` and ``train_convnet.py`` from their own directory
(``python examples/train_X.py`` puts ``examples/`` first on ``sys.path``).
"""

from __future__ import annotations

import math
import resource
import sys
from typing import Any
from xml.sax.saxutils import escape

import torch

from fasttorch.loop import Progress, memory_bytes


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated on a GPU; on a CPU, the process's peak resident set."""
    if device.type == "cuda":
        return memory_bytes(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(memory_bytes(device), rss if sys.platform == "darwin" else rss * 1024)


class Bar(Progress):
    """``fasttorch.loop.Progress`` (a ``\\r``-rewritten line on a terminal, one line per
    display otherwise) with this job's line: 4-decimal losses, the log window's mean loss,
    gradient norm, and steps/s that leave out compilation, evaluation and checkpointing.

    The line keeps the shape ``step N/TOTAL | loss X | ...`` that the tests parse.
    """

    def __init__(self, total: int, *, precision: str, start: int, compiles: bool) -> None:
        super().__init__(total, precision=precision)
        self.since = (self.clock(), start)  # the rate counts from here
        self.compiles = compiles

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of non-training work (evaluation, checkpoint) out of the rate."""
        t0, n0 = self.since
        self.since = (t0 + seconds, n0)

    def show(self, done: int, metrics: dict[str, Any], first_step_s: float | None) -> None:
        """Display the line after ``done`` steps (reads the metrics: a host sync)."""
        now = self.clock()
        t0, n0 = self.since
        self.since = (now, done)
        if first_step_s is not None:
            speed = f"first step {first_step_s:.1f} s" + (
                " (compile time included)" if self.compiles else ""
            )
        else:
            speed = f"{(done - n0) / (now - t0) if now > t0 else math.inf:.2f} steps/s"
        parts = [
            f"step {done:5d}/{self.total}",
            f"loss {float(metrics['loss']):.4f} (mean {metrics['mean']:.4f})",
            f"lr {float(metrics['lr']):.2e}",
            str(self.precision),
        ]
        if "loss_scale" in metrics:
            parts.append(f"scale {float(metrics['loss_scale']):g}")
        parts += [
            f"grad norm {float(metrics['grad_norm']):.3f}",
            speed,
            f"mem {memory_bytes(metrics['loss'].device) / 2**30:.2f} GiB",
        ]
        self.write(" | ".join(parts))


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering ``[lo, hi]``, about ``n`` of them."""
    span = hi - lo if hi > lo else max(abs(hi), 1.0)
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    if last <= first:
        last = first + 1
    return [round(i * step, 10) for i in range(first, last + 1)]


CHAR_WIDTH = 7.5
"""An upper bound of a 12 px sans-serif character's advance, in px (``W`` is ~11, most
letters 6-7): legend labels are mostly lower case, digits and spaces."""


def legend_width(labels: list[str]) -> float:
    """The legend's width: a 24 px line, a 6 px gap, the longest label."""
    return 30 + CHAR_WIDTH * max((len(label) for label in labels), default=0)


def loss_svg(
    curves: dict[str, list[list[float]]],
    total_steps: int,
    title: str,
    ylabel: str = "loss",
) -> str:
    """A loss-curve chart as an SVG document, written by hand (no plotting dependency).

    ``curves`` maps a label to ``[step, loss]`` points; the ``train`` curve is a line,
    the others lines with a marker on each point.
    """
    w, h, left, right, top, bottom = 720, 420, 64, 20, 40, 52
    pw, ph = w - left - right, h - top - bottom
    points = [p for pts in curves.values() for p in pts if math.isfinite(p[1])]
    ys = [p[1] for p in points] or [0.0, 1.0]
    yt = _ticks(min(ys), max(ys))
    xt = _ticks(0, max(total_steps, 1))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    for t in yt:
        y = sy(t)
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e5e5e5"/>'
        )
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{t:g}</text>')
    for t in xt:
        x = sx(t)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{x:.1f}" y="{top + ph + 18}" text-anchor="middle">{t:g}</text>')
    out += [
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>',
        f'<text x="{left + pw / 2}" y="{h - 10}" text-anchor="middle">optimizer step</text>',
        f'<text transform="translate(16 {top + ph / 2}) rotate(-90)" text-anchor="middle">'
        f"{escape(ylabel)}</text>",
    ]
    colors = (
        "#1f77b4",
        "#ff7f0e",
        "#2ca02c",
        "#d62728",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
    )
    for i, (label, pts) in enumerate(curves.items()):
        color = colors[i % len(colors)]
        xy = [(sx(x), sy(y)) for x, y in pts if math.isfinite(y)]
        if not xy:
            continue
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        dash = "" if i == 0 else ' stroke-dasharray="6 3"'
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'
        )
        if i > 0:
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in xy]
        ly = top + 16 + 18 * i
        # The legend's right edge 8 px inside the plot, whatever the longest label.
        lx = left + pw - 8 - legend_width(list(curves))
        out.append(
            f'<line x1="{lx}" y1="{ly}" x2="{lx + 24}" y2="{ly}" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        out.append(f'<text x="{lx + 30}" y="{ly + 4}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
