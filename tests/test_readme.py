"""The README's quick start runs as written, and .ci/run calls the README's test command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert len(commands) == 2, "the README has the main-job command and the test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()
    assert "examples/train_charlm.py" in commands[0] and "pytest" in commands[1]


def test_quick_start_runs_as_written(tmp_path):
    """Exactly the README's code, inductor included, in a fresh interpreter."""
    (code,) = re.findall(r"## Quick start\n\n```python\n(.*?)```", README, re.S)
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-8000:]}"
    out = proc.stdout
    losses = [float(line.split()[1]) for line in out.splitlines() if line]
    assert len(losses) == 5 and losses[-1] < losses[0] / 2
