"""tune_device: sets each switch, restores each one, and nothing happens at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fasttorch


def _settings():
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.benchmark,
        torch.is_anomaly_enabled(),
        torch.is_anomaly_check_nan_enabled(),
    )


@pytest.fixture(autouse=True)
def _known_start():
    saved = _settings()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.benchmark = False
    torch.autograd.set_detect_anomaly(True, check_nan=False)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.benchmark = saved[1]
    torch.autograd.set_detect_anomaly(saved[2], check_nan=saved[3])


def test_sets_and_restores_each_setting_as_a_context_manager():
    start = _settings()
    with fasttorch.tune_device() as tuning:
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.benchmark is True
        assert torch.is_anomaly_enabled() is False
        assert set(tuning.previous) == {"matmul_precision", "cudnn_benchmark", "anomaly_detection"}
    assert _settings() == start == ("highest", False, True, False)


def test_undo_call_restores_and_is_idempotent():
    start = _settings()
    undo = fasttorch.tune_device(matmul_precision="medium", cudnn_benchmark=True)
    assert torch.get_float32_matmul_precision() == "medium"
    torch.backends.cudnn.benchmark = True
    undo()
    assert _settings() == start
    torch.set_float32_matmul_precision("high")
    undo()  # a second undo changes nothing
    assert torch.get_float32_matmul_precision() == "high"


def test_none_leaves_a_setting_alone():
    with fasttorch.tune_device(
        matmul_precision=None, cudnn_benchmark=None, anomaly_detection=None
    ) as tuning:
        assert tuning.previous == {}
        assert _settings() == ("highest", False, True, False)


def test_restores_after_an_exception():
    with pytest.raises(KeyError), fasttorch.tune_device():
        raise KeyError("boom")
    assert _settings() == ("highest", False, True, False)


def test_an_active_profiler_is_refused_unless_allowed():
    with torch.profiler.profile():
        with pytest.raises(RuntimeError, match="autograd profiler .* is recording"):
            fasttorch.tune_device()
        fasttorch.tune_device(autograd_profiler=True).undo()
    assert _settings() == ("highest", False, True, False)


def test_bad_arguments():
    with pytest.raises(ValueError, match="matmul_precision must be .* got 'tf32'"):
        fasttorch.tune_device(matmul_precision="tf32")
    with pytest.raises(TypeError, match="cudnn_benchmark must be True, False or None, got 1"):
        fasttorch.tune_device(cudnn_benchmark=1)


def test_importing_fasttorch_changes_nothing():
    code = (
        "import torch; s = lambda: (torch.get_float32_matmul_precision(), "
        "torch.backends.cudnn.benchmark, torch.is_anomaly_enabled()); "
        "before = s(); import fasttorch, fasttorch.tuning, fasttorch.loop, fasttorch.data; "
        "assert s() == before, (before, s())"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr
