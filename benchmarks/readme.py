"""The README's speed table, quoted from ``docs/benchmarks.md``.

``python -m benchmarks.readme`` reads the tables ``python -m benchmarks.run`` wrote into
docs/benchmarks.md and rewrites the README's section between two markers with a short
table of them: per model, the eager loop's time per step, the speed-ups of
``torch.compile(model)`` (B1) and of fasttorch's ``compiled`` (F1), and their compile
times, with the machine, date and torch the document names. ``benchmarks.run`` calls it
after each full run that rewrites docs/benchmarks.md, so the README quotes the newest
numbers; nothing here measures anything.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BEGIN = "<!-- speed-table: written by python -m benchmarks.readme from docs/benchmarks.md -->"
END = "<!-- speed-table end -->"

__all__ = ["BEGIN", "END", "render", "write"]


def _field(doc: str, name: str) -> str:
    m = re.search(rf"^- {name}: (.*)$", doc, re.M)
    if m is None:
        raise ValueError(f"docs/benchmarks.md has no '- {name}:' line")
    return m.group(1).strip()


def _models(doc: str) -> list[tuple[str, str, dict[str, dict[str, str]]]]:
    """(model, title, {variant: {column: cell}}) for each model's table, in order."""
    out = []
    for m in re.finditer(r"^## (M\d+) \((\w+)\): (.*)$", doc, re.M):
        body = doc[m.end() :].split("\n## ", 1)[0]
        rows = [line for line in body.splitlines() if line.startswith("|")]
        if len(rows) < 3:
            continue
        head = [c.strip() for c in rows[0].strip("|").split("|")]
        table = {}
        for line in rows[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            table[cells[0]] = dict(zip(head, cells))
        name = m.group(1) if m.group(2) == "bf16" else f"{m.group(1)} ({m.group(2)})"
        out.append((name, m.group(3), table))
    return out


def _speedup(row: dict[str, str] | None) -> str:
    if row is None:
        return "–"
    return row["x B0 [min-max]"].split(" ")[0] + "x"


def render(doc: str) -> str:
    """The README section (without its markers) quoting ``doc``'s tables."""
    cpu, *details = [part.strip() for part in _field(doc, "machine").split(";")]
    date = _field(doc, "date").split(" ")[0]
    m = re.search(r"^- (torch [^;\n]*)", doc, re.M)
    torch = m.group(1) if m else "torch: not named"
    lines = [
        "| model | eager loop (B0) | `torch.compile(model)` (B1) | fasttorch `compiled` (F1) "
        "| compile, cold / warm: B1 · F1 |",
        "|---|---:|---:|---:|---:|",
    ]
    for model, title, table in _models(doc):
        b0, b1, f1 = table.get("B0"), table.get("B1"), table.get("F1")
        if b0 is None or f1 is None:
            continue
        compile_col = "compile cold / warm (s)"
        b1_compile = b1[compile_col] if b1 else "–"
        lines.append(
            f"| {model}: {title} | {b0['ms/step']} ms/step | {_speedup(b1)} | {_speedup(f1)} "
            f"| {b1_compile} s · {f1[compile_col]} s |"
        )
    shown = ", ".join(d for d in details if not d.startswith("torch threads"))
    text = (
        f"Measured by `python -m benchmarks.run` on an {cpu} ({shown}; {date}, {torch}): "
        "one optimizer step of 4 microbatches under bf16 autocast, clipping and "
        "AdamW; speed-ups over the eager hand loop, medians over rounds. On a CPU "
        "without bf16 units bf16 is computed in float32: ATen widens bf16 to float32 "
        "inside its kernels, and fasttorch's `compiled` runs bf16 matrix products in "
        "float32 outright (`cpu_gemm`, several times faster there), which is part of "
        "F1's lead. Compiling is paid once per process (warm: with inductor's cache "
        "filled). All columns, memory and host syncs: "
        "[docs/benchmarks.md](docs/benchmarks.md)."
    )
    return "\n".join([textwrap.fill(text, 88, break_on_hyphens=False), "", *lines])


def write(doc_path: Path = DOC, readme_path: Path = README) -> None:
    """Rewrite the section between ``BEGIN`` and ``END`` of ``readme_path``."""
    text = readme_path.read_text()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"{readme_path}: no speed-table markers ({BEGIN!r} ... {END!r})")
    body = render(doc_path.read_text())
    readme_path.write_text(text[: i + len(BEGIN)] + "\n" + body + "\n" + text[j:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=__doc__)
    p.add_argument("--doc", type=Path, default=DOC, help="the benchmark document to quote")
    p.add_argument("--readme", type=Path, default=README, help="the README to rewrite")
    args = p.parse_args(argv)
    write(args.doc, args.readme)
    print(f"wrote the speed table of {args.readme} from {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
