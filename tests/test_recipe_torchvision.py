"""torchvision's classification recipe, ported at tiny size, against fasttorch's parts.

The plain loop is torchvision's ``references/classification`` (pytorch/vision,
BSD-3-Clause): ``utils.py``'s ``set_weight_decay`` at commit
d3beb52a00e16c71e821e192bcc592d614a490c0 (ported in test_optim_groups.py) and
``ExponentialMovingAverage`` (test_ema.py's ``TorchvisionEMA``); ``train.py``'s ``main``
set-up of the optimizer, the SequentialLR(LinearLR, CosineAnnealingLR) stepped per epoch
and the EMA's ``adjust``/``alpha`` rule as at commit
017e9b99b5daddec3d82d5b05fe26f6834c48fa9, with ``set_weight_decay`` in place of that
commit's ``split_normalization_params``, as later versions have it; and the later
``train_one_epoch`` (autocast around forward and loss, ``scaler.unscale_`` then
``clip_grad_norm_`` in the scaler branch, the EMA every ``model_ema_steps`` with
``n_averaged.fill_(0)`` while ``epoch < lr_warmup_epochs``), which that commit's file
predates in its amp and clipping order. Written as it is there with the data loader,
metric logger and evaluation left out, and the autocast made the
CPU's (torchvision's ``torch.cuda.amp.autocast(enabled=scaler is not None)``): in bf16
without a GradScaler (its ``scaler is None`` branch), in fp16 with one (its other branch,
``scaler.unscale_`` before ``clip_grad_norm_``, ``torch.amp.GradScaler("cpu")``):
a CNN with BatchNorm, ``CrossEntropyLoss(label_smoothing=0.1)``, SGD with momentum
over ``set_weight_decay(model, wd, norm_weight_decay=0.0)``, per-epoch LinearLR warm-up
then CosineAnnealingLR through SequentialLR, ``clip_grad_norm_``, and the EMA
(``AveragedModel(use_buffers=True)``) updated every ``model_ema_steps`` steps with
``n_averaged.fill_(0)`` during the warm-up epochs. 3 epochs x 4 steps.

fasttorch composes the same from its parts: ``optim.groups(optim.sgd(...),
[(optim.in_module(*optim.NORMALIZATION), {"weight_decay": 0.0})])``,
``schedules.per_epoch(schedules.sequential([...]))``, ``with_amp``, ``clip_scaled``,
``ema(..., every=, copy_first=)``, eager and ``compiled(backend="aot_eager")``.

Tolerances (tests/README.md):

* compiled against eager: rule 1 (aot_eager runs the eager step's operations), EXACT.
* fasttorch against the plain loop: rule 2. The two compute the same mathematics in a
  different order: torch's SGD with a Python float lr runs ``p.add_(b, alpha=-lr)`` (one
  fused rounding) where fasttorch runs ``p + b * -lr`` (two, see ``fasttorch.optim.sgd``),
  the lr is torch's recursive float64 scheduler in one and fasttorch's closed form held
  in float32 in the other (one float32 rounding apart, test_schedules.py), torch's
  eager ``clip_grad_norm_`` multiplies by ``max_norm / (norm + 1e-6)`` clamped where
  ``clip_scaled`` folds the same factor, and torchvision's average is
  ``d * a + (1 - d) * m`` where fasttorch's is a lerp. The bound is ``FACTOR`` times the
  plain loop's own float32 error against the same loop run in float64, measured here on
  parameters, BatchNorm buffers, the averages and the losses.
* bf16, fp16: rule 4 added: both sides run the same autocast forward, so a difference is a
  rule 2 difference that flips one half-precision rounding, which moves a step's update by ``u``
  of itself. For SGD the update is not bounded by ``lr`` (tolerance.py's Adam case): the
  largest update the float32 plain loop made to any entry in one step stands in its
  place, per step (the parameters' and, for the running statistics, the buffers').
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
import tolerance
import torch
from test_ema import TorchvisionEMA
from test_optim_groups import torchvision_set_weight_decay
from tolerance import EXACT, FACTOR, LoopError, grad_norm_rtol, loss_atol, params_atol
from torch import nn

import fasttorch
from fasttorch import optim, schedules

counters = torch._dynamo.utils.counters

# torchvision's arguments, at tiny size.
EPOCHS, STEPS_PER_EPOCH, BATCH = 3, 4, 8
LR, MOMENTUM, WEIGHT_DECAY = 0.5, 0.9, 2.0**-8
LABEL_SMOOTHING = 0.1
LR_WARMUP_EPOCHS, LR_WARMUP_DECAY = 1, 0.01
CLIP_GRAD_NORM = 1.0
MODEL_EMA_STEPS, MODEL_EMA_DECAY = 2, 0.9
NUM_CLASSES = 5


class TinyCNN(nn.Module):
    """conv (no bias) -> BatchNorm -> ReLU -> conv -> BatchNorm -> ReLU -> pool -> fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        return self.fc(h.mean((2, 3)))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 3, 6, 6, generator=g),
            torch.randint(0, NUM_CLASSES, (BATCH,), generator=g),
        )
        for _ in range(EPOCHS * STEPS_PER_EPOCH)
    ]


def _model() -> TinyCNN:
    torch.manual_seed(0)
    return TinyCNN()


def _ema_decay() -> float:
    """train.py: ``adjust = world_size * batch_size * model_ema_steps / epochs``."""
    adjust = 1 * BATCH * MODEL_EMA_STEPS / EPOCHS
    alpha = 1.0 - MODEL_EMA_DECAY
    alpha = min(1.0, alpha * adjust)
    return 1.0 - alpha


# ------------------------------------------------------------- the plain loop


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def _counts(model: nn.Module) -> dict[str, int]:
    """BatchNorm's ``num_batches_tracked`` (the integer buffers)."""
    return {k: int(v) for k, v in model.state_dict().items() if not v.is_floating_point()}


def torchvision_run(
    model: nn.Module, data: list[Any], precision: str, dtype: torch.dtype = torch.float32
) -> list[dict[str, Any]]:
    """train.py's ``main`` set-up and ``train_one_epoch``, on a deep copy; a record per
    step: the model's floating state, the average's, the lr and the loss."""
    model = copy.deepcopy(model).to(dtype)
    criterion = nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
    parameters = torchvision_set_weight_decay(
        model, WEIGHT_DECAY, norm_weight_decay=0.0, norm_classes=list(optim.NORMALIZATION)
    )
    optimizer = torch.optim.SGD(
        parameters, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=False
    )
    main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=EPOCHS - LR_WARMUP_EPOCHS, eta_min=0.0
    )
    warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=LR_WARMUP_DECAY, total_iters=LR_WARMUP_EPOCHS
    )
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        schedulers=[warmup_lr_scheduler, main_lr_scheduler],
        milestones=[LR_WARMUP_EPOCHS],
    )
    model_ema = TorchvisionEMA(model, decay=_ema_decay())
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    # torch.cuda.amp.GradScaler() if args.amp, here for fp16 only, on the CPU
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    log = []
    batches = iter(data)
    for epoch in range(EPOCHS):
        model.train()
        for i in range(STEPS_PER_EPOCH):
            image, target = next(batches)
            image = image.to(dtype)
            with torch.autocast("cpu", dtype=half or torch.bfloat16, enabled=half is not None):
                output = model(image)
                loss = criterion(output, target)

            optimizer.zero_grad()
            lr = optimizer.param_groups[0]["lr"]
            if scaler is not None:
                scaler.scale(loss).backward()
                if CLIP_GRAD_NORM is not None:
                    # we should unscale the gradients of optimizer's assigned params if do
                    # gradient clipping
                    scaler.unscale_(optimizer)
                    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD_NORM)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if CLIP_GRAD_NORM is not None:
                    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD_NORM)
                optimizer.step()

            if model_ema and i % MODEL_EMA_STEPS == 0:
                model_ema.update_parameters(model)
                if epoch < LR_WARMUP_EPOCHS:
                    # Reset ema buffer to keep copying weights during warmup period
                    model_ema.n_averaged.fill_(0)
            log.append(
                {
                    "model": _snapshot(model),
                    "ema": _snapshot(model_ema.module),
                    "counts": _counts(model),
                    "ema_counts": _counts(model_ema.module),
                    "lr": lr,
                    "loss": float(loss.detach()),
                    "grad_norm": float(grad_norm),
                    "scale": scaler.get_scale() if scaler is not None else None,
                }
            )
        lr_scheduler.step()
    return log


# ---------------------------------------------------------------- fasttorch


def _loss(apply: Any, batch: Any) -> torch.Tensor:
    image, target = batch
    return nn.functional.cross_entropy(apply(image), target, label_smoothing=LABEL_SMOOTHING)


def _fasttorch_step(precision: str) -> Any:
    step = fasttorch.step(_loss)
    if precision in ("bf16", "fp16"):
        step = fasttorch.with_amp(step, precision)
    step = fasttorch.clip_scaled(step, CLIP_GRAD_NORM)
    copies = LR_WARMUP_EPOCHS * math.ceil(STEPS_PER_EPOCH / MODEL_EMA_STEPS) + 1
    return fasttorch.ema(step, _ema_decay(), every=MODEL_EMA_STEPS, copy_first=copies)


def _optimizer() -> optim.Optimizer:
    warm = LR_WARMUP_EPOCHS
    schedule = schedules.per_epoch(
        schedules.sequential(
            [
                schedules.linear_warmup(LR, warm, init=LR_WARMUP_DECAY * LR),
                schedules.cosine(LR, EPOCHS - warm, end=0.0),
            ],
            [warm],
        ),
        STEPS_PER_EPOCH,
    )
    return optim.groups(
        optim.sgd(schedule, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY),
        [(optim.in_module(*optim.NORMALIZATION), {"weight_decay": 0.0})],
    )


def fasttorch_run(model: nn.Module, data: list[Any], precision: str, how: str) -> list[dict]:
    step = _fasttorch_step(precision)
    if how == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    state = fasttorch.TrainState.create(copy.deepcopy(model), _optimizer())
    log = []
    for batch in data:
        state, metrics = step(state, batch)
        sub = state.substates["ema"]
        floating = lambda d: {k: v.clone() for k, v in d.items() if v.is_floating_point()}  # noqa: E731
        log.append(
            {
                "model": {**floating(state.params), **floating(state.buffers)},
                "ema": {**floating(sub.params), **floating(sub.buffers)},
                "lr": metrics["lr"].clone(),
                "loss": metrics["loss"].clone(),
                "grad_norm": metrics["grad_norm"].clone(),
                "skipped": bool(metrics["skipped"]) if "skipped" in metrics else None,
                "ema_count": int(sub.count),
                "counts": {
                    k: int(v) for k, v in state.buffers.items() if not v.is_floating_point()
                },
                "ema_counts": {
                    k: int(v) for k, v in sub.buffers.items() if not v.is_floating_point()
                },
            }
        )
    if how == "compiled":
        assert not counters["graph_break"]
        assert counters["stats"]["unique_graphs"] == 1
        assert sum(counters["recompiles"].values()) == 0
    return log


# ------------------------------------------------------------------ the bounds


def _max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: Any) -> dict[str, float]:
    return {k: float((a[k].double() - b[k].double()).abs().max()) for k in keys}


def _largest_move(start: dict[str, torch.Tensor], log: list[dict], keys: list[str]) -> float:
    """The largest change of any entry of ``keys`` in one step of the plain loop."""
    states = [start, *(x["model"] for x in log)]
    return max(
        float((after[k] - before[k]).abs().max())
        for before, after in itertools.pairwise(states)
        for k in keys
    )


_BOUNDS: dict[str, Any] = {}


def _bounds(model: nn.Module, data: list[Any]) -> dict[str, Any]:
    """Rule 2: the float32 plain loop against itself in float64, per step; cached."""
    if _BOUNDS:
        return _BOUNDS
    log32 = torchvision_run(model, data, "fp32")
    log64 = torchvision_run(model, data, "fp32", torch.float64)
    params = [n for n, _ in model.named_parameters()]
    buffers = [k for k in log32[0]["model"] if k not in params]
    errors = [
        {
            "params": _max_err(a["model"], b["model"], params),
            "buffers": _max_err(a["model"], b["model"], buffers),
            "ema_params": _max_err(a["ema"], b["ema"], params),
            "ema_buffers": _max_err(a["ema"], b["ema"], buffers),
            "loss": abs(a["loss"] - b["loss"]),
            "grad_norm": abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"],
        }
        for a, b in zip(log32, log64)
    ]
    _BOUNDS.update(
        log32=log32,
        params=params,
        buffers=buffers,
        errors=errors,
        param_move=_largest_move(_snapshot(model), log32, params),
        buffer_move=_largest_move(_snapshot(model), log32, buffers),
    )
    return _BOUNDS


# ------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def model_and_data() -> tuple[nn.Module, list[Any]]:
    return _model(), _data()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_torchvision_recipe_step_by_step(
    model_and_data: tuple[nn.Module, list[Any]], precision: str
) -> None:
    model, data = model_and_data
    b = _bounds(model, data)
    ref = b["log32"] if precision == "fp32" else torchvision_run(model, data, precision)
    eager = fasttorch_run(model, data, precision, "eager")
    fast = fasttorch_run(model, data, precision, "compiled")
    params, buffers = b["params"], b["buffers"]
    u32 = tolerance.unit_roundoff(torch.float32)
    copies = LR_WARMUP_EPOCHS * math.ceil(STEPS_PER_EPOCH / MODEL_EMA_STEPS) + 1

    for t, (r, e, c) in enumerate(zip(ref, eager, fast)):
        where = f"{precision} step {t}"
        # Rule 1: aot_eager runs the eager step's operations in the same order.
        for part in ("model", "ema"):
            for k, v in e[part].items():
                torch.testing.assert_close(c[part][k], v, **EXACT, msg=f"{where} {part} {k}")
        torch.testing.assert_close(c["lr"], e["lr"], **EXACT)
        torch.testing.assert_close(c["loss"], e["loss"], **EXACT)
        assert c["ema_count"] == e["ema_count"] == t // MODEL_EMA_STEPS + 1

        if t == 0:
            # Rule 1: the first forward runs the same kernels on the same parameters and
            # batch: the same loss and the same running statistics.
            assert float(e["loss"]) == r["loss"], (where, float(e["loss"]), r["loss"])
            for k in buffers:
                torch.testing.assert_close(e["model"][k], r["model"][k], **EXACT, msg=k)
        # Integer buffers: the model's batch counts are the same integers. The average's
        # differ by design (fasttorch.ema's docstring): torchvision averages
        # num_batches_tracked as a float and truncates it into the integer buffer,
        # fasttorch copies the model's count at the average's last update (the two agree
        # while the average copies). Only BatchNorm(momentum=None) reads it.
        assert e["counts"] == r["counts"] == dict.fromkeys(r["counts"], t + 1), where
        last_update = t - t % MODEL_EMA_STEPS + 1
        assert e["ema_counts"] == dict.fromkeys(r["counts"], last_update), where
        if e["ema_count"] <= copies:
            assert r["ema_counts"] == e["ema_counts"], where
        # The lr: torch's float64 scheduler against the float32 the state holds: one
        # float32 rounding.
        assert abs(float(e["lr"]) - r["lr"]) <= u32 * r["lr"], (where, float(e["lr"]), r["lr"])

        # Rule 2 (+ rule 4 in bf16, fp16) for everything the step changed up to step t.
        err = {
            key: {k: max(x[key][k] for x in b["errors"][: t + 1]) for k in b["errors"][t][key]}
            for key in ("params", "buffers", "ema_params", "ema_buffers")
        }
        half = {"precision": precision, "steps": t + 1}
        p_atol = params_atol(
            err["params"], {k: r["model"][k] for k in params}, lr=b["param_move"], **half
        )
        b_atol = params_atol(
            err["buffers"], {k: r["model"][k] for k in buffers}, lr=b["buffer_move"], **half
        )
        # The average is a convex combination of the parameters (buffers) so far: their
        # bound holds for it, and its own fp32 error is measured alike.
        ep_atol = max(
            p_atol,
            params_atol(
                err["ema_params"], {k: r["ema"][k] for k in params}, lr=b["param_move"], **half
            ),
        )
        eb_atol = max(
            b_atol,
            params_atol(
                err["ema_buffers"], {k: r["ema"][k] for k in buffers}, lr=b["buffer_move"], **half
            ),
        )
        for keys, part, atol in (
            (params, "model", p_atol),
            (buffers, "model", b_atol),
            (params, "ema", ep_atol),
            (buffers, "ema", eb_atol),
        ):
            for k in keys:
                torch.testing.assert_close(
                    e[part][k], r[part][k], rtol=0, atol=atol, msg=f"{where} {part} {k}"
                )
        loop_err = LoopError(
            params={},
            buffers={},
            loss=max(x["loss"] for x in b["errors"][: t + 1]),
            grad_norm=max(x["grad_norm"] for x in b["errors"][: t + 1]),
        )
        l_atol = loss_atol(loop_err, torch.tensor([r["loss"]]), precision)
        assert abs(float(e["loss"]) - r["loss"]) <= l_atol, (where, float(e["loss"]), r["loss"])
        # The gradient norm before clipping, relative (rule 2 + rule 4's u).
        n_rtol = grad_norm_rtol(loop_err, precision)
        n_diff = abs(float(e["grad_norm"]) - r["grad_norm"])
        assert n_diff <= n_rtol * r["grad_norm"], (where, float(e["grad_norm"]), r["grad_norm"])

        # During the warm-up epochs the average is a copy of the model after each update,
        # and so is the first update after them (n_averaged was reset to 0 just before).
        if t <= LR_WARMUP_EPOCHS * STEPS_PER_EPOCH and t % MODEL_EMA_STEPS == 0:
            assert e["ema_count"] <= copies
            for k, v in e["model"].items():
                torch.testing.assert_close(e["ema"][k], v, **EXACT, msg=f"{where} copy {k}")

    # The comparison is not vacuous: the average lags the model by more than the bound,
    # and the learning rate went through warm-up and cosine.
    last = eager[-1]
    lag = max(float((last["ema"][k] - last["model"][k]).abs().max()) for k in params)
    assert lag > FACTOR * p_atol
    assert {round(x["lr"], 6) for x in ref} == {LR * LR_WARMUP_DECAY, LR, LR / 2}
    if precision == "fp16":
        # No step overflowed: GradScaler kept its initial scale and fasttorch skipped none.
        # (On a skipped step torchvision's loop still updates the average, from the
        # unchanged model; fasttorch.ema does not advance: not exercised here.)
        assert {x["scale"] for x in ref} == {2.0**16}
        assert not any(x["skipped"] for x in eager)
    assert ref[-1]["ema_counts"] != eager[-1]["ema_counts"]  # the truncated average
    # Clipping acted on some steps and not on others.
    norms = [x["grad_norm"] for x in ref]
    assert min(norms) < CLIP_GRAD_NORM < max(norms), norms
