"""benchmarks/several_models.py runs (its smoke run's numbers mean nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_run_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "several.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.several_models", "--smoke", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "smoke run" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| fasttorch",
        "| hand",
        "| hand + torch.compile",
    ]
