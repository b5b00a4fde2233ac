"""The few names of ``fasttorch.checkpoint`` that tests replace, looked up at call time.

The crash and filesystem tests stand in for ``_publish`` and ``_sha256`` (to stop a save
between two of its filesystem changes) and reset ``_no_dir_sync_warned``, on the package
itself (``monkeypatch.setattr(checkpoint, "_publish", ...)``). The modules that use
those names read them through :func:`patchable`, so that the replacement is what runs.
"""

from __future__ import annotations

import sys
from typing import Any


def patchable(name: str) -> Any:
    """``fasttorch.checkpoint.<name>`` as it is at this call."""
    return getattr(sys.modules["fasttorch.checkpoint"], name)
