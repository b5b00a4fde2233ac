"""Each composition against the hand-written loop, on CUDA (and on the CPU in fp32).

The same test bodies run on every device: on CUDA in bf16 and fp16 (with the loss
scaler), eager, ``compiled`` and ``compiled(mode="reduce-overhead")`` (marked ``gpu``);
on the CPU in fp32, eager and ``compiled(backend="aot_eager")``, so that CI exercises
them without a GPU. The hand-written loop is the one people write on a GPU: autocast,
``GradScaler``, ``clip_grad_norm_``, fused AdamW, on a deep copy of the model.

Parameter updates are compared against the same loop in float64, with one bound for
all parameters (tests/README.md, rule 2): fasttorch's distance to the float64 update
is at most ``FACTOR`` times the hand-written loop's own distance to it. A per-parameter
relative error would be meaningless for a parameter whose true gradient is zero.
"""

from __future__ import annotations

import copy

import pytest
import torch
from reference import LayerNormNet, mse
from tolerance import FACTOR, unit_roundoff

import fasttorch

CUDA = [
    pytest.param("cuda", precision, mode, marks=pytest.mark.gpu, id=f"cuda-{precision}-{mode}")
    for precision in ("bf16", "fp16")
    for mode in ("eager", "compiled", "reduce-overhead")
]
CPU = [pytest.param("cpu", "fp32", mode, id=f"cpu-fp32-{mode}") for mode in ("eager", "aot_eager")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STEPS = 6
LR = 1e-2


def _batches(device: str, dtype: torch.dtype = torch.float32, n: int = STEPS, rows: int = 32):
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(rows, 8, generator=g).to(device, dtype),
            torch.randn(rows, 4, generator=g).to(device, dtype),
        )
        for _ in range(n)
    ]


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return LayerNormNet().to(device)


def _build(device: str, precision: str, mode: str, accumulate: int, clip: float | None):
    step = fasttorch.step(mse)
    if precision != "fp32":
        step = fasttorch.with_amp(step, precision)
    step = fasttorch.grad_accumulate(step, accumulate)
    if clip is not None:
        step = fasttorch.clip_scaled(step, clip)
    if mode == "aot_eager":
        step = fasttorch.compiled(step, backend="aot_eager")
    elif mode == "compiled":
        step = fasttorch.compiled(step)
    elif mode == "reduce-overhead":
        step = fasttorch.compiled(step, mode="reduce-overhead")
    return step


def _hand_loop(model, data, *, device, precision, accumulate, clip, fused=True):
    """The plain loop on a deep copy; returns the model and the loss scale of each step."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-2, fused=fused)
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
    scales = []
    for x, y in data:
        for mx, my in zip(x.tensor_split(accumulate), y.tensor_split(accumulate)):
            with torch.autocast(device, DTYPES[precision], enabled=precision != "fp32"):
                loss = mse(model, (mx, my))
            scaler.scale(loss * (len(mx) / len(x))).backward()
        scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scales.append(scaler.get_scale() if scaler.is_enabled() else 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model, scales


def _update_distance(params: dict, start: dict, exact: dict) -> float:
    """Largest entry of (params - start) - (exact - start): the update's error."""
    return max(float((params[k].detach().double() - exact[k]).abs().max()) for k in start)


@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("accumulate", [1, 2], ids=["acc1", "acc2"])
@pytest.mark.parametrize(("device", "precision", "mode"), CUDA + CPU)
def test_composition_matches_the_hand_written_loop(device, precision, mode, accumulate, clip):
    model = _model(device)
    data = _batches(device)
    start = {k: p.detach().double().clone() for k, p in model.named_parameters()}
    hand, hand_scales = _hand_loop(
        model, data, device=device, precision=precision, accumulate=accumulate, clip=clip
    )
    exact, _ = _hand_loop(
        copy.deepcopy(model).double(),
        _batches(device, torch.float64),
        device=device,
        precision="fp32",
        accumulate=accumulate,
        clip=clip,
        fused=False,
    )
    step = _build(device, precision, mode, accumulate, clip)
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR, weight_decay=1e-2))
    scales = []
    for b in data:
        state, m = step(state, b)
        scales.append(float(m["loss_scale"]) if precision == "fp16" else 1.0)

    exact_p = {k: p.detach() for k, p in exact.named_parameters()}
    hand_err = _update_distance(dict(hand.named_parameters()), start, exact_p)
    ours_err = _update_distance(state.params, start, exact_p)
    # One rounding of the largest parameter entry: a floor for a hand error that is 0.
    floor = unit_roundoff(torch.float32) * max(float(p.abs().max()) for p in exact_p.values())
    assert ours_err <= FACTOR * max(hand_err, floor), (ours_err, hand_err)
    assert scales == hand_scales  # the fp16 loss scale takes the same path (1.0 otherwise)
    assert int(state.step) == STEPS


@pytest.mark.parametrize(
    ("device", "mode"),
    [
        pytest.param("cuda", "compiled", marks=pytest.mark.gpu, id="cuda-compiled"),
        pytest.param("cuda", "reduce-overhead", marks=pytest.mark.gpu, id="cuda-reduce-overhead"),
        pytest.param("cpu", "aot_eager", id="cpu-aot_eager"),
    ],
)
def test_checkpoint_resume_is_bit_exact(device, mode, tmp_path):
    """Save after 3 steps, load into a fresh state, run 3 more: every parameter, every
    optimizer slot and the loss scale equal 6 uninterrupted steps bit for bit."""
    precision = "fp16" if device == "cuda" else "fp32"
    data = _batches(device)

    def fresh():
        step = _build(device, precision, mode, 2, 1.0)
        state = fasttorch.TrainState.create(_model(device), fasttorch.optim.adamw(LR))
        return step, step.init(state)

    step, state = fresh()
    for b in data[:3]:
        state, _ = step(state, b)
    path = fasttorch.checkpoint.save(tmp_path, state)
    for b in data[3:]:
        state, _ = step(state, b)

    step2, template = fresh()
    resumed, _ = fasttorch.checkpoint.load(path, template)
    for b in data[3:]:
        resumed, _ = step2(resumed, b)

    a = torch.utils._pytree.tree_leaves(state)
    b = torch.utils._pytree.tree_leaves(resumed)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
