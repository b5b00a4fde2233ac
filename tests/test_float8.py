"""fasttorch.float8: torchao's float8 training in a fasttorch step, on the CPU in emulation.

Every composition is checked against torchao's own training loop on a deep copy of the
same model (``convert_to_float8_training`` + ``torch.optim.AdamW`` in the form fasttorch's
``adamw`` equals, ``clip_grad_norm_``, the loss divided by the number of microbatches),
step for step. Both sides run the same operations: torchao's casts and emulated scaled
products in the forward and backward, the same AdamW kernels. So the bound is rule 1
(``tolerance.EXACT``), and it has to be: a float8 rounding is 2**-4 relative, and one
flipped by a different order of operations would move a result far beyond rule 2.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from reference import adam_twin, mse
from tolerance import EXACT
from torch._dynamo.utils import counters

import fasttorch
from fasttorch import checkpoint

ao = pytest.importorskip("torchao.float8")
from fasttorch import float8  # noqa: E402 (after the skip: the module's examples need torchao)

LR = 1e-2
CLIP = 0.5
DECAY = 0.8
STEPS = 4
N = 2  # microbatches per window


class Net(torch.nn.Module):
    """Linear layers of float8's shapes (multiples of 16), a LayerNorm, and an output
    head of 4 (not a multiple of 16; left out by its name, as torchtitan does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.hidden = torch.nn.Linear(32, 48)
        self.output = torch.nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        return self.output(torch.tanh(self.hidden(h)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def data(steps: int = STEPS, rows: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g))
        for _ in range(steps)
    ]


def torchao_config(recipe: str, emulate: bool = True):
    return dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


COMPOSITIONS = ("plain", "accum_clip", "accum_clip_ema", "bf16_accum_clip")


def build(composition: str, mode: str) -> fasttorch.Step:
    step = fasttorch.step(mse)
    if composition.startswith("bf16"):
        step = fasttorch.with_amp(step, "bf16")
    if composition != "plain":
        step = fasttorch.clip_scaled(fasttorch.grad_accumulate(step, N), CLIP)
    if composition.endswith("ema"):
        step = fasttorch.ema(step, DECAY)
    step = float8.with_float8(step)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    return step


def torchao_loop(plain: Net, recipe: str, composition: str, batches, emulate: bool = True):
    """torchao's own loop on a deep copy: convert_to_float8_training, torch's AdamW,
    the loss / N backward per microbatch (under bf16 autocast for "bf16_..."),
    clip_grad_norm_, and the EMA as ``ema_v.lerp_(v, 1 - decay)``. Yields each step's
    parameters, loss and EMA."""
    model = copy.deepcopy(plain)
    ao.convert_to_float8_training(
        model,
        config=torchao_config(recipe, emulate),
        module_filter_fn=lambda m, fqn: fqn != "output",
    )
    opt = adam_twin(torch.optim.AdamW, LR, weight_decay=1e-2, fused=True)(model.parameters())
    average = copy.deepcopy(model)
    for x, y in batches:
        micro = [(x, y)] if composition == "plain" else zip(x.tensor_split(N), y.tensor_split(N))
        losses = []
        for mb in micro:
            bf16 = composition.startswith("bf16")
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = mse(model, mb)
            losses.append(loss.detach())
            (loss if composition == "plain" else loss / N).backward()
        if composition != "plain":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for e, v in zip(average.state_dict().values(), model.state_dict().values()):
                e.lerp_(v, 1 - DECAY)
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
        ema = {k: p.detach().clone() for k, p in average.named_parameters()}
        yield params, torch.stack(losses).mean(), ema


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize(
    ("recipe", "composition"),
    [
        (r, c)
        for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")
        for c in COMPOSITIONS
        # refused on a CPU: test_rowwise_with_gw_hp_under_cpu_autocast_is_refused
        if not (r == "rowwise_with_gw_hp" and c.startswith("bf16"))
    ],
)
def test_a_step_equals_torchaos_own_loop_step_for_step(recipe, composition, mode):
    plain = make_net()
    model = float8.convert(copy.deepcopy(plain), recipe, emulate=True)
    assert float8.float8_layers(model) == ["inp", "hidden"]  # not the output head
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR))
    step = build(composition, mode)
    batches = data()
    for i, (params, loss, ema) in enumerate(torchao_loop(plain, recipe, composition, batches)):
        state, metrics = step(state, batches[i])
        # Rule 1: the same casts, scaled products and AdamW kernels on both sides.
        for k, p in params.items():
            torch.testing.assert_close(state.params[k], p, **EXACT, msg=f"step {i}, {k}")
        torch.testing.assert_close(metrics["loss"], loss, **EXACT)
        if composition.endswith("ema"):
            for k, p in ema.items():
                torch.testing.assert_close(state.substates["ema"].params[k], p, **EXACT)
    assert int(state.step) == STEPS
    if mode == "compiled":  # the float8 casts traced whole, once
        assert counters["stats"]["unique_graphs"] >= 1
        assert not counters["graph_break"] and sum(counters["recompiles"].values()) == 0


def _float8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_gpu(), reason="needs a GPU of compute capability 8.9 or more")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_on_a_float8_gpu_a_step_equals_torchaos_own_loop(recipe):
    """The same comparison with torch._scaled_mm's float8 kernels (no emulation), under
    bf16 autocast, eager: the same kernels on both sides (rule 1)."""
    plain = make_net().cuda()
    model = float8.convert(copy.deepcopy(plain), recipe)
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR))
    step = build("bf16_accum_clip", "eager")
    batches = [tuple(t.cuda() for t in b) for b in data()]
    for i, (params, loss, _) in enumerate(
        torchao_loop(plain, recipe, "bf16_accum_clip", batches, emulate=False)
    ):
        state, metrics = step(state, batches[i])
        for k, p in params.items():
            torch.testing.assert_close(state.params[k], p, **EXACT, msg=f"step {i}, {k}")
        torch.testing.assert_close(metrics["loss"], loss, **EXACT)


def test_the_float8_layers_change_the_numbers():
    """The comparison above is not of two high-precision runs: one float8 step lands
    elsewhere than the same step of the unconverted model."""
    plain = make_net()
    batch = data(1)[0]
    out = {}
    for name, model in (
        ("plain", copy.deepcopy(plain)),
        ("f8", float8.convert(copy.deepcopy(plain), emulate=True)),
    ):
        state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR))
        out[name], _ = fasttorch.step(mse)(state, batch)
    assert not torch.equal(out["plain"].params["inp.weight"], out["f8"].params["inp.weight"])


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """Save after 2 windows, load into a fresh converted model's state, run 2 more:
    every leaf equals 4 uninterrupted windows bit for bit (rule 1)."""
    batches = data()
    step = build("accum_clip_ema", "eager")

    def fresh():
        model = float8.convert(make_net(seed=5), "rowwise", emulate=True)
        return step.init(fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR)))

    state = fresh()
    for b in batches[:2]:
        state, _ = step(state, b)
    path = checkpoint.save(tmp_path, state)
    for b in batches[2:]:
        state, last = step(state, b)
    resumed, _ = checkpoint.load(path, fresh())
    for b in batches[2:]:
        resumed, mine = step(resumed, b)
    ours = torch.utils._pytree.tree_leaves(state)
    theirs = torch.utils._pytree.tree_leaves(resumed)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **EXACT)
    torch.testing.assert_close(mine["loss"], last["loss"], **EXACT)


# --------------------------------------------------------------------------- refusals


def test_without_torchao_both_parts_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r'pip install "fasttorch\[ao\]"'):
        float8.convert(make_net(), emulate=True)
    with pytest.raises(ImportError, match=r'pip install "fasttorch\[ao\]"'):
        float8.with_float8(fasttorch.step(mse))


def test_a_cpu_without_emulation_is_refused_with_the_way_out():
    model = make_net()
    with pytest.raises(ValueError, match=r"on cpu, where float8 cannot run.*emulate=True"):
        float8.convert(model)
    assert float8.float8_layers(model) == []  # refused before anything changed


def test_a_gpu_below_compute_capability_8_9_has_no_float8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    ok, why = float8.matmul_support("cuda")
    assert not ok and "8.0" in why and "8.9" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert float8.matmul_support("cuda")[0]


def test_a_module_built_on_meta_and_moved_to_the_cpu_is_refused_at_the_first_call():
    with torch.device("meta"):
        model = Net()
    float8.convert(model)  # meta: nothing to check yet
    model.to_empty(device="cpu")
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
    step = float8.with_float8(fasttorch.step(mse))
    with pytest.raises(ValueError, match=r"with_float8 \(step 'mse'\): .*on cpu.*emulate=True"):
        step(state, data(1)[0])
    assert int(state.step) == 0  # refused before the step ran: the state is intact


def test_a_layer_float8_cannot_take_is_refused_when_chosen_and_skipped_with_a_warning():
    class Odd(Net):
        def __init__(self):
            super().__init__()
            self.side = torch.nn.Linear(16, 10)  # 10 is not a multiple of 16

    with pytest.raises(ValueError, match=r"'side' \(Linear 16 -> 10\).*multiples of 16"):
        float8.convert(Odd(), emulate=True, module_filter_fn=lambda m, fqn: True)
    with pytest.warns(UserWarning, match=r"stay in high precision.*: side"):
        model = float8.convert(Odd(), emulate=True)
    assert float8.float8_layers(model) == ["inp", "hidden"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named in filter_fqns: left out without a word
        float8.convert(Odd(), emulate=True, filter_fqns=("output", "side"))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"recipe": "blockwise"}, "recipe must be one of 'tensorwise', 'rowwise'"),
        (
            {"recipe": "rowwise", "enable_fsdp_float8_all_gather": True},
            "needs recipe='tensorwise', got 'rowwise'",
        ),
        ({"filter_fqns": ("inp", "hidden")}, "no linear layer of Net to convert"),
        ({"filter_fqns": "output"}, "write filter_fqns=('output',)"),
    ],
)
def test_bad_options_are_refused(kwargs, words):
    with pytest.raises(
        (ValueError, TypeError), match=words.replace("(", r"\(").replace(")", r"\)")
    ):
        float8.convert(make_net(), emulate=True, **kwargs)


def test_converting_twice_or_a_bare_linear_is_refused():
    model = float8.convert(make_net(), emulate=True)
    with pytest.raises(ValueError, match="already has float8 layers"):
        float8.convert(model, emulate=True)
    with pytest.raises(ValueError, match="root module is a Linear"):
        float8.convert(torch.nn.Linear(16, 16), emulate=True)


def test_rowwise_with_gw_hp_under_cpu_autocast_is_refused():
    """torchao's Float8Linear casts to the autocast dtype only under CUDA's autocast: on
    a CPU its high-precision weight gradient meets a bf16 gradient and a float32 input,
    and torchao's own loop fails in the backward. fasttorch says so before the step."""
    plain = make_net()
    ref = copy.deepcopy(plain)
    ao.convert_to_float8_training(
        ref,
        config=torchao_config("rowwise_with_gw_hp"),
        module_filter_fn=lambda m, f: f != "output",
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = mse(ref, data(1)[0])
    with pytest.raises(RuntimeError, match="same dtype"):
        loss.backward()
    model = float8.convert(plain, "rowwise_with_gw_hp", emulate=True)
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR))
    step = build("bf16_accum_clip", "eager")
    with pytest.raises(ValueError, match=r"layer 'inp' \(recipe 'rowwise_with_gw_hp'\).*'rowwise'"):
        step(state, data(1)[0])
    assert int(state.step) == 0


def test_with_float8_refuses_a_module_that_was_not_converted():
    state = fasttorch.TrainState.create(make_net(), fasttorch.optim.sgd(0.1))
    step = float8.with_float8(fasttorch.step(mse))
    with pytest.raises(ValueError, match=r"has no float8 layers.*fasttorch.float8.convert"):
        step(state, data(1)[0])
    with pytest.raises(ValueError, match="with_float8 is already applied"):
        float8.with_float8(step)
    with pytest.raises(TypeError, match="precompute_fsdp_scales must be True or False"):
        float8.with_float8(fasttorch.step(mse), precompute_fsdp_scales=1)  # type: ignore[arg-type]


# ------------------------------------------------------------ FSDP2, float8 all-gather


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """tests/float8_fsdp_worker.py's checks in one spawned 2-rank gloo group."""
    from dist_kit import spawn_group
    from float8_fsdp_worker import run

    return spawn_group(run, 2, tmp_path_factory.mktemp("float8_fsdp"))


def _ranks(results, name):
    for r, res in enumerate(results):
        assert "exception" not in res[name], f"rank {r}:\n{res[name].get('exception')}"
    return [res[name] for res in results]


@pytest.mark.parametrize("case", ["eager", "eager_clip", "compiled_clip"])
def test_sharded_float8_all_gather_equals_torchaos_fsdp2_loop(sharded, case):
    """2 gloo ranks, FSDP2 over the float8 layers with float8 all-gather, the scales
    precomputed inside the step, against torchao's recipe by hand on the same ranks
    (fully_shard, torch's AdamW, precompute_float8_dynamic_scale_for_fsdp after each
    optimizer step). gloo carries the float8 bytes: no refusal is needed."""
    for r in _ranks(sharded, case):
        assert r["steps"] == 3 and r["moved"] > 0, r
        if case == "eager":
            assert r["diff"] == 0.0, r  # rule 1: the same operations on the same shards
        else:
            # rule 2: the clipping norm is summed in another order (see the worker)
            assert r["diff"] <= r["bound"], r
        weights = {k: v for k, v in r["kinds"].items() if k.endswith("weight")}
        assert weights == {
            "inp.weight": "WeightWithDynamicFloat8CastTensor",
            "hidden.weight": "WeightWithDynamicFloat8CastTensor",
            "output.weight": "Tensor",  # the head, left out, gathers in float32
        }, r
        # Every all-gather of a float8 layer sent float8 bytes cast with the scale the
        # step precomputed, as many as torchao's own loop made.
        assert r["gathers"] and len(r["gathers"]) == len(r["hand_gathers"]), r
        assert all(g == ["torch.float8_e4m3fn", True] for g in r["gathers"]), r
        assert r["gathers"] == r["hand_gathers"], r


def test_without_the_precompute_each_all_gather_scales_its_own_weight(sharded):
    for r in _ranks(sharded, "no_precompute"):
        assert r["gathers"] and all(g == ["torch.float8_e4m3fn", False] for g in r["gathers"]), r


# ------------------------------------------------------------ benchmarks/float8.py


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.float8", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--recipes", "blockwise"), "--recipes: unknown ['blockwise']"),
        (("--models", "7b"), "--models: unknown ['7b']"),
        (("--dry-run", "--steps", "0"), "--steps must be >= 1"),
    ],
)
def test_the_float8_benchmark_refuses_bad_arguments(args, words):
    proc = _bench(*args)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_the_float8_benchmark_needs_a_gpu_unless_dry_run():
    proc = _bench("--steps", "2")
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr, proc.stderr[-2000:]


def test_the_float8_benchmark_runs_its_machinery_on_the_cpu(tmp_path):
    """--dry-run: the toy GPT, bf16 and tensorwise (emulated), compiled with aot_eager."""
    out = tmp_path / "rows.json"
    proc = _bench(
        "--dry-run", "--recipes", "tensorwise", "--steps", "1", "--warmup", "0", "--json", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["bf16", "tensorwise"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows
    assert "| tensorwise |" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_gpu(), reason="needs a GPU of compute capability 8.9 or more")
def test_the_float8_benchmark_on_a_gpu(tmp_path):
    """GPT-2 124M, bf16 against tensorwise float8, compiled: it runs and reports a ratio
    (the speed itself is the benchmark's table, not a test's threshold)."""
    out = tmp_path / "rows.json"
    proc = _bench("--models", "124m", "--recipes", "tensorwise", "--steps", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows


def test_the_gpu_command_puts_the_float8_table_in_its_section():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import gpu

    row = {"model": "GPT", "step_ms": 10.0, "warmup_s": 1.0, "peak_gib": 2.0, "loss": 5.0}
    rows = [
        {**row, "variant": "bf16", "tokens_per_s": 1000.0},
        {**row, "variant": "tensorwise", "tokens_per_s": 1300.0},
        {"model": "GPT", "variant": "rowwise", "error": "OutOfMemoryError()"},
    ]
    text = gpu._section({"float8": {"date": "2026-11-29", "rows": rows}}, dry_run=False)
    assert "### float8 training against bf16 (2026-11-29)" in text
    assert "| GPT | tensorwise | 1,300 | 10.0 | 1.30x | 2.0 | 5.000 |" in text
    assert "| GPT | rowwise | failed: OutOfMemoryError() |" in text


def test_a_sharded_float8_checkpoint_resumes_bit_for_bit(sharded):
    """DCP over the float8 weights' shards (torchao's weight subclass inside FSDP2's
    DTensors): saved after 2 windows, loaded in place into a freshly converted and
    sharded model's state, the third window equals the uninterrupted run (rule 1)."""
    for r in _ranks(sharded, "checkpoint"):
        assert r["equal"] == r["keys"] and len(r["keys"]) == 12, r
        assert r["kinds"] == ["Tensor", "WeightWithDynamicFloat8CastTensor"], r
