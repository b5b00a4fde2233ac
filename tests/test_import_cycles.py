"""No import circle among fasttorch's modules: each module can be read knowing only the
modules below it. Counted from the source with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

from benchmarks.imports import circles

ROOT = Path(__file__).resolve().parents[1]


def _modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for f in (root / package).rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(
    name: str, f: Path, mods: dict[str, Path], typing: bool, functions: bool = False
) -> set[str]:
    """The modules that importing ``name`` runs (its own ancestors excluded: they ran
    first); with ``typing``, those under ``if TYPE_CHECKING:`` too; with ``functions``,
    those its functions import when they run."""
    out: set[str] = set()

    def add(module: str) -> None:  # importing a.b.c runs a, a.b and a.b.c
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            m = ".".join(parts[:i])
            if m in mods and m != name and not name.startswith(m + "."):
                out.add(m)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit([*(node.body if typing else []), *node.orelse])
            elif functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body)
            elif functions and isinstance(node, (ast.ClassDef, ast.With, ast.For, ast.While)):
                visit([*node.body, *getattr(node, "orelse", [])])
            elif isinstance(node, (ast.If, ast.Try)):
                visit([*node.body, *node.orelse, *getattr(node, "finalbody", [])])
                for h in getattr(node, "handlers", []):
                    visit(h.body)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    add(a.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(here[: len(here) - node.level + 1] + [base] * bool(base))
                for a in node.names:
                    if f"{base}.{a.name}" in mods:
                        add(f"{base}.{a.name}")
                    else:  # a name of `base` itself: its __init__ runs, even a parent's
                        add(base)
                        if base in mods and name.startswith(base + "."):
                            out.add(base)

    visit(ast.parse(f.read_text()).body)
    return out


def import_cycles(
    root: Path, package: str, *, typing: bool = False, functions: bool = False
) -> list[list[str]]:
    """The groups of modules of ``package`` that import each other in a circle."""
    mods = _modules(root, package)
    graph = {n: _imports(n, f, mods, typing, functions) for n, f in mods.items()}
    return circles(graph)


def test_fasttorch_has_no_import_cycle() -> None:
    assert import_cycles(ROOT, "fasttorch") == []


def test_fasttorch_has_no_import_cycle_even_for_annotations() -> None:
    # A circle that only annotations close still makes a reader of either module
    # read the other first (fasttorch.optim once typed load_torch_state_dict with
    # fasttorch.state's TrainState, and fasttorch.state imports fasttorch.optim).
    assert import_cycles(ROOT, "fasttorch", typing=True) == []


def test_fasttorch_has_no_import_cycle_even_inside_functions() -> None:
    # An import inside a function only hides a circle: the reader of either module
    # still reads the other first (checkpoint's _load and _save once imported _models
    # inside load and save, and _models imported them).
    assert import_cycles(ROOT, "fasttorch", typing=True, functions=True) == []


def test_the_count_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import x\n")
    (pkg / "a.py").write_text("from pkg.sub import b\nx = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
    )
    (pkg / "c.py").write_text("import pkg.sub.b\n")
    assert import_cycles(tmp_path, "pkg") == []  # b needs c for its annotations only
    assert import_cycles(tmp_path, "pkg", typing=True) == [["pkg.c", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("from pkg import a\n")  # a imports b, b imports a
    assert import_cycles(tmp_path, "pkg") == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import a\n")  # at call time
    assert import_cycles(tmp_path, "pkg") == []
    assert import_cycles(tmp_path, "pkg", functions=True) == [["pkg.a", "pkg.sub.b"]]
