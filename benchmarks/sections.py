"""A section of a generated Markdown document that another command owns.

``benchmarks.run`` rewrites docs/benchmarks.md from its own results; the GPU section,
written by ``benchmarks.gpu`` on another machine, lies between two markers and is
carried over unchanged by every rewrite.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BEGIN", "END", "keep_section", "put_section"]

BEGIN = "<!-- gpu-section: written by python -m benchmarks.gpu; kept by benchmarks.run -->"
END = "<!-- gpu-section end -->"


def _split(text: str) -> tuple[str, str | None, str]:
    """(before, section with its markers or None, after)."""
    i = text.find(BEGIN)
    j = text.find(END, i + 1) if i >= 0 else -1
    if i < 0 or j < 0:
        return text, None, ""
    return text[:i], text[i : j + len(END)], text[j + len(END) :]


def keep_section(path: Path, new_text: str) -> str:
    """``new_text`` with the section ``path`` holds now (if any) at its end."""
    if not path.exists():
        return new_text
    _, section, _ = _split(path.read_text())
    if section is None:
        return new_text
    return new_text.rstrip() + "\n\n" + section + "\n"


def put_section(path: Path, body: str) -> None:
    """Write ``body`` as the section of ``path`` (replacing it, or at the end)."""
    text = path.read_text() if path.exists() else ""
    before, _, after = _split(text)
    section = f"{BEGIN}\n{body.rstrip()}\n{END}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(before.rstrip() + "\n\n" + section + "\n" + after.lstrip("\n"))
