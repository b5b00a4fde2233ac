"""The README's quick start runs as written, and .ci/run calls the README's test command."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert len(commands) == 3, "the README has the main job's, the tests' and the torch user's"
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()
    assert "examples/train_charlm.py" in commands[0] and "pytest" in commands[1]


def test_ci_runs_the_readme_command_for_a_machine_with_torch():
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "examples/train_charlm.py" in commands[2] and "-c constraints.txt" not in commands[2]
    assert commands[2] in ci


def _machine() -> str:
    """The CPU and the free space under the temporary directory, for a failure report."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        lines = f.read().splitlines()
        model = next(
            (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), model
        )
        flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
        model += " [" + " ".join(f for f in flags if f.startswith(("avx", "amx"))) + "]"
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    return f"{model}, {free:.1f} GiB free in {tempfile.gettempdir()}"


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
    assert proc.returncode == 0, (
        f"exit {proc.returncode} on {_machine()}\n{proc.stdout}\n{proc.stderr[-8000:]}"
    )
    if "two files (cpp_wrapper_build_separate" in proc.stderr:
        # compiled fell back to a one-file C++ build and said why: pass it on to the report
        warnings.warn(f"on {_machine()}: {proc.stderr[-4000:]}", UserWarning, stacklevel=1)
    out = proc.stdout
    losses = [float(line.split()[1]) for line in out.splitlines() if line]
    assert len(losses) == 5 and losses[-1] < losses[0] / 2
    # The warm-up starts above 0: the first update moves the parameters.
    first_lr = float(out.splitlines()[0].split()[2])
    assert first_lr > 0


def test_the_examples_readme_gives_the_same_main_command():
    main = re.findall(r"```bash\n(.*?)\n```", README, re.S)[0]
    examples = (ROOT / "examples" / "README.md").read_text()
    assert f"```bash\n{main}\n```" in examples
    first_screen = "\n".join(README.splitlines()[:30])  # what a newcomer sees first
    assert main in first_screen and "runs/charlm/loss.svg" in README


def test_the_speed_table_quotes_docs_benchmarks():
    """The README's speed table is what ``python -m benchmarks.readme`` writes from
    docs/benchmarks.md (``benchmarks.run`` calls it after each full run): its numbers
    are the document's, never typed by hand."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import readme

    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    body = README.split(readme.BEGIN, 1)[1].split(readme.END, 1)[0]
    assert body.strip() == readme.render(doc).strip(), "run python -m benchmarks.readme"
    for model in ("M1", "M3"):  # the F1 speed-up of each model is quoted from its table
        table = doc.split(f"## {model} (bf16)", 1)[1].split("\n## ", 1)[0]
        f1 = re.search(r"^\| F1 \| [^|]+\| [^|]+\| ([\d.]+) \[", table, re.M)
        assert f1 and f"| {f1.group(1)}x | " in body.split(f"| {model}:", 1)[1].split("\n")[0]
