"""What the tests of the example scripts share: loading a script as a module, one thread."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(path: Path) -> ModuleType:
    """The example script at ``path`` as a module, importing its neighbours as running
    ``python examples/<script>.py`` does (``examples/`` on ``sys.path``)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread, and on a shared two-core box
    spinning OpenMP waiters make them up to 10x slower (the scripts set
    OMP_WAIT_POLICY=PASSIVE for that, which is too late once conftest imported torch)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
