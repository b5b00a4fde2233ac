"""The package's import graph, read from the source: floors, circles, arrows running back up.

    python -m benchmarks.imports [--rev REV]
    python -m benchmarks.imports --before REV --write docs/imports.md

Nothing is imported: each ``.py`` file under ``fasttorch/`` is parsed with ``ast``, at
the working tree or at a git revision (``git show REV:path``). Every import counts,
wherever it stands: at the top, under ``if TYPE_CHECKING:``, inside a function body,
and ``importlib.import_module("fasttorch...")`` with a literal name. An import is an
arrow to the file it names (``from fasttorch.x import y`` names ``x/y.py`` where that
is a module, else ``x.py`` or ``x/__init__.py``); importing a submodule also runs its
packages' ``__init__``, but those are not arrows (every file would import the root).

Two levels are counted:

- files: a circle is a group of files that import each other in a loop (a strongly
  connected component of more than one file). Zero means each file can be read
  knowing only the files below it.
- rooms: a top-level file of ``fasttorch/`` (``__init__.py`` included), or a top-level
  folder taken whole (``_core/``, ``optim/``, ...). Arrows inside a room are not drawn.
  The rooms are laid out in floors, each room one floor above the highest room it
  imports (a room that imports no other is on floor 1). Where rooms import each other
  in a loop, the arrows closing each loop are taken out first (those a depth-first
  walk, in sorted order, finds pointing back to a room it is still inside): these are
  the arrows running back up, from a lower floor to a higher one.

Counts, not times: the same on every machine for one source tree.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "fasttorch"


def sources(rev: str | None = None) -> dict[str, str]:
    """``{path: source}`` of the package's ``.py`` files, in the tree or at ``rev``."""
    if rev is None:
        return {
            p.relative_to(REPO).as_posix(): p.read_text()
            for p in sorted((REPO / PACKAGE).rglob("*.py"))
        }

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True
        ).stdout

    paths = git("ls-tree", "-r", "--name-only", rev, PACKAGE).split()
    return {p: git("show", f"{rev}:{p}") for p in paths if p.endswith(".py")}


def _module(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def arrows(files: dict[str, str]) -> dict[str, set[str]]:
    """``{path: paths it imports}``, every import counted (see the module docstring)."""
    by_module = {_module(p): p for p in files}
    return {path: _targets(path, source, by_module) for path, source in files.items()}


def _targets(path: str, source: str, by_module: dict[str, str]) -> set[str]:
    here = _module(path)
    package = here if path.endswith("__init__.py") else here.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
                names += [m for m in prefixes if m in by_module][:1]  # the deepest module
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names += [
                f"{base}.{a.name}" if f"{base}.{a.name}" in by_module else base for a in node.names
            ]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.append(node.args[0].value)
    return {by_module[n] for n in names if n in by_module and by_module[n] != path}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of nodes that reach each other (Tarjan), sorted, of two or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def room(path: str) -> str:
    """A top-level file of the package, or its top-level folder (``fasttorch/_core/``)."""
    parts = path.split("/")
    return path if len(parts) == 2 else "/".join(parts[:2]) + "/"


def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, bs in graph.items():
        out.setdefault(room(a), set()).update(room(b) for b in bs if room(b) != room(a))
    return out


def back_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The arrows a depth-first walk (sorted order) finds pointing back into its path."""
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    back: set[tuple[str, str]] = set()

    def walk(v: str) -> None:
        state[v] = 1
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                back.add((v, w))
            elif w not in state:
                walk(w)
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            walk(v)
    return back


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor: one above the highest node it imports (back arrows left out)."""
    back = back_arrows(graph)
    floor: dict[str, int] = {}

    def of(v: str) -> int:
        if v not in floor:
            below = [of(w) for w in graph.get(v, ()) if (v, w) not in back]
            floor[v] = 1 + max(below, default=0)
        return floor[v]

    for v in graph:
        of(v)
    return floor


def measure(files: dict[str, str]) -> dict[str, object]:
    """Every count of the module docstring for one tree."""
    graph = arrows(files)
    top = rooms(graph)
    floor = floors(top)
    return {
        "files": len(files),
        "file circles": circles(graph),
        "rooms": len(top),
        "room arrows": sum(len(v) for v in top.values()),
        "floors": max(floor.values(), default=0),
        "back arrows": sorted(back_arrows(top)),
        "floor": floor,
        "lines": {
            r: sum(len(s.splitlines()) for p, s in files.items() if room(p) == r) for r in top
        },
        "private top-level files": sorted(
            p
            for p in files
            if p.count("/") == 1
            and p.split("/")[1].startswith("_")
            and not p.endswith("__init__.py")
        ),
    }


def _rev(rev: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def table(rows: dict[str, dict[str, object]]) -> list[str]:
    out = [
        "| tree | files | circles of files | rooms | arrows between rooms | floors "
        "| arrows running back up | private files at the top |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for tree, m in rows.items():
        out.append(
            f"| {tree} | {m['files']} | {len(m['file circles'])} | {m['rooms']} "  # type: ignore[arg-type]
            f"| {m['room arrows']} | {m['floors']} | {len(m['back arrows'])} "  # type: ignore[arg-type]
            f"| {len(m['private top-level files'])} |"  # type: ignore[arg-type]
        )
    return out


def details(rows: dict[str, dict[str, object]]) -> list[str]:
    out: list[str] = []
    for tree, m in rows.items():
        out.append(f"\n## {tree}\n")
        floor: dict[str, int] = m["floor"]  # type: ignore[assignment]
        lines: dict[str, int] = m["lines"]  # type: ignore[assignment]
        for f in range(max(floor.values(), default=0), 0, -1):
            here = sorted(r for r, n in floor.items() if n == f)
            names = ", ".join(f"`{r.removeprefix(PACKAGE + '/')}` {lines[r]}" for r in here)
            out.append(f"- floor {f}: {names}")
        out.append("")
        for a, b in m["back arrows"]:  # type: ignore[attr-defined]
            out.append(f"- arrow running back up: `{a}` -> `{b}`")
        for group in m["file circles"]:  # type: ignore[attr-defined]
            out.append(f"- circle: {', '.join(f'`{p}`' for p in group)}")
        private: Iterable[str] = m["private top-level files"]  # type: ignore[assignment]
        out.append(f"- private files at the top: {', '.join(f'`{p}`' for p in private)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", help="count git revision REV instead of the working tree")
    parser.add_argument("--before", metavar="REV", help="also count git revision REV")
    parser.add_argument("--write", metavar="FILE", help="write the markdown to FILE")
    args = parser.parse_args()
    rows: dict[str, dict[str, object]] = {}
    if args.before:
        rows[f"before ({_rev(args.before)})"] = measure(sources(args.before))
    rows[f"at {_rev(args.rev)}" if args.rev else "this tree"] = measure(sources(args.rev))
    lines = table(rows) + details(rows)
    if args.write:
        command = "python -m benchmarks.imports" + (
            f" --before {args.before}" if args.before else ""
        )
        head = [
            "# The import graph",
            "",
            f"<!-- Written by `{command} --write {args.write}`; do not edit by hand. -->",
            "",
            "Counted from the source by `benchmarks/imports.py` (its docstring says how: every",
            "import counts, inside functions too; a room is a top-level file or folder of",
            "`fasttorch/`; floors and arrows running back up are the rooms'). The numbers after",
            "each room are its lines.",
            "",
        ]
        Path(args.write).write_text("\n".join(head + lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
