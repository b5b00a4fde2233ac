"""Who may import whom in fasttorch, and private torch APIs only in ``fasttorch/_compat/``
(tests/test_import_cycles.py: no import circle).

Counted from the source (nothing is imported). Every import counts, wherever it stands:
at the top, for annotations, inside a function. The rules are the layout's
(docs/design.md, "Layout"): the step runtime (``_core/``) imports no transform, no
several-model piece and no compile machinery; a transform imports the public faces, its
own helpers, ``_checks`` and ``_compat``; the compile machinery (``_compile/``) is
imported by ``compiled`` and the testing kit only; no library module imports the
package itself; and the top of ``fasttorch/`` holds the public modules and the few
private ones listed here.
"""

from __future__ import annotations

import ast

from test_import_cycles import ROOT

# What a transform may import besides other transforms and their helpers: the public
# faces of the runtime, the records it declares, the argument checks and torch's
# private APIs behind _compat (docs/transforms.md, writing a transform).
TRANSFORM_MAY_IMPORT = (
    "fasttorch._checks",
    "fasttorch._compat",
    "fasttorch.phases",
    "fasttorch.population",
    "fasttorch.state",
    "fasttorch.steps",
    "fasttorch.struct",
    "fasttorch.substates",
    "fasttorch.transforms",
    "fasttorch.window",
)
# What the step runtime may import: itself, and what lies below it.
RUNTIME_MAY_IMPORT = (
    "fasttorch._checks",
    "fasttorch._compat",
    "fasttorch._core",
    "fasttorch.optim",
    "fasttorch.struct",
    "fasttorch.substates",
)
COMPILE_IMPORTED_BY = ("fasttorch/transforms/compiled.py", "fasttorch/testing/")
PRIVATE_AT_THE_TOP = {
    "fasttorch/_checks.py": "the argument checks and warn_once every module uses",
    "fasttorch/_version.py": "the version, so that no library function imports fasttorch",
}


def _files() -> list[str]:
    return [f.relative_to(ROOT).as_posix() for f in sorted((ROOT / "fasttorch").rglob("*.py"))]


def imports(path: str) -> set[str]:
    """The fasttorch modules the file ``path`` names in any import (see :func:`named`)."""
    return named((ROOT / path).read_text())


def named(source: str) -> set[str]:
    """The fasttorch modules ``source`` names in any import (``from fasttorch import x``:
    ``fasttorch.x``), at any depth: in functions, under ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "fasttorch":
                found.update(f"fasttorch.{a.name}" for a in node.names)
            else:
                found.add(node.module)
    return {m for m in found if m == "fasttorch" or m.startswith("fasttorch.")}


def _outside(path: str, allowed: tuple[str, ...]) -> set[str]:
    return {m for m in imports(path) if not any(m == a or m.startswith(a + ".") for a in allowed)}


def test_the_runtime_imports_no_transform_and_nothing_above_it() -> None:
    wrong = {
        p: sorted(bad)
        for p in _files()
        if p.startswith("fasttorch/_core/") and (bad := _outside(p, RUNTIME_MAY_IMPORT))
    }
    assert not wrong, (
        f"the step runtime (fasttorch/_core/) imports {wrong}: it may import only "
        f"{RUNTIME_MAY_IMPORT}. A transform installs what the runtime needs on the step "
        "(its window, runner, jit or hooks) instead"
    )


def test_transforms_import_only_the_public_faces() -> None:
    wrong = {
        p: sorted(bad)
        for p in _files()
        if p.startswith("fasttorch/transforms/")
        and (
            bad := _outside(
                p,
                TRANSFORM_MAY_IMPORT + ("fasttorch._compile",) * (p in COMPILE_IMPORTED_BY),
            )
        )
    }
    assert not wrong, (
        f"transforms import {wrong}: a transform imports only {TRANSFORM_MAY_IMPORT}. "
        "Re-export what transforms need from fasttorch.phases (the contract) instead"
    )


def test_the_compile_machinery_is_imported_only_by_compiled_and_the_testing_kit() -> None:
    wrong = {
        p
        for p in _files()
        if not p.startswith("fasttorch/_compile/")
        and not p.startswith(COMPILE_IMPORTED_BY)
        and any(m.startswith("fasttorch._compile") for m in imports(p))
    }
    assert not wrong, f"{sorted(wrong)} import fasttorch/_compile/ (only {COMPILE_IMPORTED_BY})"


FAST_PATH_NAMES = {"opaque", "opaque_update", "in_cpu_graph", "in_place_in_graph"}


def fast_path_names(source: str) -> set[str]:
    """The names of the fast-path choice ``source`` uses (names, attributes, keywords)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        name = (
            node.id
            if isinstance(node, ast.Name)
            else node.attr
            if isinstance(node, ast.Attribute)
            else node.arg
            if isinstance(node, ast.keyword)
            else node.name
            if isinstance(node, ast.alias)
            else None
        )
        if name in FAST_PATH_NAMES:
            found.add(name)
    return found


def test_transforms_other_than_compiled_never_name_the_fast_path() -> None:
    # The runner chooses it (GradOut.opaque) and the contract's helpers read it.
    wrong = {
        p: sorted(names)
        for p in _files()
        if p.startswith("fasttorch/transforms/")
        and p != "fasttorch/transforms/compiled.py"
        and (names := fast_path_names((ROOT / p).read_text()))
    }
    assert not wrong, f"transforms name the fast path: {wrong}"
    assert fast_path_names("x = opaque_update(s, g.donated)\nf(g, opaque=x)\n") == {
        "opaque_update",
        "opaque",
    }


def test_no_library_module_imports_the_package_itself() -> None:
    wrong = {p for p in _files() if p != "fasttorch/__init__.py" and "fasttorch" in imports(p)}
    assert not wrong, (
        f"{sorted(wrong)} import fasttorch itself (which imports them back): import the "
        "module that defines the name (the version: fasttorch._version)"
    )


def test_the_top_level_holds_the_public_modules_and_the_listed_private_ones() -> None:
    top = {p for p in _files() if p.count("/") == 1 and p.split("/")[1].startswith("_")}
    top.discard("fasttorch/__init__.py")
    assert top == set(PRIVATE_AT_THE_TOP), (
        f"private modules at the top of fasttorch/: {sorted(top)}; listed: "
        f"{sorted(PRIVATE_AT_THE_TOP)}. Put a private module in the folder of its concern "
        "(_core/, _compile/, several/, loop/, testing/) or list it with the reason"
    )


def test_the_rules_read_imports_at_any_depth() -> None:
    # A rule that missed imports inside functions would let a circle back in unseen.
    source = (
        "import fasttorch.a\nfrom fasttorch import b\nif TYPE_CHECKING:\n"
        "    from fasttorch.c import C\ndef f():\n    import fasttorch\n"
        "    from fasttorch.d import e\nimport torch\n"
    )
    found = named(source)
    assert found == {"fasttorch", "fasttorch.a", "fasttorch.b", "fasttorch.c", "fasttorch.d"}


def private_torch_uses(source: str) -> list[str]:
    """The private torch APIs ``source`` reaches: ``torch._X`` modules and functions
    (``torch._foreach_*``, the multi-tensor kernels the optimizers are built on, aside),
    private ATen ops (``torch.ops.aten._X``), and ``import_module("torch._X")``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [ast.unparse(node)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
        for name in names:
            parts = str(name).split(".")
            if (
                parts[0] == "torch"
                and len(parts) > 1
                and parts[1].startswith("_")
                and not parts[1].startswith(("_foreach_", "__"))
            ) or str(name).startswith("torch.ops.aten._"):
                found.append(f"{node.lineno}: {name}")
    return found


def test_private_torch_apis_live_only_in_the_compat_package() -> None:
    # docs/compatibility.md: a torch upgrade touches fasttorch/_compat/ only.
    outside = {
        path: uses
        for path in _files()
        if not path.startswith("fasttorch/_compat/")
        and (uses := private_torch_uses((ROOT / path).read_text()))
    }
    assert not outside, f"private torch APIs outside fasttorch/_compat/: {outside}"
    assert private_torch_uses((ROOT / "fasttorch/_compat/dynamo.py").read_text())


def test_the_private_api_scan_finds_each_form() -> None:
    source = (
        "import torch._dynamo\nfrom torch._inductor import config\n"
        "x = torch._C._functorch\ny = torch.ops.aten._fused_adamw_\n"
        "importlib.import_module('torch._functorch.config')\n"
        "torch._foreach_add_(a, b)\n"
    )
    found = private_torch_uses(source)
    assert sorted(f.split(": ")[0] for f in found) == ["1", "2", "3", "3", "4", "5"], found
