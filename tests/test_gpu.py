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
from tolerance import FACTOR, gamma, unit_roundoff

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


# --------------------------------------------------------------------------- CUDA graphs
#
# mode="reduce-overhead" must capture every graph of the step (inductor's skip counter
# stays 0), never recompile, never sync with the host once warm, and give bit for bit
# what the same kernels give launched one by one (mode=None): same generated code, so
# rule 1 of tests/README.md. The harness runs on the CPU as well (aot_eager, where the
# counters and the sync guard are checked too) so that CI exercises it without a GPU.

WARMUP = 2  # cudagraph trees run a graph once eagerly, then record it


class Deep(torch.nn.Module):
    """36 Linear + LayerNorm pairs: 144 parameter tensors, more than GPT-2's 148 - 4."""

    def __init__(self, width: int = 8, depth: int = 36) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(depth))
        self.out = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms):
            x = x + torch.tanh(norm(layer(x)))
        return self.out(x)


def _mse_with_aux(apply, batch):
    x, y = batch
    out = apply(x)
    return mse(lambda _: out, batch), {"mean_out": out.float().mean()}


def _graph_case(name: str, device: str):
    """``(model, optimizer, wrap(step), loss_fn, precision)`` for one named case."""
    from reference import BatchNormNet

    opt = fasttorch.optim.adamw(LR, weight_decay=1e-2)
    plain = (LayerNormNet, opt, lambda s: s, mse, "fp32")
    cases = {
        "whole": plain,
        "accumulate": (LayerNormNet, opt, lambda s: fasttorch.grad_accumulate(s, 4), mse, "fp32"),
        "across_calls": (
            LayerNormNet,
            opt,
            lambda s: fasttorch.grad_accumulate(s, 3, across_calls=True),
            mse,
            "fp32",
        ),
        "aux_accumulate": (
            LayerNormNet,
            opt,
            lambda s: fasttorch.grad_accumulate(s, 4),
            _mse_with_aux,
            "fp32",
        ),
        "ema_nonfinite": (
            LayerNormNet,
            opt,
            lambda s: fasttorch.ema(fasttorch.skip_nonfinite(s), 0.9),
            mse,
            "fp32",
        ),
        "fp16_loss_scale": (
            LayerNormNet,
            opt,
            lambda s: fasttorch.clip_scaled(fasttorch.grad_accumulate(s, 2), 1.0),
            mse,
            "fp16",
        ),
        "schedule": (
            LayerNormNet,
            fasttorch.optim.adamw(fasttorch.schedules.cosine(LR, 20)),
            lambda s: s,
            mse,
            "fp32",
        ),
        "from_torch": (
            LayerNormNet,
            fasttorch.optim.from_torch(torch.optim.AdamW, lr=LR),
            lambda s: s,
            mse,
            "fp32",
        ),
        "sgd_many_tensors": (
            Deep,
            fasttorch.optim.sgd(LR, momentum=0.9),
            lambda s: s,
            mse,
            "fp32",
        ),
        "batchnorm": (BatchNormNet, opt, lambda s: s, mse, "fp32"),
    }
    return cases[name]


GRAPH_CASES = [
    "whole",
    "accumulate",
    "across_calls",
    "aux_accumulate",
    "ema_nonfinite",
    "fp16_loss_scale",
    "schedule",
    "from_torch",
    "sgd_many_tensors",
    "batchnorm",
]


def _graph_step(name: str, device: str, mode: str):
    make_model, opt, wrap, loss_fn, precision = _graph_case(name, device)
    step = fasttorch.step(loss_fn)
    if precision != "fp32":
        step = fasttorch.with_amp(step, precision)
    step = wrap(step)
    if mode == "aot_eager":
        step = fasttorch.compiled(step, backend="aot_eager")
    elif mode == "reduce-overhead":
        step = fasttorch.compiled(step, mode="reduce-overhead")
    else:
        step = fasttorch.compiled(step)
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(make_model().to(device), opt)
    return step, state


def run_guarded(step, state, data, *, device: str, between=None):
    """Run ``step`` over ``data``; after the warm-up calls every call runs with host
    syncs refused (on CUDA: ``torch.cuda.set_sync_debug_mode("error")``). Returns the
    final state and the metrics of every call, all kept to the end (as a logger would)."""
    from fasttorch.testing import forbid_host_sync

    kept = []
    for i, b in enumerate(data):
        if between is not None and i > 0:
            state = between(state)
        if i < WARMUP:
            state, m = step(state, b)
        else:
            with forbid_host_sync(device):
                state, m = step(state, b)
        kept.append(m)
    return state, kept


def graph_counters() -> dict[str, int]:
    """CUDA graphs skipped and recompiles so far in this process (zeroed per test)."""
    from fasttorch import _compat

    counters = _compat.dynamo_counters()
    return {
        "cudagraph_skips": _compat.cudagraph_skips(),
        "recompiles": sum(counters["recompiles"].values()),
    }


def check_graph_case(name: str, device: str, mode: str, reference_mode: str) -> None:
    """The case under ``mode`` captures everything and equals ``reference_mode`` exactly."""
    data = _batches(device, rows=24)
    step, state = _graph_step(name, device, mode)
    state, kept = run_guarded(step, state, data, device=device)
    assert graph_counters() == {"cudagraph_skips": 0, "recompiles": 0}
    losses = [float(m["loss"]) for m in kept]  # read after later calls: still valid
    ref_step, ref_state = _graph_step(name, device, reference_mode)
    ref_losses = []
    for b in data:
        ref_state, m = ref_step(ref_state, b)
        ref_losses.append(float(m["loss"]))
        if "aux" in m:
            assert torch.equal(m["aux"]["mean_out"], kept[len(ref_losses) - 1]["aux"]["mean_out"])
    assert losses == ref_losses
    for k, p in state.params.items():
        assert torch.equal(p, ref_state.params[k]), k
    for k, b in state.buffers.items():
        assert torch.equal(b, ref_state.buffers[k]), k


@pytest.mark.gpu
@pytest.mark.parametrize("name", GRAPH_CASES)
def test_reduce_overhead_captures_every_graph(name):
    check_graph_case(name, "cuda", "reduce-overhead", "compiled")


@pytest.mark.parametrize("name", ["accumulate", "aux_accumulate"])
def test_graph_harness_on_cpu(name):
    """The same harness on the CPU: no recompile, no host read, metrics kept valid."""
    check_graph_case(name, "cpu", "aot_eager", "aot_eager")


@pytest.mark.gpu
def test_logger_and_set_hyperparams_under_reduce_overhead():
    """A Logger keeps losses across calls; lr set in place between calls never re-records."""
    from fasttorch.loop import Logger
    from fasttorch.optim import set_hyperparams

    logged = []
    log = Logger(3, sink=lambda i, m: logged.append(m))
    step, state = _graph_step("accumulate", "cuda", "reduce-overhead")
    data = _batches("cuda", rows=24)

    def lower_lr(s):
        return s.replace(opt_state=set_hyperparams(s.opt_state, lr=LR / 2, in_place=True))

    losses = []
    for i, b in enumerate(data):
        if i > 0:
            state = lower_lr(state)
        state, m = step(state, b)
        log(i, m)  # keeps the loss tensor until the next logging step
        losses.append(float(m["loss"]))
    # A float32 sum of 3 and a division (as tests/test_loop.py bounds the same average).
    assert logged[-1]["loss_avg"] == pytest.approx(sum(losses[3:]) / 3, rel=2 * gamma(3), abs=0)
    assert graph_counters() == {"cudagraph_skips": 0, "recompiles": 0}


def test_many_tensor_model_is_big_enough():
    assert len(list(Deep().parameters())) >= 100


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 32])
def test_regions_with_inductor_on_cuda_train_as_the_hand_written_loop(rows):
    """The check behind ``_regions.CUDA_AUTO``: ``compiled(regions=True)`` with inductor
    on CUDA (with the alias pass, buffer reuse and in-place buffers on, as fasttorch
    compiles a graph with regions) trains the inductor regions test's model (both kinds
    of block) as the loop does, at batch sizes other than its width (16), where the CPU
    computed wrong gradients with either on before the pass; rule 2."""
    from reference import assert_params_close, batches, reference_run
    from test_regions import TwoKinds
    from tolerance import params_atol, reference_error

    from fasttorch._compile import regions as _regions

    if _regions.unavailable() is not None:
        pytest.skip(_regions.unavailable())
    torch.manual_seed(0)
    model = TwoKinds().cuda()
    data = [tuple(t.cuda() for t in b) for b in batches(2, rows)]
    step = fasttorch.compiled(fasttorch.step(mse), regions=True)
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), fasttorch.optim.adamw(LR, weight_decay=0.1)
    )
    for b in data:
        state, _ = step(state, b)
    blocks = _regions._CACHE.get(state.module)
    assert blocks is not None and blocks.count == 4  # both groups ran as regions

    def adamw(params):
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)

    windows = [[b] for b in data]
    ref, _ = reference_run(model, windows, make_opt=adamw)
    error = reference_error(model, windows, make_opt=adamw)
    assert_params_close(state, ref, rtol=0, atol=params_atol(error.params, state.params))
