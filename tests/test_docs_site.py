"""The documentation site builds from docs/ without a warning, and its nav is complete.

``mkdocs build --strict`` turns every warning into an error: a broken link between
pages, a missing anchor, a page left out of ``nav``. The python blocks of the pages are
run by tests/test_docs.py and the docstring examples by ``--doctest-modules``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="mkdocs is not installed (pip install -e '.[dev]' installs it)",
)


def nav_pages(nav: Any) -> list[str]:
    """Every page path in a mkdocs ``nav``, sections flattened, external links left out."""
    if isinstance(nav, str):
        return [] if "://" in nav else [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    raise TypeError(f"unexpected nav entry: {nav!r}")


def load_nav() -> list[str]:
    import yaml  # a dependency of mkdocs

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config.get("docs_dir", "docs") == "docs"
    return nav_pages(config["nav"])


def test_nav_lists_every_page_once():
    nav = load_nav()
    missing = [page for page in nav if not (DOCS / page).is_file()]
    assert not missing, f"in mkdocs.yml nav but not in docs/: {missing}"
    unlisted = sorted(p.name for p in DOCS.glob("*.md") if p.name not in nav)
    assert not unlisted, f"docs/ pages missing from mkdocs.yml nav: {unlisted}"
    twice = sorted({page for page in nav if nav.count(page) > 1})
    assert not twice, f"listed more than once in mkdocs.yml nav: {twice}"


def test_site_builds_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    built = {p.parent.name for p in tmp_path.glob("*/index.html")}
    expected = {Path(page).stem for page in load_nav() if page != "index.md"}
    assert expected <= built, f"pages not built: {sorted(expected - built)}"
    assert (tmp_path / "index.html").is_file()
