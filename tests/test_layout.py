"""No library module over ~500 lines, private torch APIs only in ``fasttorch/_compat/``
(tests/test_import_cycles.py: no import circle).

Counted from the source (nothing is imported). A module over the limit is listed in
``OVER_LIMIT`` only with the reason it is, and the list is kept honest: an entry whose
module has come under the limit must be removed.
"""

from __future__ import annotations

import ast

from test_import_cycles import ROOT

LIMIT = 500

OVER_LIMIT: dict[str, str] = {}


def _lines() -> dict[str, int]:
    return {
        f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines())
        for f in sorted((ROOT / "fasttorch").rglob("*.py"))
    }


def test_no_library_module_is_over_the_limit() -> None:
    over = {p: n for p, n in _lines().items() if n > LIMIT and p not in OVER_LIMIT}
    assert not over, (
        f"modules over {LIMIT} lines: {over}. Split each along its concerns (docs/design.md, "
        "layout), or list it in OVER_LIMIT with the reason."
    )


def test_each_listed_exception_is_still_over_the_limit() -> None:
    lines = _lines()
    stale = {p: lines.get(p) for p in OVER_LIMIT if lines.get(p, 0) <= LIMIT}
    assert not stale, f"{stale} (lines) are no longer over {LIMIT}: remove them from OVER_LIMIT"


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
        for path in _lines()
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
