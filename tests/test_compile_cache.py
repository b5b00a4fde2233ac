"""compiled(..., cache_dir=): a second process starts from the first one's compile."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from reference import mse, reference_run
from tolerance import fp32_reference_error, params_atol

import fasttorch
from fasttorch import _compat
from fasttorch._compile import regions as _regions
from fasttorch._compile.cache import STEPS_DIR

# One process: a tiny MLP step (two microbatches: two compiled functions) compiled with
# inductor; prints what the process compiled, traced and loaded, its warnings, and the
# new parameters after each call. argv: the cache directory and a JSON configuration.
CHILD = """
import json, sys, warnings, torch, fasttorch
from fasttorch import _compat
from fasttorch._compile import cache as _compile_cache
warnings.simplefilter("always")
torch.set_num_threads(1)
cfg = json.loads(sys.argv[2])
torch.manual_seed(0)
if cfg.get("blocks"):  # two identical blocks: regions apply
    block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    model = torch.nn.Sequential(block(), block(), torch.nn.Linear(8, 4))
else:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = fasttorch.optim.adamw(cfg.get("lr", 1e-2), opaque=cfg.get("opaque", False))
state = fasttorch.TrainState.create(model, opt)
def mse(apply, batch):
    return torch.nn.functional.mse_loss(apply(batch[0]), batch[1])
step = fasttorch.grad_accumulate(fasttorch.step(mse), 2)
if cfg.get("precision", "fp32") != "fp32":
    step = fasttorch.with_amp(step, cfg["precision"])
step = fasttorch.compiled(
    step, cache_dir=sys.argv[1], fullgraph=cfg.get("fullgraph", True),
    regions=bool(cfg.get("blocks")),
)
g = torch.Generator().manual_seed(1)
def batch(rows):
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)
params = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for rows in cfg.get("rows", [16]):
        state, _ = step(state, batch(rows))
        params.append([p.tolist() for p in state.params.values()])
out = {
    **_compat.inductor_cache_counts(),
    **_compile_cache.counts,
    "dynamo": _compat.compile_phase_seconds()["dynamo"],
    # (each process's own TORCHINDUCTOR_CACHE_DIR is replaced, as it should be, with a
    # warning: left out)
    "warnings": [
        str(w.message) for w in caught
        if "compiled:" in str(w.message) and "replaces TORCHINDUCTOR" not in str(w.message)
    ],
    "params": params,
}
print(json.dumps(out))
"""


def _process(cache: str, own: str, **cfg: object) -> dict:
    # Each process gets a fresh TORCHINDUCTOR_CACHE_DIR of its own: only cache_dir can
    # share anything between them.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": own}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, cache, json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


keeps_traced_steps = pytest.mark.skipif(
    not _compat.precompile_available(),
    reason=f"torch {torch.__version__} cannot load a traced function with external data",
)


def _kept(cache: str) -> list[str]:
    return sorted(os.listdir(os.path.join(cache, STEPS_DIR)))


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A first process's cache directory, its report, and a factory of copies of it."""
    root = tmp_path_factory.mktemp("cold")
    cache = str(root / "cache")
    report = _process(cache, str(root / "own"))

    def copy(name: str) -> str:
        dest = str(root / name)
        shutil.copytree(cache, dest)
        return dest

    return cache, report, copy


@pytest.mark.slow
@keeps_traced_steps
def test_second_process_loads_the_traced_step_and_traces_nothing(cold, tmp_path):
    cache, first, copy = cold
    assert first["kept"] == 2 and first["loaded"] == 0, first  # the microbatch, the update
    assert first["dynamo"] > 0 and first["warnings"] == [], first
    assert len(_kept(cache)) == 2
    # A copy of the directory, elsewhere: where the cache is is not part of the key.
    second = _process(copy("copy-warm"), str(tmp_path / "own2"))
    assert second["loaded"] == 2 and second["kept"] == 0, second
    assert second["dynamo"] == 0 and second["miss"] == 0, second  # no tracing, no codegen
    assert second["warnings"] == [], second
    assert second["params"] == first["params"]  # the same compiled code: the same bits
    assert not os.listdir(tmp_path / "own2")
    _assert_matches_the_hand_written_loop(first["params"][0])


def _assert_matches_the_hand_written_loop(params: list) -> None:
    """The child's first step against torch.optim.AdamW over two microbatches of its
    batch, by rule 2 (inductor's kernels and the eager loop order sums differently)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    windows = [list(zip(x.chunk(2), y.chunk(2)))]
    make_opt = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
    ref, _ = reference_run(model, windows, make_opt=make_opt)
    atol = params_atol(
        fp32_reference_error(model, windows, make_opt=make_opt), dict(ref.named_parameters())
    )
    for got, (name, want) in zip(params, ref.named_parameters(), strict=True):
        torch.testing.assert_close(
            torch.tensor(got), want.detach(), rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.slow
@keeps_traced_steps
def test_a_loaded_step_falls_back_when_its_tensor_guards_fail(cold, tmp_path):
    _, first, copy = cold
    # The second call's batch has another number of rows: the kept graph's tensor guards
    # reject it, and the step compiles for it as a recompile would, saying so.
    out = _process(copy("copy-shape"), str(tmp_path / "own"), rows=[16, 12])
    assert out["loaded"] == 2 and out["params"][0] == first["params"][0], out
    assert any("does not fit this call" in w for w in out["warnings"]), out["warnings"]
    assert all(math.isfinite(x) for p in out["params"][1] for x in _flat(p))


@pytest.mark.slow
@keeps_traced_steps
def test_a_step_with_the_opaque_update_is_kept_and_loaded(cold, tmp_path):
    """``adamw(..., opaque=True)``, the default: the update runs outside the graphs
    (torch's fused kernel), so the microbatch's graph is the one kept, a new digest,
    not the step kept without the option; a second process loads it."""
    _, _, copy = cold
    cache = copy("copy-opaque")  # it holds the same step kept without the option
    first = _process(cache, str(tmp_path / "own1"), opaque=True)
    # The optimizer is in the digest: traced and kept beside the other, not loaded.
    assert first["kept"] == 1 and first["loaded"] == 0 and first["warnings"] == [], first
    assert len(_kept(cache)) == 3
    second = _process(cache, str(tmp_path / "own2"), opaque=True)
    assert second["loaded"] == 1 and second["dynamo"] == 0 and second["miss"] == 0, second
    assert second["params"] == first["params"]
    _assert_matches_the_hand_written_loop(first["params"][0])


@pytest.mark.slow
@keeps_traced_steps
def test_a_changed_step_is_traced_again_not_loaded(cold, tmp_path):
    _, first, copy = cold
    cache = copy("copy-lr")
    out = _process(cache, str(tmp_path / "own"), lr=3e-2)  # a hyperparameter, in no tensor
    assert out["loaded"] == 0 and out["kept"] == 2, out
    assert len(_kept(cache)) == 4
    assert out["params"] != first["params"]


@pytest.mark.slow
@keeps_traced_steps
def test_an_unreadable_kept_step_is_traced_again_with_a_warning(cold, tmp_path):
    _, first, copy = cold
    cache = copy("copy-broken")
    for name in _kept(cache):
        with open(os.path.join(cache, STEPS_DIR, name), "r+b") as f:
            f.truncate(100)
    out = _process(cache, str(tmp_path / "own"))
    assert out["loaded"] == 0 and out["kept"] == 2, out
    assert sum("cannot load" in w for w in out["warnings"]) == 2, out["warnings"]
    assert out["params"] == first["params"]
    # Replaced: a further process loads them.
    again = _process(cache, str(tmp_path / "own-again"))
    assert again["loaded"] == 2 and again["params"] == first["params"], again


@pytest.mark.slow
def test_a_mixed_precision_step_skips_aot_autograd_in_the_second_process(tmp_path):
    # Without the traced step kept (fullgraph=False), a warm start loads through AOT
    # autograd's and inductor's caches. An autocast region in the graph made AOT
    # autograd's cache refuse it ("Unsupported call_function target _enter_autocast"):
    # each warm process traced the forward and backward again before the FX graph
    # cache handed back the code.
    cache = str(tmp_path / "cache")
    first = _process(cache, str(tmp_path / "own1"), precision="bf16", fullgraph=False)
    second = _process(cache, str(tmp_path / "own2"), precision="bf16", fullgraph=False)
    assert any("not the traced step, because" in w for w in first["warnings"])
    assert first["kept"] == 0 and first["miss"] >= 1 and first["hit"] == 0, first
    assert first["aot_bypass"] == 0 and second["aot_bypass"] == 0, (first, second)
    assert second["miss"] == 0 and second["aot_hit"] == second["hit"] >= 1, second
    assert second["params"] == first["params"]


@pytest.mark.slow
@pytest.mark.skipif(_regions.unavailable() is not None, reason="no regions on this torch")
def test_a_step_with_regions_says_it_is_not_kept_and_warms_through_inductor(tmp_path):
    # Two identical blocks as regions: a step traced ahead keeps tensor guards reached
    # through the template's submodules, which a new process could not rebuild (torch
    # 2.13). So it is not kept, compiled says why, and inductor's caches still serve.
    cache = str(tmp_path / "cache")
    first = _process(cache, str(tmp_path / "own1"), blocks=True)
    second = _process(cache, str(tmp_path / "own2"), blocks=True)
    for out in (first, second):
        assert out["kept"] == 0 and out["loaded"] == 0, out
        assert any("blocks run as regions" in w for w in out["warnings"]), out["warnings"]
    assert first["miss"] >= 1 and second["miss"] == 0 and second["hit"] >= 1, second
    assert second["params"] == first["params"]


def _flat(x: object) -> list[float]:
    if isinstance(x, list):
        return [v for item in x for v in _flat(item)]
    return [float(x)]  # type: ignore[arg-type]


def test_cache_dir_is_checked_at_wrap_time(tmp_path):
    step = fasttorch.step(mse)
    with pytest.raises(ValueError, match="backend 'aot_eager' generates none"):
        fasttorch.compiled(step, backend="aot_eager", cache_dir=str(tmp_path))
    with pytest.raises(TypeError, match="cache_dir must be a directory path"):
        fasttorch.compiled(step, cache_dir=3)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        fasttorch.compiled(step, cache_dir=tmp_path / "file")
