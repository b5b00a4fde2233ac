"""torchao's low-bit optimizers in a fasttorch step, against torchao's own loop.

Tolerance rule. Each step is compared with torchao's loop on a deep copy of the model
(``torchao.optim.X(model.parameters(), ...)``, ``loss.backward()``, ``step()``,
``zero_grad()``) bit for bit (tests/tolerance.py's rule 1, ``EXACT``): fasttorch calls
the same kernel (torchao's ``single_param_adam``) on the same numbers. Eagerly the
kernel is compiled the way torchao compiles it (its default backend, the same cached
code); under ``torch.compiler.set_stance("force_eager")`` both sides run it eagerly.
In a compiled step (``backend="aot_eager"``) the kernel is traced into the step's
graph and runs as eager ATen ops: its reference is torchao's loop under
``set_stance("force_eager")``, the same ops again. The quantized states (codes and
block scales) are compared bit for bit as well.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from typing import Any

import pytest
import torch
from tolerance import EXACT, gamma
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import fasttorch
from fasttorch import checkpoint, optim
from fasttorch.optim import lowbit

ao = pytest.importorskip("torchao.optim")

STEPS = 3
LR = 0.01
ADAMW = ("AdamW8bit", "AdamW4bit", "AdamWFp8")
ALL = (*ADAMW, "Adam8bit", "Adam4bit", "AdamFp8")


def _model() -> nn.Module:
    # (64, 64) weights: 4096 values, quantized by torchao; the biases stay float32.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)) for _ in range(STEPS)
    ]


def _loss(apply: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(apply(x), y)


def _torchao_loop(model: nn.Module, name: str, **kw: Any) -> tuple[nn.Module, Any]:
    ref = copy.deepcopy(model)
    opt = getattr(ao, name)(ref.parameters(), lr=LR, **kw)
    for batch in _batches():
        _loss(ref, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref, opt


def _fasttorch(model: nn.Module, name: str, *, compiled: bool = False, **kw: Any) -> Any:
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), optim.from_torch(getattr(ao, name), LR, **kw)
    )
    step = fasttorch.step(_loss)
    if compiled:
        step = fasttorch.compiled(step, backend="aot_eager")
    for batch in _batches():
        state, _ = step(state, batch)
    return state


def _assert_same(state: Any, ref: nn.Module, opt: Any) -> None:
    quantized = [
        n for n, t in state.opt_state.slots["exp_avg"].items() if type(t) is not torch.Tensor
    ]
    assert quantized == ["0.weight", "2.weight"]  # the (64, 64) weights
    for (n, p), q in zip(state.params.items(), ref.parameters()):
        torch.testing.assert_close(p, q.detach(), **EXACT, msg=n)
        mine, theirs = state.opt_state.slots, opt.state[q]
        torch.testing.assert_close(mine["step"][n], theirs["step"], **EXACT)
        assert sorted(mine) == sorted(theirs) == ["exp_avg", "exp_avg_sq", "step"]
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = mine[key][n], theirs[key]
            assert type(a) is type(b), (n, key, type(a), type(b))
            for inner in a.__tensor_flatten__()[0] if hasattr(a, "__tensor_flatten__") else ():
                assert torch.equal(getattr(a, inner), getattr(b, inner)), (n, key, inner)
            if not hasattr(a, "__tensor_flatten__"):
                torch.testing.assert_close(a, b, **EXACT)


def test_eager_equals_torchao_compiled_kernel() -> None:
    """torchao's default: its kernel compiled by inductor, here the same cached code."""
    model = _model()
    ref, opt = _torchao_loop(model, "AdamW8bit", weight_decay=0.1)
    state = _fasttorch(model, "AdamW8bit", weight_decay=0.1)
    assert type(state.opt_state.slots["exp_avg"]["0.weight"]).__name__ == "OptimState8bit"
    _assert_same(state, ref, opt)


@pytest.mark.parametrize("name", ALL)
def test_eager_equals_torchao_loop(name: str) -> None:
    model = _model()
    kw = {"betas": (0.8, 0.9), "eps": 1e-6} if name == "AdamW4bit" else {}
    with torch.compiler.set_stance("force_eager"):
        ref, opt = _torchao_loop(model, name, **kw)
        state = _fasttorch(model, name, **kw)
    _assert_same(state, ref, opt)


@pytest.mark.parametrize("name", ADAMW)
def test_compiled_equals_torchao_loop(name: str) -> None:
    model = _model()
    with torch.compiler.set_stance("force_eager"):
        ref, opt = _torchao_loop(model, name)
    state = _fasttorch(model, name, compiled=True)
    _assert_same(state, ref, opt)


def test_not_donated_leaves_input_state() -> None:
    model = _model()
    state = fasttorch.TrainState.create(copy.deepcopy(model), optim.from_torchao(ao.AdamW8bit, LR))
    codes = state.opt_state.slots["exp_avg"]["0.weight"].codes.clone()
    step = fasttorch.step(_loss, donate=False)
    with torch.compiler.set_stance("force_eager"):
        new, _ = step(state, _batches()[0])
    assert torch.equal(state.opt_state.slots["exp_avg"]["0.weight"].codes, codes)
    assert not torch.equal(new.opt_state.slots["exp_avg"]["0.weight"].codes, codes)


def test_state_bytes_per_parameter() -> None:
    """fp32 AdamW: 8 bytes per parameter; 8-bit: 2 + block scales; 4-bit: 1 + scales.

    A (1024, 1024) weight: every state quantized. Counted from the inner tensors: the
    codes (1 byte per value; 4-bit: two per byte), one float32 scale per block (256
    values; 128 for 4-bit) and torchao's quantization map (256 float32; 16 for 4-bit),
    without the float32 step count torch and torchao keep per tensor.
    """
    n = 1024 * 1024
    params = {"w": torch.zeros(1024, 1024)}

    def per_param(opt: Any) -> float:
        state = opt.init(params)
        counts = sum(t.numel() * t.element_size() for t in state.slots.get("step", {}).values())
        return (optim.state_bytes(state) - counts) / n

    assert per_param(optim.from_torch(torch.optim.AdamW)) == 8.0
    assert per_param(optim.adamw(1e-3)) == 8.0
    eight = per_param(optim.from_torchao(ao.AdamW8bit))
    assert eight == 2 * (1 + 4 / 256) + 2 * 256 * 4 / n
    four = per_param(optim.from_torchao(ao.AdamW4bit))
    assert four == 2 * (0.5 + 4 / 128) + 2 * 16 * 4 / n
    fp8 = per_param(optim.from_torchao(ao.AdamWFp8))
    assert fp8 == 2 * (1 + 4 / 256)


def test_small_tensors_stay_float32() -> None:
    opt = optim.from_torchao(ao.AdamW8bit)
    state = opt.init(
        {"small": torch.zeros(4095), "odd": torch.zeros(4097), "big": torch.zeros(4096)}
    )
    kinds = {n: type(t).__name__ for n, t in state.slots["exp_avg"].items()}
    assert kinds == {"small": "Tensor", "odd": "Tensor", "big": "OptimState8bit"}


def test_refusals() -> None:
    with pytest.raises(ValueError, match="bf16_stochastic_round=True is not supported"):
        optim.from_torchao(ao.AdamW8bit, bf16_stochastic_round=True)
    with pytest.raises(TypeError, match="CPUOffloadOptimizer keeps hooks"):
        optim.from_torchao(ao.CPUOffloadOptimizer)
    with pytest.raises(TypeError, match="expected one of torchao.optim"):
        optim.from_torchao(torch.optim.AdamW)
    with pytest.raises(ValueError, match="Invalid beta"):
        optim.from_torch(ao.AdamW8bit, betas=(1.5, 0.9))
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        optim.from_torchao(ao.AdamW8bit, amsgrad=True)
    with pytest.raises(ValueError, match="lr >= 0"):
        optim.from_torchao(ao.AdamW4bit, -1.0)


def test_torchao_amsgrad_fails_on_its_own_states() -> None:
    """Why amsgrad is refused: torchao's own step cannot take it with quantized states
    (when torchao fixes this, this test fails and the refusal can go)."""
    w = nn.Parameter(torch.ones(64, 64))
    opt = ao.AdamW8bit([w], amsgrad=True)
    w.grad = torch.ones(64, 64)
    with (
        torch.compiler.set_stance("force_eager"),
        pytest.raises(NotImplementedError, match="maximum"),
    ):
        opt.step()


def test_lr_is_a_tensor_in_the_state() -> None:
    opt = optim.from_torchao(ao.AdamW8bit, 0.5)
    state = opt.init({"w": torch.zeros(3)})
    assert state.hyper["lr"].dtype == torch.float32 and state.hyper["lr"].ndim == 0
    new = optim.set_hyperparams(state, lr=0.25)
    assert float(opt.learning_rate(new, torch.tensor(0))) == 0.25
    assert isinstance(lowbit.from_torchao(ao.Adam4bit), lowbit.TorchaoOptimizer)


def _make_state(name: str) -> fasttorch.TrainState:
    return fasttorch.TrainState.create(_model(), optim.from_torchao(getattr(ao, name), LR))


@pytest.mark.parametrize("inplace", [False, True])
def test_checkpoint_resumes_bit_for_bit(tmp_path: Any, inplace: bool) -> None:
    """Saved after 2 steps, loaded into a fresh template, 2 more steps: the same
    parameters and quantized states (codes, scales) as 4 steps without the save."""
    batches = _batches() + _batches()[:1]
    step = fasttorch.step(_loss)
    with torch.compiler.set_stance("force_eager"):
        state = _make_state("AdamW4bit")
        for b in batches[:2]:
            state, _ = step(state, b)
        path = checkpoint.save(tmp_path, state)
        for b in batches[2:]:
            state, _ = step(state, b)
        loaded, _ = checkpoint.load(path, _make_state("AdamW4bit"), inplace=inplace)
        for b in batches[2:]:
            loaded, _ = step(loaded, b)
    ours, theirs = _leaves(loaded), _leaves(state)
    assert ours.keys() == theirs.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], **EXACT, msg=k)
    manifest = checkpoint.verify(path)
    key = "opt_state/slots/exp_avg/0.weight"
    assert manifest["entries"][key] == {"shape": [64, 64], "dtype": "float32"}  # its values
    assert key in manifest["quantized"]
    meta = FileSystemReader(path).read_metadata().state_dict_metadata  # our own file
    codes = meta[f"{key}/codes"]  # what the load read: two 4-bit codes a byte, flat
    assert (list(codes.size), codes.properties.dtype) == ([64 * 64 // 2], torch.uint8)


def _leaves(state: fasttorch.TrainState) -> dict[str, torch.Tensor]:
    """Every leaf, a quantized state by its inner tensors."""
    out = {}
    for path, t in torch.utils._pytree.tree_flatten_with_path(state)[0]:
        key = torch.utils._pytree.keystr(path)
        if hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                out[f"{key}.{name}"] = getattr(t, name)
        else:
            out[key] = t
    return out


def test_checkpoint_refuses_another_optimizer(tmp_path: Any) -> None:
    state = _make_state("AdamW8bit")
    path = checkpoint.save(tmp_path, state)
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"TorchaoOptimizer\(AdamW8bit\)"):
        checkpoint.load(path, fasttorch.TrainState.create(_model(), optim.adamw(LR)))
    with pytest.raises(checkpoint.CheckpointMismatchError, match="exp_avg/0.weight"):
        checkpoint.load(path, _make_state("AdamW4bit"))


def test_cpu_offload_is_refused_on_a_cpu_as_torchao_refuses_it() -> None:
    opt = optim.cpu_offload(torch.optim.AdamW, LR)
    with pytest.raises(ValueError, match="cpu_offload: the parameters are on 'cpu'"):
        fasttorch.TrainState.create(_model(), opt)
    if not torch.cuda.is_available():  # torchao's own class, on this machine
        with pytest.raises(AssertionError, match="only supports CUDA & XPU"):
            ao.CPUOffloadOptimizer(_model().parameters(), torch.optim.AdamW, lr=LR)
    with pytest.raises(RuntimeError, match="cannot run in a compiled step"):
        opt.check_compilable()


@pytest.mark.gpu
def test_cpu_offload_equals_torchao_on_cuda() -> None:
    """On CUDA: torchao's CPUOffloadOptimizer loop and fasttorch's step, the large
    weights stepped by torch's fused CPU AdamW in host memory on both sides, the biases
    (fewer than 4096 values) by the fused CUDA AdamW on the device: the same kernels on
    the same numbers, EXACT. The lr is a float32 value on both sides, so the Python
    float torchao's loop passes and the float32 tensor fasttorch passes to the CUDA
    kernel hold the same number."""
    lr = float(torch.tensor(LR))
    model = _model().cuda()
    ref = copy.deepcopy(model)
    opt = ao.CPUOffloadOptimizer(ref.parameters(), torch.optim.AdamW, lr=lr)
    batches = [tuple(t.cuda() for t in b) for b in _batches()]
    for batch in batches:
        _loss(ref, batch).backward()
        opt.step()
        opt.zero_grad()
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), optim.cpu_offload(torch.optim.AdamW, lr)
    )
    assert state.opt_state.slots["exp_avg"]["0.weight"].device.type == "cpu"
    assert state.opt_state.slots["exp_avg"]["0.bias"].device.type == "cuda"
    step = fasttorch.step(_loss)
    for batch in batches:
        state, _ = step(state, batch)
    for (n, p), q in zip(state.params.items(), ref.parameters()):
        torch.testing.assert_close(p, q.detach(), **EXACT, msg=n)


def test_memory_benchmark_runs_at_a_tiny_size(tmp_path: Any) -> None:
    """``python -m benchmarks.memory --tiny --write``: each option once, the table written;
    the counted state bytes: fp32 AdamW 8 per parameter, the low-bit ones fewer; fasttorch's
    float8 step (``float8.convert`` + ``with_float8``) saves for backward what torchao's
    hand loop saves, alone and combined (the same forward ops on both sides: equal
    counts)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "memory.md"
    root = Path(__file__).resolve().parent.parent
    subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--tiny", "--write", str(out)],
        cwd=root,
        check=True,
        capture_output=True,
        timeout=300,
    )
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:]
        for line in out.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| ---")
    }
    assert float(rows["fp32, AdamW"][0]) == 8.0
    assert (
        float(rows["bf16, AdamW8bit"][0]) < 3
        and float(rows["fp32, AdamW4bit, selective AC"][0]) < 2
    )
    assert "bf16, AdamW, selective AC" in rows
    for name in (
        "float8 (tensorwise, emulated)",
        "float8 (tensorwise, emulated), bf16, AdamW8bit, selective AC",
    ):
        act_fast, act_hand, w_fast, w_hand = (float(x) for x in rows[name][:4])
        assert (act_fast, w_fast) == (act_hand, w_hand), (name, rows[name])
        assert act_fast > 0, (name, rows[name])
    assert float(rows["float8 (tensorwise, emulated)"][2]) > 0


class _WithUnused(nn.Module):
    """The test model and a layer the loss never reaches (torch and torchao skip it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.unused = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("compiled", [False, True])
def test_composes_with_skip_nonfinite_accumulation_and_unused_parameters(
    compiled: bool,
) -> None:
    """``skip_nonfinite(grad_accumulate(step, 2))`` on a model with an unused layer;
    the second window holds a NaN. torchao's loop: the loss halved per microbatch,
    ``backward`` twice, and no ``step()`` for the NaN window; the unused layer gets no
    gradient, so torchao never steps (nor creates a state for) it. Both sides run the
    same ops (powers-of-two weights, torchao's kernel eagerly or traced with
    ``aot_eager``): EXACT. A skipped window keeps the quantized states (their codes
    and scales are selected, not requantized)."""
    torch.manual_seed(0)
    model = _WithUnused()
    windows = [_batches()[:2], _batches()[1:], _batches()[::2]]
    windows[1] = [(windows[1][0][0] * float("nan"), windows[1][0][1]), windows[1][1]]
    with torch.compiler.set_stance("force_eager"):
        ref = copy.deepcopy(model)
        opt = ao.AdamW8bit(ref.parameters(), lr=LR)
        for w, window in enumerate(windows):
            for batch in window:
                (_loss(ref, batch) / 2).backward()
            if w != 1:
                opt.step()
            opt.zero_grad(set_to_none=True)
    state = fasttorch.TrainState.create(copy.deepcopy(model), optim.from_torchao(ao.AdamW8bit, LR))
    step = fasttorch.skip_nonfinite(fasttorch.grad_accumulate(fasttorch.step(_loss), 2))
    state = step.init(state)
    if compiled:
        step = fasttorch.compiled(step, backend="aot_eager")
    with contextlib.nullcontext() if compiled else torch.compiler.set_stance("force_eager"):
        for window in windows:
            x = torch.cat([b[0] for b in window])
            y = torch.cat([b[1] for b in window])
            state, _ = step(state, (x, y))
    used = {k: v for k, v in state.params.items() if not k.startswith("unused")}
    assert torch.equal(state.params["unused.weight"], model.unused.weight)
    assert float(state.opt_state.slots["step"]["unused.weight"]) == 0
    ref_params = dict(ref.named_parameters())
    for n, p in used.items():
        torch.testing.assert_close(p, ref_params[n].detach(), **EXACT, msg=n)
        theirs = opt.state[ref_params[n]]
        torch.testing.assert_close(state.opt_state.slots["step"][n], theirs["step"], **EXACT)
        a, b = state.opt_state.slots["exp_avg_sq"][n], theirs["exp_avg_sq"]
        for inner in getattr(a, "tensor_attrs", ()):
            assert torch.equal(getattr(a, inner), getattr(b, inner)), (n, inner)


def requant_bound(qmap: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Per value, how far torchao's requantization of values ``v`` into an 8-bit or
    4-bit state (code map ``qmap``, new block scales ``scale``) may move them. A block's
    values are divided by its new scale ``s = max|v|`` (into [-1, 1], or [0, 1] for a
    second moment) and rounded to the nearest code of the map: at most half the widest
    gap between neighbouring codes, or the distance from the domain's end to the
    outermost code, ``h``; dequantized, ``|deq - v| <= s * h``, plus four float32
    roundings of values at most ``s`` (the division, the rounding test's subtraction
    and halving, the product on dequantizing): ``s * (h + gamma(4))``."""
    q = qmap.double()
    lo = -1.0 if float(q[0]) < 0 else 0.0
    h = max(float((q[1:] - q[:-1]).max()) / 2, float(q[0]) - lo, 1.0 - float(q[-1]))
    block = math.prod(shape) // scale.numel()
    return (scale.double() * (h + gamma(4))).repeat_interleave(block).view(shape)


def fp8_requant_bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same for a float8 state: a block's values divided by ``s = max|v| / 448``
    and cast to E4M3 (3 mantissa bits): half a unit in the last place, at most
    ``|x| * 2**-4`` for a normal ``x = v / s``, ``2**-10`` below the smallest normal
    (2**-6); times ``s`` on dequantizing: ``max(|v| * 2**-4, s * 2**-10)``, plus the
    float32 roundings of the division and the product (``gamma(4) * (|v| + s)``)."""
    block = v.numel() // scale.numel()
    s = scale.double().repeat_interleave(block).view(v.shape)
    a = v.double().abs()
    return torch.maximum(a * 2**-4, s * 2**-10) + gamma(4) * (a + s)


def _assert_requantized(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], inner: dict[str, torch.Tensor]
) -> int:
    """Plain leaves bitwise; each quantized one (``inner`` has its ``.codes``) within
    its requantization bound. Returns how many were quantized."""
    assert got.keys() == want.keys()
    n = 0
    for k in got:
        if f"{k}.codes" in inner:
            n += 1
            scale = inner[f"{k}.scale"]
            bound = (
                requant_bound(inner[f"{k}.qmap"], scale, got[k].shape)
                if f"{k}.qmap" in inner
                else fp8_requant_bound(want[k], scale)
            )
            err = (got[k].double() - want[k].double()).abs()
            assert bool((err <= bound).all()), (k, float((err - bound).max()))
        else:
            torch.testing.assert_close(got[k], want[k], **EXACT, msg=k)
    return n


ONE_TO_TWO = ("AdamW4bit", "AdamWFp8")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_quantized_states_resume_and_reshard(tmp_path: Any) -> None:
    """FSDP2 on 2 gloo ranks (tests/lowbit_worker.py), torchao's states quantized per
    local shard. On the same 2 ranks: resumed bit for bit (AdamW8bit: codes, scales,
    parameters). 2 -> 1 (a plain process, AdamW8bit) and 1 -> 2 (AdamW4bit, AdamWFp8):
    the values resharded by DCP and requantized by torchao into the new layout; the
    parameters and step counts bitwise, each moment within its requantization bound."""
    from dist_kit import spawn_group
    from lowbit_worker import batches, inner, loss, new_state, run, values

    step = fasttorch.step(loss)
    singles, wholes = {}, {}
    with torch.compiler.set_stance("force_eager"):
        for name in ONE_TO_TWO:
            single = new_state(getattr(ao, name), False)
            for b in batches(0)[:2]:
                single, _ = step(single, b)
            singles[name] = str(checkpoint.save(tmp_path / name, single))
            wholes[name] = values(single)
    results = spawn_group(run, 2, tmp_path, singles, deadline_s=300)
    for r, res in enumerate(results):
        for name in ("resume", "one_to_two"):
            assert "exception" not in res[name], f"rank {r} {name}:\n{res[name]['exception']}"
        got = res["resume"]
        assert got["kind"] == "OptimState8bit" and got["keys_equal"], got
        assert got["compared"] > 0 and got["mismatched"] == [], got
        assert res["one_to_two"] == {"AdamW4bit": "OptimState4bit", "AdamWFp8": "OptimStateFp8"}

    # 1 -> 2: each rank's values are its rows (FSDP2's dim-0 chunks) of the one process's.
    for name in ONE_TO_TWO:
        for r in range(2):
            mine = torch.load(tmp_path / f"one_to_two_{name}{r}.pt", weights_only=True)
            mine_inner = torch.load(tmp_path / f"one_to_two_inner_{name}{r}.pt", weights_only=True)
            del mine[".rng"]  # rank 1, new since the save, keeps its own (checkpoint.load)
            rows = {
                k: t if mine[k].shape == t.shape else t.chunk(2)[r]
                for k, t in wholes[name].items()
                if k in mine
            }
            assert _assert_requantized(mine, rows, mine_inner) == 2  # exp_avg, exp_avg_sq

    # 2 -> 1: a plain process loads the 2 ranks' checkpoint; the ranks' rows concatenated.
    saved = [torch.load(tmp_path / f"saved_values{r}.pt", weights_only=True) for r in range(2)]
    loaded, _ = checkpoint.load(results[0]["resume"]["path"], new_state(ao.AdamW8bit, False))
    got = values(loaded)
    want = {
        k: t if got[k].shape == t.shape else torch.cat([s[k] for s in saved])
        for k, t in saved[0].items()
    }
    assert _assert_requantized(got, want, inner(loaded)) == 2


def test_a_checkpoint_with_a_malformed_quantized_list_is_refused(tmp_path: Any) -> None:
    """The manifest's ``quantized`` (entry -> class name) is checked before it is used."""
    path = checkpoint.save(tmp_path, _make_state("AdamW8bit"))
    mf = path / checkpoint.MANIFEST
    manifest = json.loads(mf.read_text())
    manifest["quantized"] = ["opt_state/slots/exp_avg/0.weight"]
    mf.write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="'quantized' must map entry names"):
        checkpoint.load(path, _make_state("AdamW8bit"))


def test_another_block_size_is_requantized_with_a_warning(tmp_path: Any) -> None:
    """Saved with AdamW8bit's 256-value blocks, loaded into one with 128-value blocks
    (one process): not the saved layout, so the values are requantized, with a warning;
    each within its requantization bound, the parameters bitwise."""
    from lowbit_worker import inner, values

    state = _make_state("AdamW8bit")
    step = fasttorch.step(_loss)
    with torch.compiler.set_stance("force_eager"):
        for b in _batches()[:2]:
            state, _ = step(state, b)
    path = checkpoint.save(tmp_path, state)
    template = fasttorch.TrainState.create(
        _model(), optim.from_torchao(ao.AdamW8bit, LR, block_size=128)
    )
    with pytest.warns(UserWarning, match="requantized into the template's layout"):
        loaded, _ = checkpoint.load(path, template)
    got = inner(loaded)
    assert got[".opt_state.slots['exp_avg']['0.weight'].scale"].numel() == 64 * 64 // 128
    assert _assert_requantized(values(loaded), values(state), got) == 4  # 2 weights x 2


def test_async_save_of_quantized_states_resumes_bit_for_bit(tmp_path: Any) -> None:
    """checkpoint.async_save stages the values and inner tensors (plain tensors) like
    any other entry: loaded, every leaf (codes, scales) equals the saved state's."""
    state = _make_state("AdamWFp8")
    with torch.compiler.set_stance("force_eager"):
        state, _ = fasttorch.step(_loss)(state, _batches()[0])
    path = checkpoint.async_save(tmp_path, state).wait()
    loaded, _ = checkpoint.load(path, _make_state("AdamWFp8"))
    ours, theirs = _leaves(loaded), _leaves(state)
    assert ours.keys() == theirs.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], **EXACT, msg=k)
