"""``_compat.on_large_stack``: calls that cross a frame-stack chunk, counted in page faults.

CPython 3.11 and 3.12 map a fresh 16 KiB chunk of frame stack for a call that does not
fit in the current one and unmap it when the call returns (python/cpython#142183), so
a loop calling across a boundary faults the new chunk in on every call. These tests
find such a depth by scanning and count minor page faults (``getrusage``): exact
counts, not times.
"""

from __future__ import annotations

import resource
import sys

import pytest
import torch
from reference import LayerNormNet, batches, mse

import fasttorch
from fasttorch import _compat

CALLS = 2000


def _leaf(a: int) -> int:
    b = a + 1
    return b


def _loop() -> None:
    for i in range(CALLS):
        _leaf(i)


def _descend(depth: int) -> int:
    """Faults while ``_loop`` runs ``depth`` frames further down."""
    if depth:
        return _descend(depth - 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _loop()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _worst_depth() -> int:
    """The most page faults of the loop at any depth over several chunks' worth of frames."""
    return max(_descend(d) for d in range(0, 700, 1))


@pytest.mark.skipif(sys.platform != "linux", reason="minor page faults counted on Linux")
def test_a_call_across_a_chunk_boundary_faults_only_off_the_large_stack():
    _worst_depth()  # the loop's code specialized, the chunks' pages mapped once
    inside = _compat.on_large_stack(_worst_depth)
    # Under on_large_stack no call of the loop meets a boundary: at most the odd fault
    # of the allocator's own, never one per call.
    assert inside < CALLS // 10
    if sys.implementation.name == "cpython" and (3, 11) <= sys.version_info < (3, 13):
        # The interpreters that thrash (3.13 and 3.14 cache a chunk in their later point
        # releases): somewhere in 700 frames the loop crosses a boundary on each call.
        assert _worst_depth() >= CALLS


def test_on_large_stack_passes_arguments_results_and_errors():
    assert _compat.on_large_stack(lambda a, b=1: (a, b), 2, b=3) == (2, 3)
    with pytest.raises(ZeroDivisionError):
        _compat.on_large_stack(lambda: 1 / 0)
    # Nested calls each get their own.
    assert _compat.on_large_stack(_compat.on_large_stack, _leaf, 1) == 2


def test_only_the_call_that_compiles_runs_on_the_large_stack(monkeypatch):
    seen = []
    real = _compat.on_large_stack

    def spy(fn, /, *args, **kwargs):
        seen.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(_compat, "on_large_stack", spy)
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    data = batches(3, 8)
    state, _ = step(state, data[0])
    first = len(seen)
    assert first >= 1  # each of the step's kernels, at its first call
    for b in data[1:]:
        state, _ = step(state, b)
    assert len(seen) == first
