import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Two cores in CI: keep torch from oversubscribing them. Under pytest-xdist (the README's
# `-n 2`) each worker has one core's share: one thread each.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // _WORKERS))


@pytest.fixture
def two_threads():
    """Two torch threads for one test, then the process's count again: torch 2.13's CPU
    backward of a channels-last ResNet on a single thread corrupts the heap (glibc's
    "double free or corruption", or a segfault; tests/test_example_convnet.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
