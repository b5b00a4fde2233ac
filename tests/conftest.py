import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Two cores in CI: keep torch from oversubscribing them.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with empty compile caches and counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
