"""several: steps over several models equal the loops people write by hand.

The GAN of the guide (D from real and G(z).detach(), then G through the current D with
D's parameters switched off), distillation from a frozen teacher, and one model with two
optimizers, each against the hand loop on deep copies, eager and compiled.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from tolerance import EXACT, FACTOR, params_atol, unit_roundoff
from torch import nn

import fasttorch
from fasttorch import _compat, optim

counters = torch._dynamo.utils.counters
bce = nn.functional.binary_cross_entropy_with_logits
LR = 1e-2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def gan_models(seed: int = 0, *, batchnorm: bool = True) -> tuple[nn.Module, nn.Module]:
    """A tiny generator and discriminator, each with BatchNorm (buffers in both states).

    No bias before a BatchNorm, and a Tanh between G's output and D's BatchNorm: a
    parameter whose true gradient is (nearly) zero turns rounding noise into lr-sized
    Adam steps. ``batchnorm=False`` for half precision under ``compiled`` over more than
    one window: a half-precision rounding that flips between the graphs and eager
    (rule 4) grows through BatchNorm's batch statistics in the next window
    (test_half_precision_gan_with_batchnorm_compiled checks one window with them).
    """
    torch.manual_seed(seed)

    def norm() -> list[nn.Module]:
        return [nn.BatchNorm1d(8)] if batchnorm else []

    g = nn.Sequential(nn.Linear(3, 8, bias=not batchnorm), *norm(), nn.ReLU(), nn.Linear(8, 4))
    d = nn.Sequential(
        nn.Linear(4, 8),
        nn.Tanh(),
        nn.Linear(8, 8, bias=not batchnorm),
        *norm(),
        nn.LeakyReLU(0.2),
        nn.Linear(8, 1),
    )
    return d, g


def gan_calls(k: int, size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 4, generator=gen), torch.randn(size, 3, generator=gen)) for _ in range(k)
    ]


def d_objective(d: Callable[..., torch.Tensor], real: torch.Tensor, fake: torch.Tensor) -> Any:
    on_real, on_fake = d(real).to(real.dtype), d(fake).to(real.dtype)
    return bce(on_real, torch.ones_like(on_real)) + bce(on_fake, torch.zeros_like(on_fake))


def g_objective(d_of_fake: torch.Tensor, dtype: torch.dtype) -> Any:
    out = d_of_fake.to(dtype)
    return bce(out, torch.ones_like(out))


def d_loss(apply: Any, batch: Any, models: Any) -> Any:
    real, z = batch
    return d_objective(apply, real, models["g"](z).detach())


def g_loss(apply: Any, batch: Any, models: Any) -> Any:
    real, z = batch
    return g_objective(models["d"](apply(z)), real.dtype)


# --------------------------------------------------------------------------- the hand loop


def hand_gan(
    d: nn.Module,
    g: nn.Module,
    calls: Sequence[Any],
    *,
    n: int = 1,
    precision: str = "fp32",
    clip: float | None = None,
    dtype: torch.dtype = torch.float32,
    scalers: list[Any] | None = None,
) -> tuple[nn.Module, nn.Module, list[tuple[float, float]]]:
    """The guide's loop on deep copies: each call is one microbatch of both models; on the
    window's last, D steps, then G's loss goes through the updated D. ``scalers``: given
    an empty list, one ``GradScaler`` shared by both optimizers (``update()`` once, after
    both steps) is used and appended to it."""
    d, g = copy.deepcopy(d).to(dtype), copy.deepcopy(g).to(dtype)
    d_opt = torch.optim.Adam(d.parameters(), lr=LR)
    g_opt = torch.optim.Adam(g.parameters(), lr=LR)
    fp16 = precision == "fp16"
    d_scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    g_scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    shared = scalers is not None
    if shared:
        g_scaler = d_scaler
        scalers.append(d_scaler)
    half = DTYPES.get(precision, torch.float32)
    log = []
    for i, (real, z) in enumerate(calls):
        real, z = real.to(dtype), z.to(dtype)
        last = (i + 1) % n == 0
        with torch.autocast("cpu", dtype=half, enabled=precision != "fp32"):
            ld = d_objective(d, real, g(z).detach())
        d_scaler.scale(ld / n).backward()
        if last:
            _opt_step(d, d_opt, d_scaler, clip, update=not shared)
        for p in d.parameters():  # toggle_model: D's parameters take no gradient
            p.requires_grad_(False)
        with torch.autocast("cpu", dtype=half, enabled=precision != "fp32"):
            lg = g_objective(d(g(z)), real.dtype)
        g_scaler.scale(lg / n).backward()
        for p in d.parameters():
            p.requires_grad_(True)
        if last:
            _opt_step(g, g_opt, g_scaler, clip)
        log.append((float(ld.detach()), float(lg.detach())))
    return d, g, log


def _opt_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any,
    clip: float | None,
    *,
    update: bool = True,
) -> None:
    scaler.unscale_(opt)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    if update:
        scaler.update()
    opt.zero_grad(set_to_none=True)


def gan_step(
    *,
    n: int = 1,
    precision: str = "fp32",
    clip: float | None = None,
    compile: bool = False,
    donate: bool = True,
    wrap: Callable[[fasttorch.Step], fasttorch.Step] = lambda s: s,
) -> fasttorch.Several:
    def member(loss_fn: Any) -> fasttorch.Step:
        s = fasttorch.model_step(loss_fn, donate=donate)
        if precision != "fp32":
            s = fasttorch.with_amp(s, precision)
        s = fasttorch.grad_accumulate(s, n, across_calls=True)
        if clip is not None:
            s = fasttorch.clip_scaled(s, clip)
        return wrap(s)

    step = fasttorch.several({"d": member(d_loss), "g": member(g_loss)})
    return fasttorch.compiled(step, backend="aot_eager") if compile else step


def gan_state(d: nn.Module, g: nn.Module, opaque: bool = True) -> fasttorch.Models:
    return fasttorch.Models.create(
        d=fasttorch.TrainState.create(copy.deepcopy(d), optim.adam(LR, opaque=opaque)),
        g=fasttorch.TrainState.create(copy.deepcopy(g), optim.adam(LR, opaque=opaque)),
    )


def loop_error(d: nn.Module, g: nn.Module, calls: Sequence[Any], **kw: Any) -> dict[str, float]:
    """Rule 2: each tensor's error of the fp32 hand loop against the same loop in float64
    (and, under "loss", the largest error of a logged loss)."""
    d32, g32, log32 = hand_gan(d, g, calls, **kw)
    d64, g64, log64 = hand_gan(d, g, calls, dtype=torch.float64, **kw)
    out = {"loss": float((torch.tensor(log32).double() - torch.tensor(log64)).abs().max())}
    for tag, a, b in (("d", d32, d64), ("g", g32, g64)):
        for k, v in a.state_dict().items():
            if v.is_floating_point():
                out[f"{tag}.{k}"] = float((v.double() - b.state_dict()[k]).abs().max())
    return out


def assert_matches(
    state: fasttorch.Models, d: nn.Module, g: nn.Module, atol: float, rtol: float = 0.0
) -> None:
    for tag, ref in (("d", d), ("g", g)):
        member = state[tag]
        assert isinstance(member, fasttorch.TrainState)
        ours = {**member.params, **member.buffers}
        for k, v in ref.state_dict().items():
            bound = atol if v.is_floating_point() else 0.0
            torch.testing.assert_close(
                ours[k], v, rtol=rtol, atol=bound, msg=lambda m, k=k, tag=tag: f"{tag}.{k}: {m}"
            )


def _tensors(state: fasttorch.Models) -> dict[str, torch.Tensor]:
    out = {}
    for tag, m in state.members.items():
        if isinstance(m, fasttorch.TrainState):
            out.update({f"{tag}.{k}": v for k, v in {**m.params, **m.buffers}.items()})
    return out


# --------------------------------------------------------------------------- (a) the GAN


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("donate", [True, False], ids=["donated", "copying"])
def test_gan_equals_the_hand_loop(compile: bool, donate: bool) -> None:
    # Before torch 2.12 a compiled member cannot update another's BatchNorm statistics
    # (test_batchnorm_of_the_other_model_under_compiled): compare models without them.
    batchnorm = not (compile and not _compat.AUTOGRAD_GRAD_IN_GRAPH)
    d, g = gan_models(batchnorm=batchnorm)
    calls = gan_calls(4)
    ref_d, ref_g, log = hand_gan(d, g, calls)
    state = gan_state(d, g)
    step = gan_step(compile=compile, donate=donate)
    losses = []
    for b in calls:
        before = state
        state, metrics = step(state, b)
        losses.append((float(metrics["d"]["loss"]), float(metrics["g"]["loss"])))
        if donate:
            with pytest.raises(fasttorch.DonatedStateError, match="donated"):
                _ = before.members
        else:
            assert before["d"].params["0.weight"] is not state["d"].params["0.weight"]
    errors = loop_error(d, g, calls)
    loss_error = errors.pop("loss")
    assert_matches(state, ref_d, ref_g, params_atol(errors, _tensors(state)))
    # Rule 2 for the losses (FACTOR x the loop's own error, floor one rounding).
    bound = FACTOR * max(loss_error, unit_roundoff(torch.float32) * max(map(max, log)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(log), rtol=0, atol=bound)
    assert int(state["d"].step) == int(state["g"].step) == 4
    if batchnorm:  # D's BatchNorm saw its three forwards of each call (two in its loss)
        assert int(state["d"].buffers["3.num_batches_tracked"]) == 3 * 4
    if compile:
        assert counters["stats"]["unique_graphs"] == 2  # one graph per member
        assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]


def test_copying_step_leaves_the_input_state_untouched() -> None:
    d, g = gan_models()
    state = gan_state(d, g)
    copies = {k: v.clone() for k, v in _tensors(state).items()}
    step = gan_step(donate=False)
    new, _ = step(state, gan_calls(1)[0])
    for k, v in _tensors(state).items():
        torch.testing.assert_close(v, copies[k], **EXACT)
    assert any(not torch.equal(v, copies[k]) for k, v in _tensors(new).items())


def test_the_generator_step_trains_no_discriminator_parameter() -> None:
    """G's loss reaches D's forward, but D's parameters get no gradient and no update."""
    d, g = gan_models()
    state = gan_state(d, g)
    only_g = fasttorch.several({"g": fasttorch.model_step(g_loss)})
    frozen_d = fasttorch.Models.create(d=fasttorch.Frozen.create(copy.deepcopy(d)), g=state["g"])
    before = {k: v.clone() for k, v in frozen_d["d"].tensors.items()}
    new, metrics = only_g(frozen_d, gan_calls(1)[0])
    for k, v in new["d"].tensors.items():
        torch.testing.assert_close(v, before[k], **EXACT)
    assert float(metrics["g"]["grad_norm"]) > 0


# --------------------------------------------------------------------------- (b) transforms


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_guides_loop_accumulating_over_two_calls(compile: bool) -> None:
    d, g = gan_models(batchnorm=not (compile and not _compat.AUTOGRAD_GRAD_IN_GRAPH))
    calls = gan_calls(6)
    ref_d, ref_g, _ = hand_gan(d, g, calls, n=2, clip=0.5)
    state = gan_state(d, g)
    step = gan_step(n=2, clip=0.5, compile=compile)
    updates = []
    for b in calls:
        state, metrics = step(state, b)
        updates.append(sorted(metrics["d"]))
    # Between a window's ends a call only accumulates: its metrics are its loss.
    assert updates[0] == ["loss"] and "grad_norm" in updates[1]
    errors = loop_error(d, g, calls, n=2, clip=0.5)
    errors.pop("loss")
    atol = params_atol(errors, _tensors(state))
    assert_matches(state, ref_d, ref_g, atol)
    assert int(state["g"].step) == 3
    if compile:
        assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_mixed_precision_one_loss_scale_per_optimizer(precision: str, compile: bool) -> None:
    d, g = gan_models(batchnorm=False)
    calls = gan_calls(4)
    ref_d, ref_g, _ = hand_gan(d, g, calls, n=2, precision=precision)
    state = gan_state(d, g)
    step = gan_step(n=2, precision=precision, compile=compile)
    for b in calls:
        state, metrics = step(state, b)
    if precision == "fp16":
        assert "loss_scale" in metrics["d"] and "loss_scale" in metrics["g"]
        assert state["d"].substates["amp"] is not state["g"].substates["amp"]
    # Rule 4 over the two updates; G's chain runs through D's half-precision forward
    # too, so two half roundings may flip along it.
    if compile:
        assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]
    errors = loop_error(d, g, calls, n=2)
    errors.pop("loss")
    atol = params_atol(
        errors, _tensors(state), precision=precision, steps=2, lr=LR, half_roundings=2
    )
    assert_matches(state, ref_d, ref_g, atol)


def test_skip_nonfinite_and_ema_of_the_generator() -> None:
    d, g = gan_models()
    calls = gan_calls(3)
    inf_call = (calls[1][0], torch.full_like(calls[1][1], float("inf")))
    state = gan_state(d, g)
    steps = {
        "d": fasttorch.skip_nonfinite(fasttorch.model_step(d_loss)),
        "g": fasttorch.ema(fasttorch.skip_nonfinite(fasttorch.model_step(g_loss)), 0.5),
    }
    step = fasttorch.several(steps)
    state, _ = step(state, calls[0])
    g_after_one = {k: v.clone() for k, v in state["g"].params.items()}
    ema_after_one = {k: v.clone() for k, v in state["g"].substates["ema"].params.items()}
    state, metrics = step(state, inf_call)
    assert bool(metrics["d"]["skipped"]) and bool(metrics["g"]["skipped"])
    for k, v in state["g"].params.items():
        torch.testing.assert_close(v, g_after_one[k], **EXACT)
    for k, v in state["g"].substates["ema"].params.items():
        torch.testing.assert_close(v, ema_after_one[k], **EXACT)
    state, metrics = step(state, calls[2])
    assert not bool(metrics["g"]["skipped"])
    # The average after the finite update: lerp of the previous average to the params.
    for k, v in state["g"].substates["ema"].params.items():
        want = torch.lerp(ema_after_one[k], state["g"].params[k], 0.5)
        torch.testing.assert_close(v, want, **EXACT)  # the same lerp kernel


# --------------------------------------------------------------------------- distillation


class Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.inp(x)))))


def kd_objective(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor, t: float = 2.0
) -> torch.Tensor:
    wide = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    s, te = student_logits.to(wide), teacher_logits.to(wide)
    kl = nn.functional.kl_div(
        nn.functional.log_softmax(s / t, -1),
        nn.functional.log_softmax(te / t, -1),
        log_target=True,
        reduction="batchmean",
    )
    return 0.5 * kl * t * t + 0.5 * nn.functional.cross_entropy(s, y)


def kd_hand(
    teacher: nn.Module,
    student: nn.Module,
    calls: Sequence[Any],
    *,
    precision: str = "fp32",
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The hand loop: teacher.eval() and requires_grad_(False), autocast, window of 2
    (fp16: a GradScaler)."""
    t_ref = copy.deepcopy(teacher).to(dtype).eval().requires_grad_(False)
    s_ref = copy.deepcopy(student).to(dtype)
    opt = torch.optim.Adam(s_ref.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    half = DTYPES.get(precision, torch.float32)
    for i, (x, y) in enumerate(calls):
        x = x.to(dtype)
        with torch.autocast("cpu", dtype=half, enabled=precision != "fp32"):
            with torch.no_grad():
                tl = t_ref(x)
            loss = kd_objective(s_ref(x), tl, y)
        scaler.scale(loss / 2).backward()
        if i % 2 == 1:
            scaler.step(opt)  # opt.step() when disabled
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return s_ref


def kd_loss(apply: Any, batch: Any, models: Any) -> Any:
    x, y = batch
    with torch.no_grad():
        teacher_logits = models["teacher"](x)
    return kd_objective(apply(x), teacher_logits, y)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_distillation_from_a_frozen_teacher(compile: bool) -> None:
    torch.manual_seed(3)
    teacher = Teacher()
    teacher.train()(torch.randn(32, 6))  # non-trivial running statistics
    student = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 5))
    gen = torch.Generator().manual_seed(4)
    calls = [
        (torch.randn(8, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen))
        for _ in range(4)
    ]

    s_ref = kd_hand(teacher, student, calls, precision="bf16")

    t_mod = copy.deepcopy(teacher)
    frozen = fasttorch.Frozen.create(t_mod)
    before = {k: v.clone() for k, v in frozen.tensors.items()}
    state = fasttorch.Models.create(
        student=fasttorch.TrainState.create(copy.deepcopy(student), optim.adam(LR)), teacher=frozen
    )
    s = fasttorch.grad_accumulate(
        fasttorch.with_amp(fasttorch.model_step(kd_loss), "bf16"), 2, across_calls=True
    )
    step = fasttorch.several({"student": s})
    if compile:
        step = fasttorch.compiled(step, backend="aot_eager")
    for b in calls:
        state, metrics = step(state, b)
    assert set(metrics) == {"student"}
    # The teacher: in eval mode, its tensors (BatchNorm statistics included) untouched,
    # no gradient and no optimizer state anywhere.
    assert not t_mod.training
    assert state["teacher"] is frozen
    for k, v in frozen.tensors.items():
        torch.testing.assert_close(v, before[k], **EXACT)
        assert v.grad is None and not v.requires_grad
    assert all(p.grad is None for p in t_mod.parameters())
    ours = state["student"]
    assert isinstance(ours, fasttorch.TrainState)
    # The same autocast kernels on both sides: rule 4 over the two updates, on rule 2's
    # error of the fp32 hand loop against float64.
    s32 = kd_hand(teacher, student, calls)
    s64 = kd_hand(teacher, student, calls, dtype=torch.float64)
    errors = {
        k: float((p.detach().double() - dict(s64.named_parameters())[k]).abs().max())
        for k, p in s32.named_parameters()
    }
    atol = params_atol(errors, ours.params, precision="bf16", steps=2, lr=LR)
    for k, p in s_ref.named_parameters():
        torch.testing.assert_close(ours.params[k], p.detach(), rtol=0, atol=atol)


def _kd_calls(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    return [
        (torch.randn(8, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen))
        for _ in range(k)
    ]


def _states_and_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_member_matches(member: Any, ref: nn.Module, atol: float) -> None:
    """Parameters and buffers (BatchNorm's running statistics and batch count)."""
    ours = {**member.params, **member.buffers}
    for k, v in _states_and_buffers(ref).items():
        bound = atol if v.is_floating_point() else 0.0
        torch.testing.assert_close(ours[k], v, rtol=0, atol=bound, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_student_with_batchnorm_compiled(precision: str) -> None:
    """A trained member with BatchNorm, its statistics updated by its own step only, in
    bf16 and fp16 (a GradScaler) under compiled: parameters and running statistics as
    the hand loop's. On every supported torch (no other model's BatchNorm is updated)."""
    torch.manual_seed(3)
    teacher = Teacher()
    teacher.train()(torch.randn(32, 6))
    student = nn.Sequential(
        nn.Linear(6, 12, bias=False), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 5)
    )
    calls = _kd_calls(4)
    s_ref = kd_hand(teacher, student, calls, precision=precision)
    state = fasttorch.Models.create(
        student=fasttorch.TrainState.create(copy.deepcopy(student), optim.adam(LR)),
        teacher=fasttorch.Frozen.create(copy.deepcopy(teacher)),
    )
    s = fasttorch.with_amp(fasttorch.model_step(kd_loss), precision)
    s = fasttorch.grad_accumulate(s, 2, across_calls=True)
    step = fasttorch.compiled(fasttorch.several({"student": s}), backend="aot_eager")
    for b in calls:
        state, metrics = step(state, b)
    assert ("loss_scale" in metrics["student"]) == (precision == "fp16")
    assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]
    ours = state["student"]
    assert int(ours.buffers["1.num_batches_tracked"]) == 4  # one forward per call
    s32 = _states_and_buffers(kd_hand(teacher, student, calls))
    s64 = _states_and_buffers(kd_hand(teacher, student, calls, dtype=torch.float64))
    errors = {
        k: float((v.double() - s64[k]).abs().max()) for k, v in s32.items() if v.is_floating_point()
    }
    # Rule 4 over the two updates, on rule 2's error of the fp32 loop (buffers included).
    atol = params_atol(errors, {**ours.params, **ours.buffers}, precision=precision, steps=2, lr=LR)
    _assert_member_matches(ours, s_ref, atol)


@pytest.mark.skipif(
    not _compat.AUTOGRAD_GRAD_IN_GRAPH,
    reason="before torch 2.12 a compiled member does not update the other model's "
    "BatchNorm statistics (it warns: test_batchnorm_of_the_other_model_under_compiled)",
)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_gan_with_batchnorm_compiled(precision: str) -> None:
    """The guide's GAN, BatchNorm in both models, bf16 and fp16 (a GradScaler each) under
    compiled: one window of two calls, parameters and running statistics as the hand
    loop's. One window: the update a rounding flip moves by rule 4's ``lr * u`` then
    changes the next window's BatchNorm batch statistics (8 samples), and rule 4 bounds
    one update's flips, not their growth through a later window's normalization."""
    d, g = gan_models(batchnorm=True)
    calls = gan_calls(2)
    ref_d, ref_g, _ = hand_gan(d, g, calls, n=2, precision=precision)
    state = gan_state(d, g)
    step = gan_step(n=2, precision=precision, compile=True)
    for b in calls:
        state, _ = step(state, b)
    assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]
    # D's BatchNorm saw three forwards a call (real and fake in its loss, G's loss
    # through it), G's two (D's loss reads G(z), then its own).
    assert int(state["d"].buffers["3.num_batches_tracked"]) == 3 * 2
    assert int(state["g"].buffers["1.num_batches_tracked"]) == 2 * 2
    errors = loop_error(d, g, calls, n=2)
    errors.pop("loss")
    atol = params_atol(
        errors, _tensors(state), precision=precision, steps=1, lr=LR, half_roundings=2
    )
    assert_matches(state, ref_d, ref_g, atol)  # parameters and buffers


# --------------------------------------------------------------------------- two optimizers


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 16)
        self.actor = nn.Linear(16, 3)
        self.critic = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.actor(h), self.critic(h).squeeze(-1)


def ac_objective(out: tuple[torch.Tensor, torch.Tensor], batch: Any) -> torch.Tensor:
    logits, value = out
    x, action, ret = batch
    adv = (ret - value).detach()
    logp = nn.functional.log_softmax(logits, -1).gather(1, action[:, None]).squeeze(1)
    return -(logp * adv).mean() + 0.5 * nn.functional.mse_loss(value, ret)


def ac_hand(model: nn.Module, data: Sequence[Any], dtype: torch.dtype = torch.float32) -> nn.Module:
    """Two torch.optim.Adam over two parameter sets, the critic's stepping every 3 steps."""
    ref = copy.deepcopy(model).to(dtype)
    critic = [p for n, p in ref.named_parameters() if n.startswith("critic.")]
    rest = [p for n, p in ref.named_parameters() if not n.startswith("critic.")]
    actor_opt = torch.optim.Adam(rest, lr=LR)
    critic_opt = torch.optim.Adam(critic, lr=3 * LR)
    for i, b in enumerate(data):
        b = (b[0].to(dtype), b[1], b[2].to(dtype))
        ac_objective(ref(b[0]), b).backward()
        actor_opt.step()
        if (i + 1) % 3 == 0:
            critic_opt.step()
        actor_opt.zero_grad(set_to_none=True)
        critic_opt.zero_grad(set_to_none=True)
    return ref


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_one_model_two_optimizers_the_second_every_3_steps(compile: bool) -> None:
    torch.manual_seed(5)
    model = ActorCritic()
    gen = torch.Generator().manual_seed(6)
    data = [
        (
            torch.randn(8, 4, generator=gen),
            torch.randint(0, 3, (8,), generator=gen),
            torch.randn(8, generator=gen),
        )
        for _ in range(7)
    ]
    ref = ac_hand(model, data)

    critic_params = re.compile(r"^critic\.")
    opt = optim.groups(optim.adam(LR), [(critic_params, optim.every(optim.adam(3 * LR), 3))])
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    step = fasttorch.step(lambda apply, b: ac_objective(apply(b[0]), b))
    if compile:
        step = fasttorch.compiled(step, backend="aot_eager")
    critic_before = state.params["critic.weight"].clone()
    for i, b in enumerate(data):
        state, _ = step(state, b)
        if i == 1:  # two steps in: the critic has not moved
            torch.testing.assert_close(state.params["critic.weight"], critic_before, **EXACT)
    ref64 = dict(ac_hand(model, data, dtype=torch.float64).named_parameters())
    errors = {
        k: float((p.detach().double() - ref64[k]).abs().max()) for k, p in ref.named_parameters()
    }
    atol = params_atol(errors, state.params)  # rule 2
    for k, p in ref.named_parameters():
        torch.testing.assert_close(state.params[k], p.detach(), rtol=0, atol=atol)
    if compile:
        assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]


def _counting_backend() -> tuple[Any, list[torch.fx.GraphModule], list[torch.fx.GraphModule]]:
    """aot_eager that records each forward and backward graph AOTAutograd compiles."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    forward: list[torch.fx.GraphModule] = []
    backward: list[torch.fx.GraphModule] = []

    def recorder(into: list[torch.fx.GraphModule]) -> Any:
        def record(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
            into.append(gm)
            return make_boxed_func(gm.forward)

        return record

    backend = aot_autograd(
        fw_compiler=recorder(forward),
        bw_compiler=recorder(backward),
        keep_inference_input_mutations=True,
    )
    return backend, forward, backward


@pytest.mark.parametrize(
    ("n", "precision", "clip", "opaque", "per_call"),
    [
        (1, "fp32", None, False, [2] * 6),
        (2, "fp16", 1.0, False, [2] + [4] * 5),
        (1, "fp32", None, True, [2] * 6),
        (2, "fp16", 1.0, True, [2] * 6),
    ],
    ids=[
        "one_call_per_update",
        "guides_loop_accumulating",
        "one_call_per_update_fused",
        "guides_loop_accumulating_fused",
    ],
)
def test_compiled_gan_graph_count(
    n: int, precision: str, clip: float | None, opaque: bool, per_call: list[int]
) -> None:
    """compiled(several(...)) compiles each member's step on its own: one graph per
    member without accumulation (the whole step, backward inside); with accumulation
    across calls, two per member (the microbatch, compiled on the first call, and the
    window's update, on the window's last). With Adam's default on a CPU (``opaque``:
    torch's fused kernel) the update runs outside the graphs: one graph per member,
    the gradients' or the microbatch's. No backward graph, no recompile over three
    windows."""
    backend, forward, backward = _counting_backend()
    d, g = gan_models(batchnorm=False)
    state = gan_state(d, g, opaque)
    fast = fasttorch.compiled(gan_step(n=n, precision=precision, clip=clip), backend=backend)
    counts = []
    for b in gan_calls(6):
        state, _ = fast(state, b)
        counts.append(len(forward))
    assert counts == per_call
    assert not backward  # the gradient is computed inside each graph
    assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]
    assert int(state["g"].step) == 6 // n


# --------------------------------------------------------------------------- errors


def test_wrap_time_errors() -> None:
    d_step = fasttorch.model_step(d_loss)
    with pytest.raises(TypeError, match="mapping of member names"):
        fasttorch.several([d_step])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        fasttorch.several({})
    with pytest.raises(TypeError, match="not a fasttorch step"):
        fasttorch.several({"d": lambda s, b: (s, {})})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="same step object"):
        fasttorch.several({"d": d_step, "g": d_step})
    with pytest.raises(ValueError, match="disagree on donation"):
        fasttorch.several({"d": d_step, "g": fasttorch.model_step(g_loss, donate=False)})
    bf16 = fasttorch.with_amp(fasttorch.model_step(g_loss), "bf16")
    with pytest.raises(ValueError, match=r"share_loss_scale=True, but the steps of \['g'\]"):
        fasttorch.several({"g": bf16}, share_loss_scale=True)
    with pytest.raises(TypeError, match=r"models\)"):
        fasttorch.model_step(lambda apply, batch: apply(batch).sum())
    # A transform over the whole says to wrap each member's step instead.
    whole = fasttorch.several({"d": d_step})
    for wrap in (
        lambda s: fasttorch.with_amp(s, "bf16"),
        lambda s: fasttorch.grad_accumulate(s, 2),
        lambda s: fasttorch.clip_scaled(s, 1.0),
    ):
        with pytest.raises(TypeError, match=r"apply it to each member's step before several"):
            wrap(whole)
    compiled = fasttorch.compiled(fasttorch.several({"d": d_step}), backend="aot_eager")
    with pytest.raises(ValueError, match="already applied"):
        fasttorch.compiled(compiled, backend="aot_eager")
    with pytest.raises(TypeError, match="either|TrainState"):
        fasttorch.Models.create(d=torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nothing trains"):
        fasttorch.Models.create(t=fasttorch.Frozen.create(torch.nn.Linear(2, 2)))
    shared = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="share one module"):
        fasttorch.Models.create(
            a=fasttorch.TrainState.create(shared, optim.sgd(0.1)),
            b=fasttorch.Frozen.create(shared),
        )


def test_call_time_errors_name_the_members() -> None:
    d, g = gan_models()
    state = gan_state(d, g)
    batch = gan_calls(1)[0]
    with pytest.raises(ValueError, match=r"step for member 'x'.*\['d', 'g'\]"):
        fasttorch.several({"d": fasttorch.model_step(d_loss), "x": fasttorch.model_step(g_loss)})(
            state, batch
        )
    with pytest.raises(ValueError, match=r"\['g'\] are TrainStates that no step trains"):
        fasttorch.several({"d": fasttorch.model_step(d_loss)})(state, batch)
    with pytest.raises(TypeError, match="fasttorch.Models"):
        fasttorch.several({"d": fasttorch.model_step(d_loss)})(state["d"], batch)  # type: ignore[arg-type]

    def wrong(apply: Any, batch: Any, models: Any) -> Any:
        return apply(models["generator"](batch[1])).mean()

    step = fasttorch.several(
        {
            "d": fasttorch.model_step(wrong, donate=False),
            "g": fasttorch.model_step(g_loss, donate=False),
        }
    )
    with pytest.raises(KeyError, match=r"models\['generator'\].*\['g'\]"):
        step(state, batch)
    # Compiled, the same error, not the compiler's "observed exception".
    fast = fasttorch.compiled(
        fasttorch.several({"d": fasttorch.model_step(wrong), "g": fasttorch.model_step(g_loss)}),
        backend="aot_eager",
    )
    with pytest.raises(KeyError, match=r"models\['generator'\].*\['g'\]"):
        fast(gan_state(d, g), batch)
    with pytest.raises(ValueError, match="inside fasttorch.several"):
        fasttorch.model_step(d_loss)(state["d"], batch)


def test_frozen_module_put_back_in_eval_mode_and_no_silent_recompile() -> None:
    torch.manual_seed(0)
    teacher = Teacher()
    state = fasttorch.Models.create(
        student=fasttorch.TrainState.create(nn.Linear(6, 5), optim.sgd(0.1)),
        teacher=fasttorch.Frozen.create(teacher),
    )
    step = fasttorch.compiled(
        fasttorch.several({"student": fasttorch.model_step(kd_loss)}), backend="aot_eager"
    )
    batch = (torch.randn(8, 6), torch.randint(0, 5, (8,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fasttorch.RecompileWarning)
        for _ in range(3):
            teacher.train()  # a user's slip: the step runs the teacher in eval mode anyway
            state, _ = step(state, batch)
    assert not teacher.training


def test_batchnorm_of_the_other_model_under_compiled() -> None:
    """From torch 2.12 the compiled step updates the other model's BatchNorm statistics
    in its forward, as eager does; before, torch.func.grad cannot, and it says so once."""
    d, g = gan_models()
    calls = gan_calls(2)
    eager, fast = gan_state(d, g), gan_state(d, g)
    step, compiled = gan_step(), gan_step(compile=True)
    fasttorch._checks.warn_once.cache_clear()  # said once per process: count from here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in calls:
            eager, _ = step(eager, b)
            fast, _ = compiled(fast, b)
    said = [w for w in caught if "cannot update the buffers" in str(w.message)]
    tracked = int(fast["d"].buffers["3.num_batches_tracked"])
    if _compat.AUTOGRAD_GRAD_IN_GRAPH:
        assert not said and tracked == int(eager["d"].buffers["3.num_batches_tracked"]) == 6
    else:
        # Once per member whose loss reads a model with BatchNorm: both, here.
        assert len(said) == 2 and tracked == 4  # D's own two forwards per call only


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_one_loss_scale_shared_by_both_optimizers(compile: bool) -> None:
    """One GradScaler for both: an overflow in D's window halves the scale both use, D
    skips its update and G does not; with a scale each, only D's halves."""
    d, g = gan_models(batchnorm=False)
    calls = gan_calls(6)
    calls[3] = (torch.full_like(calls[3][0], float("inf")), calls[3][1])  # D's loss only
    shared: list[Any] = []
    ref_d, ref_g, _ = hand_gan(d, g, calls, n=2, precision="fp16", scalers=shared)
    assert shared[0].get_scale() == 2.0**15  # the second window backed off once

    def member(loss_fn: Any) -> fasttorch.Step:
        s = fasttorch.with_amp(fasttorch.model_step(loss_fn), "fp16")
        return fasttorch.grad_accumulate(s, 2, across_calls=True)

    one = fasttorch.several({"d": member(d_loss), "g": member(g_loss)}, share_loss_scale=True)
    each = fasttorch.several({"d": member(d_loss), "g": member(g_loss)})
    if compile:
        one = fasttorch.compiled(one, backend="aot_eager")
    state, per = gan_state(d, g), gan_state(d, g)
    for b in calls:
        state, metrics = one(state, b)
        per, _ = each(per, b)
        if "skipped" in metrics["g"]:
            assert not bool(metrics["g"]["skipped"])
    for tag in ("d", "g"):
        assert float(state[tag].substates["amp"].scale) == shared[0].get_scale()
    assert float(per["d"].substates["amp"].scale) == 2.0**15
    assert float(per["g"].substates["amp"].scale) == 2.0**16
    # Params as the hand loop's (rule 4); rule 2's estimate from the fp32 loop over the
    # finite windows (the fp32 loop has no scaler to skip the overflow).
    finite = [c for i, c in enumerate(calls) if i not in (2, 3)]
    errors = loop_error(d, g, finite, n=2)
    errors.pop("loss")
    atol = params_atol(errors, _tensors(state), precision="fp16", steps=3, lr=LR, half_roundings=2)
    assert_matches(state, ref_d, ref_g, atol)


def test_a_call_failing_part_way_consumes_a_donated_state_and_keeps_a_copied_one() -> None:
    """D's step ran (and wrote in place) when G's loss raised: the donated input is dead,
    as a one-model state whose call failed; with donate=False it stays intact."""

    def broken(apply: Any, batch: Any, models: Any) -> Any:
        raise RuntimeError("a bug in the generator's loss")

    d, g = gan_models()
    batch = gan_calls(1)[0]
    for donate in (True, False):
        state = gan_state(d, g)
        before = {k: v.clone() for k, v in _tensors(state).items()}
        step = fasttorch.several(
            {
                "d": fasttorch.model_step(d_loss, donate=donate),
                "g": fasttorch.model_step(broken, donate=donate),
            }
        )
        with pytest.raises(RuntimeError, match="a bug in the generator's loss"):
            step(state, batch)
        if donate:
            with pytest.raises(fasttorch.DonatedStateError, match="failed part-way"):
                _ = state.members
        else:
            for k, v in _tensors(state).items():
                torch.testing.assert_close(v, before[k], **EXACT)
