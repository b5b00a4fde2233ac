"""compiled(..., cache_dir=): a second process starts from the first one's compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from reference import mse

import fasttorch

# One process: a tiny MLP step compiled with inductor, one call; prints the process's
# FX graph cache hits and misses (a miss is a graph inductor generated code for), and
# the new parameters.
CHILD = """
import json, sys, torch, fasttorch
from fasttorch import _compat
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-2))
def mse(apply, batch):
    return torch.nn.functional.mse_loss(apply(batch[0]), batch[1])
step = fasttorch.step(mse)
if sys.argv[2] != "fp32":
    step = fasttorch.with_amp(step, sys.argv[2])
step = fasttorch.compiled(step, cache_dir=sys.argv[1])
state, _ = step(state, (torch.randn(16, 8), torch.randn(16, 4)))
out = {**_compat.inductor_cache_counts(), "params": [p.tolist() for p in state.params.values()]}
print(json.dumps(out))
"""


def _process(cache: str, own: str, precision: str = "fp32") -> dict:
    # Each process gets a fresh TORCHINDUCTOR_CACHE_DIR of its own: only cache_dir can
    # share anything between them.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": own}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, cache, precision],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_loads_the_first_ones_compile(tmp_path):
    cache = str(tmp_path / "cache")
    first = _process(cache, str(tmp_path / "own1"))
    second = _process(cache, str(tmp_path / "own2"))
    assert first["miss"] >= 1 and first["hit"] == 0, first
    assert second["miss"] == 0 and second["hit"] >= 1, second  # no code generated
    assert second["params"] == first["params"]
    assert os.listdir(cache) and not os.listdir(tmp_path / "own2")


@pytest.mark.slow
def test_a_mixed_precision_step_skips_aot_autograd_in_the_second_process(tmp_path):
    # An autocast region in the graph made AOT autograd's cache refuse it ("Unsupported
    # call_function target _enter_autocast"): each warm process traced the forward and
    # backward again before the FX graph cache handed back the code.
    cache = str(tmp_path / "cache")
    first = _process(cache, str(tmp_path / "own1"), "bf16")
    second = _process(cache, str(tmp_path / "own2"), "bf16")
    assert first["aot_bypass"] == 0 and second["aot_bypass"] == 0, (first, second)
    assert second["miss"] == 0 and second["aot_hit"] == second["hit"] >= 1, second
    assert second["params"] == first["params"]


def test_cache_dir_is_checked_at_wrap_time(tmp_path):
    step = fasttorch.step(mse)
    with pytest.raises(ValueError, match="backend 'aot_eager' generates none"):
        fasttorch.compiled(step, backend="aot_eager", cache_dir=str(tmp_path))
    with pytest.raises(TypeError, match="cache_dir must be a directory path"):
        fasttorch.compiled(step, cache_dir=3)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        fasttorch.compiled(step, cache_dir=tmp_path / "file")
