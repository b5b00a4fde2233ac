"""The documentation stays true: api.md is current and every Python example runs."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import fasttorch

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
PAGES = sorted(p.name for p in DOCS.glob("*.md") if p.name != "api.md")


def test_api_md_is_current():
    proc = subprocess.run(
        [sys.executable, str(DOCS / "gen_api.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr + "\nRegenerate with: python docs/gen_api.py"


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, monkeypatch):
    """The page's python blocks, in order, in one fresh module namespace."""
    blocks = BLOCK.findall((DOCS / page).read_text())
    # A real module: dynamo looks a frame's globals up in sys.modules by __name__.
    module = types.ModuleType(f"docs_{page.removesuffix('.md')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for i, code in enumerate(blocks, 1):
        try:
            exec(compile(code, f"docs/{page}, python block {i}", "exec"), module.__dict__)
        except Exception as e:
            e.add_note(f"in docs/{page}, python block {i}:\n{code}")
            raise


def test_every_public_name_is_in_api_md():
    text = (DOCS / "api.md").read_text()
    missing = [name for name in fasttorch.__all__ if f"`{name}`" not in text]
    assert not missing, f"not documented in docs/api.md: {missing}"
