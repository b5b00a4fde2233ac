"""Hostile inputs to what issue 47 built: each is refused clearly or equals torch's own code.

The features: ``from_torch`` (defaults, switches, per-parameter rules, a tensor lr), the
native ``adam``/``adamw``/``sgd``, ``several`` with shared ``outputs``, ``only`` and
``Frozen`` target networks (and their checkpoints), ``ema``'s options, ``groups``'
selectors, per-epoch and sequential schedules, populations (``member``, ``in_dims``,
``hyper``, export), a loss that bypasses ``apply``, and an error in the loss of a
donated eager or a compiled step. Each gets wrong types, NaN/inf/negative/zero
hyperparameters, empty models, mismatched names, 0-d against 1-D tensors, a bool where
an int is expected, duplicates and out-of-range indices.

Each case either raises, when it is built (or, for a state, created), an error whose
message (with its notes) says what was given, what is valid and how to fix it (the
fragments listed per case), or is accepted and then computes what torch's own code
computes: bit for bit (tests/tolerance.py's rule 1, the same kernels on the same
inputs), NaN where torch gives NaN.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tolerance import EXACT
from torch import nn

import fasttorch
from fasttorch import optim, schedules
from fasttorch.checkpoint import export_safetensors, latest_models, load_models, save_models
from fasttorch.optim import groups, in_module, is_bias, with_module

STEPS = 3


def lin() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def mse(apply: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((apply(x) - y) ** 2).mean()


def mse3(apply: Any, batch: Any, models: Any) -> torch.Tensor:
    return mse(apply, batch)


def data(k: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(k)]


BATCH = data(1)[0]


def ms() -> fasttorch.Step:
    return fasttorch.model_step(mse3)


def trained(model: nn.Module | None = None) -> fasttorch.TrainState:
    return fasttorch.TrainState.create(model or lin(), optim.adam(1e-3))


def two() -> fasttorch.Models:
    return fasttorch.Models.create(a=trained(), b=trained())


def target(module: nn.Module, follows: str = "a") -> fasttorch.Models:
    return fasttorch.Models.create(
        a=trained(), t=fasttorch.Frozen.create(module, follows=follows, tau=0.5)
    )


def pop(n: int = 3, **kw: Any) -> fasttorch.TrainState:
    return fasttorch.create_population(lambda: nn.Linear(3, 2), optim.sgd(0.1), n, **kw)


def saved_then_loaded(saved: fasttorch.Models, template: fasttorch.Models) -> Any:
    directory = str(pytest_tmp() / "ckpt")
    save_models(directory, saved)
    return load_models(directory, latest_models(directory), template)


_TMP: list[Any] = []


def pytest_tmp() -> Any:
    return _TMP[-1]


@pytest.fixture(autouse=True)
def _tmp(tmp_path: Any) -> Any:
    _TMP.append(tmp_path)
    yield
    _TMP.pop()


FT = optim.from_torch
Adam, AdamW = torch.optim.Adam, torch.optim.AdamW
S = fasttorch.step(mse)
COS = schedules.cosine(1e-3, 10)
GIVEN_OPT = "help\\(torch.optim.Adam\\)"  # from_torch's note on torch's own refusal

# (id, call, exception type, fragments of the message: what was given, what is valid,
# how to fix; regular expressions searched in the message and its notes)
REFUSED: list[tuple[str, Callable[[], Any], type[Exception], list[str]]] = [
    # from_torch: defaults, switches, per-parameter rules
    ("ft-class-str", lambda: FT("Adam"), TypeError, ["got 'Adam'", "torch.optim.AdamW"]),
    ("ft-class-module", lambda: FT(nn.Linear), TypeError, ["Linear", "torch.optim class"]),
    ("ft-lr-nan", lambda: FT(Adam, float("nan")), ValueError, ["lr=nan", "finite", "Pass"]),
    ("ft-lr-inf", lambda: FT(Adam, float("inf")), ValueError, ["lr=inf", "finite", "Pass"]),
    ("ft-lr-neg", lambda: FT(Adam, -1.0), ValueError, ["lr=-1.0", "lr >= 0", "Pass"]),
    ("ft-lr-bool", lambda: FT(Adam, True), TypeError, ["got True of type bool", "float"]),
    ("ft-lr-str", lambda: FT(Adam, "1e-3"), TypeError, ["'1e-3' of type str", "float"]),
    (
        "ft-betas-short",
        lambda: FT(Adam, betas=(0.9,)),
        IndexError,
        ["'betas': \\(0.9,\\)", GIVEN_OPT],
    ),
    (
        "ft-betas-1",
        lambda: FT(Adam, betas=(1.0, 0.9)),
        ValueError,
        ["beta parameter at index 0: 1.0", GIVEN_OPT],
    ),
    (
        "ft-betas-nan",
        lambda: FT(Adam, betas=(float("nan"), 0.9)),
        ValueError,
        ["index 0: nan", GIVEN_OPT],
    ),
    ("ft-eps-neg", lambda: FT(Adam, eps=-1.0), ValueError, ["epsilon value: -1.0", GIVEN_OPT]),
    (
        "ft-wd-nan",
        lambda: FT(AdamW, weight_decay=float("nan")),
        ValueError,
        ["weight_decay value: nan", "help"],
    ),
    ("ft-unknown-kw", lambda: FT(Adam, momentum=0.9), TypeError, ["'momentum'", GIVEN_OPT]),
    (
        "ft-capturable-str",
        lambda: FT(Adam, capturable="no"),
        ValueError,
        ["capturable='no'", "only False", "Leave it out"],
    ),
    (
        "ft-differentiable",
        lambda: FT(Adam, differentiable=True),
        ValueError,
        ["differentiable=True", "only False", "Leave it out"],
    ),
    (
        "ft-muon-1d",
        lambda: fasttorch.TrainState.create(lin(), FT(torch.optim.Muon)),
        ValueError,
        ["size: torch.Size\\(\\[2\\]\\)", "2D parameters", "fasttorch.optim.groups"],
    ),
    (
        "ft-empty-model",
        lambda: fasttorch.TrainState.create(nn.ReLU(), FT(Adam)),
        ValueError,
        ["ReLU has no parameters", "requires_grad=True"],
    ),
    # a tensor lr
    (
        "tlr-2-values",
        lambda: FT(Adam, torch.tensor([1e-3, 2e-3])),
        ValueError,
        ["shape \\(2,\\)", "one floating-point value", "torch.tensor\\(1e-3\\)"],
    ),
    (
        "tlr-empty",
        lambda: FT(Adam, torch.tensor([])),
        ValueError,
        ["shape \\(0,\\)", "one floating-point value"],
    ),
    (
        "tlr-int",
        lambda: FT(Adam, torch.tensor(1)),
        ValueError,
        ["torch.int64", "floating-point", "torch.tensor\\(1e-3\\)"],
    ),
    (
        "tlr-bool",
        lambda: FT(Adam, torch.tensor(True)),
        ValueError,
        ["torch.bool", "floating-point"],
    ),
    ("tlr-nan", lambda: FT(Adam, torch.tensor(float("nan"))), ValueError, ["lr=nan", "finite"]),
    ("tlr-neg", lambda: FT(Adam, torch.tensor(-1.0)), ValueError, ["lr=-1.0", "lr >= 0"]),
    # the native twins
    ("adam-lr-nan", lambda: optim.adam(float("nan")), ValueError, ["lr=nan", "finite", "Pass"]),
    ("adam-lr-neg", lambda: optim.adam(-1.0), ValueError, ["lr=-1.0", "lr >= 0", "Pass"]),
    ("adam-lr-bool", lambda: optim.adam(True), TypeError, ["True of type bool", "float"]),
    (
        "adam-lr-tensor",
        lambda: optim.adam(torch.tensor(1e-3)),
        TypeError,
        ["of type Tensor", "float"],
    ),
    (
        "adam-beta1-1",
        lambda: optim.adam(1e-3, betas=(1.0, 0.999)),
        ValueError,
        ["beta1=1.0", "0 <= beta1 < 1", "Pass"],
    ),
    (
        "adam-beta1-neg",
        lambda: optim.adam(1e-3, betas=(-0.1, 0.999)),
        ValueError,
        ["beta1=-0.1", "0 <= beta1 < 1"],
    ),
    (
        "adam-beta2-nan",
        lambda: optim.adam(1e-3, betas=(0.9, float("nan"))),
        ValueError,
        ["beta2=nan", "finite"],
    ),
    (
        "adam-betas-short",
        lambda: optim.adam(1e-3, betas=(0.9,)),
        ValueError,
        ["\\(0.9,\\)", "a pair", "betas=\\(0.9, 0.999\\)"],
    ),
    ("adam-eps-neg", lambda: optim.adam(1e-3, eps=-1e-8), ValueError, ["eps=-1e-08", "eps >= 0"]),
    (
        "adamw-wd-nan",
        lambda: optim.adamw(1e-3, weight_decay=float("nan")),
        ValueError,
        ["weight_decay=nan", "finite"],
    ),
    (
        "adamw-wd-neg",
        lambda: optim.adamw(1e-3, weight_decay=-0.1),
        ValueError,
        ["weight_decay=-0.1", ">= 0"],
    ),
    (
        "adam-opaque-str",
        lambda: optim.adam(1e-3, opaque="yes"),
        TypeError,
        ["opaque", "bool", "'yes'"],
    ),
    (
        "sgd-momentum-nan",
        lambda: optim.sgd(0.1, momentum=float("nan")),
        ValueError,
        ["momentum=nan", "finite"],
    ),
    (
        "adam-empty-model",
        lambda: trained(nn.ReLU()),
        ValueError,
        ["ReLU has no parameters", "nothing to train"],
    ),
    # several, outputs, only
    (
        "several-empty",
        lambda: fasttorch.several({}),
        ValueError,
        ["got \\{\\}", "at least one member", "model_step"],
    ),
    (
        "several-list",
        lambda: fasttorch.several([ms()]),
        TypeError,
        ["got list", "mapping", "several\\(\\{'d'"],
    ),
    ("several-name-int", lambda: fasttorch.several({1: ms()}), TypeError, ["got 1", "strings"]),
    (
        "several-not-a-step",
        lambda: fasttorch.several({"a": mse3}),
        TypeError,
        ["'mse3'", "not a fasttorch step", "model_step"],
    ),
    (
        "several-one-step-twice",
        lambda: (lambda s: fasttorch.several({"a": s, "b": s}))(ms()),
        ValueError,
        ["'a' and 'b'", "same step object", "one step per member"],
    ),
    (
        "outputs-not-callable",
        lambda: fasttorch.several({"a": ms()}, outputs={"o": ("a", 3)}),
        TypeError,
        ["'o': 3", "not callable", "\\(member, forward_fn\\)"],
    ),
    (
        "outputs-triple",
        lambda: fasttorch.several({"a": ms()}, outputs={"o": ("a", mse, 1)}),
        TypeError,
        ["outputs\\['o'\\]", "give \\(member, forward_fn\\)"],
    ),
    (
        "outputs-list",
        lambda: fasttorch.several({"a": ms()}, outputs=[("a", mse)]),
        TypeError,
        ["got list", "outputs=\\{'fake'"],
    ),
    (
        "outputs-member-index",
        lambda: fasttorch.several({"a": ms()}, outputs={"o": (0, mse)}),
        ValueError,
        ["member 0", "\\['a'\\]", "trains here"],
    ),
    (
        "only-nothing",
        lambda: fasttorch.several({"a": ms(), "b": ms()}).only(),
        ValueError,
        ["only\\(\\)", "one or more", "\\['a', 'b'\\]"],
    ),
    (
        "only-unknown",
        lambda: fasttorch.several({"a": ms(), "b": ms()}).only("c"),
        ValueError,
        ["\\['c'\\] are not among them", "\\['a', 'b'\\]"],
    ),
    (
        "only-index",
        lambda: fasttorch.several({"a": ms(), "b": ms()}).only(0),
        ValueError,
        ["\\[0\\] are not among them"],
    ),
    (
        "only-list",
        lambda: fasttorch.several({"a": ms(), "b": ms()}).only(["a"]),
        ValueError,
        ["\\[\\['a'\\]\\] are not among"],
    ),
    (
        "state-missing-member",
        lambda: fasttorch.several({"a": ms(), "b": ms()})(
            fasttorch.Models.create(a=trained()), BATCH
        ),
        ValueError,
        ["member 'b'", "members are \\['a'\\]", "name the members"],
    ),
    (
        "state-untrained-member",
        lambda: fasttorch.several({"a": ms()})(two(), BATCH),
        ValueError,
        ["\\['b'\\]", "no step trains", "Frozen"],
    ),
    (
        "state-not-models",
        lambda: fasttorch.several({"a": ms()})(trained(), BATCH),
        TypeError,
        ["got TrainState", "Models.create"],
    ),
    (
        "state-frozen-stepped",
        lambda: fasttorch.several({"a": ms()})(
            fasttorch.Models.create(a=fasttorch.Frozen.create(lin()), b=trained()), BATCH
        ),
        ValueError,
        ["'a' is Frozen", "TrainState.create"],
    ),
    (
        "models-empty",
        lambda: fasttorch.Models.create(),
        ValueError,
        ["at least one member", "Models.create\\(g="],
    ),
    (
        "models-module",
        lambda: fasttorch.Models.create(a=lin()),
        TypeError,
        ["is a Linear", "Frozen.create"],
    ),
    ("models-unknown", lambda: two()["zz"], KeyError, ["'zz'", "\\['a', 'b'\\]"]),
    # Frozen targets and their checkpoints
    (
        "frozen-tau-0",
        lambda: fasttorch.Frozen.create(lin(), follows="a", tau=0.0),
        ValueError,
        ["tau=0.0", "in \\(0, 1\\]"],
    ),
    (
        "frozen-tau-nan",
        lambda: fasttorch.Frozen.create(lin(), follows="a", tau=float("nan")),
        ValueError,
        ["tau=nan", "in \\(0, 1\\]"],
    ),
    (
        "frozen-tau-2",
        lambda: fasttorch.Frozen.create(lin(), follows="a", tau=2.0),
        ValueError,
        ["tau=2.0", "1 copies"],
    ),
    (
        "frozen-every-0",
        lambda: fasttorch.Frozen.create(lin(), follows="a", every=0),
        ValueError,
        ["got 0", "integer >= 1"],
    ),
    (
        "frozen-every-bool",
        lambda: fasttorch.Frozen.create(lin(), follows="a", every=True),
        TypeError,
        ["True of type bool", "integer >= 1"],
    ),
    (
        "frozen-every-float",
        lambda: fasttorch.Frozen.create(lin(), follows="a", every=2.0),
        TypeError,
        ["2.0 of type float"],
    ),
    (
        "frozen-follows-index",
        lambda: fasttorch.Frozen.create(lin(), follows=1),
        TypeError,
        ["got 1", "names a member"],
    ),
    (
        "frozen-tau-alone",
        lambda: fasttorch.Frozen.create(lin(), tau=0.5),
        ValueError,
        ["target network", "follows='q'"],
    ),
    (
        "frozen-empty",
        lambda: fasttorch.Frozen.create(nn.ReLU()),
        ValueError,
        ["ReLU has no tensors"],
    ),
    (
        "follows-missing",
        lambda: target(lin(), "zz"),
        ValueError,
        ["follows 'zz'", "missing", "\\['a', 't'\\]"],
    ),
    (
        "follows-itself",
        lambda: target(lin(), "t"),
        ValueError,
        ["follows 't'", "Frozen", "trained member"],
    ),
    (
        "follows-other-shapes",
        lambda: target(nn.Linear(3, 4)),
        ValueError,
        ["\\(\\(4,\\)", "tensors differ", "copy.deepcopy\\(model\\)"],
    ),
    (
        "follows-other-names",
        lambda: target(nn.Sequential(lin())),
        ValueError,
        ["'0.bias'", "tensors differ", "copy.deepcopy\\(model\\)"],
    ),
    (
        "checkpoint-target-shapes",
        lambda: saved_then_loaded(target(lin()), target(nn.Linear(3, 4))),
        ValueError,
        ["tensors differ"],
    ),
    # ema's options
    (
        "ema-decay-1.5",
        lambda: fasttorch.ema(S, 1.5),
        ValueError,
        ["decay=1.5", "\\[0, 1\\)", "0.999"],
    ),
    (
        "ema-decay-nan",
        lambda: fasttorch.ema(S, float("nan")),
        ValueError,
        ["decay=nan", "\\[0, 1\\)"],
    ),
    (
        "ema-decay-tensor",
        lambda: fasttorch.ema(S, torch.tensor(0.9)),
        TypeError,
        ["of type Tensor", "number in \\[0, 1\\)"],
    ),
    (
        "ema-every-0",
        lambda: fasttorch.ema(S, 0.9, every=0),
        ValueError,
        ["got 0", "integer >= 1", "optimizer updates"],
    ),
    ("ema-every-bool", lambda: fasttorch.ema(S, 0.9, every=True), TypeError, ["True of type bool"]),
    (
        "ema-copy-first-neg",
        lambda: fasttorch.ema(S, 0.9, copy_first=-1),
        ValueError,
        ["got -1", ">= 0"],
    ),
    (
        "ema-buffers",
        lambda: fasttorch.ema(S, 0.9, buffers="bogus"),
        ValueError,
        ["'bogus'", "'average'", "'copy'"],
    ),
    (
        "ema-warmup-neg",
        lambda: fasttorch.ema(S, 0.9, warmup=-1.0),
        ValueError,
        ["warmup=-1.0", "> 1", "TensorFlow"],
    ),
    (
        "ema-warmup-power-0",
        lambda: fasttorch.ema(S, 0.9, warmup_power=0.0),
        ValueError,
        ["warmup_power=0.0", "> 0", "2/3"],
    ),
    (
        "ema-gamma-alone",
        lambda: fasttorch.ema(S, 0.9, warmup_gamma=2.0),
        ValueError,
        ["warmup_gamma=2.0", "give warmup_power too"],
    ),
    (
        "ema-min-decay-above",
        lambda: fasttorch.ema(S, 0.9, warmup_power=0.75, min_decay=0.99),
        ValueError,
        ["min_decay=0.99", "\\[0, decay=0.9\\]"],
    ),
    (
        "ema-of-a-loss",
        lambda: fasttorch.ema(mse, 0.9),
        TypeError,
        ["got 'mse'", "fasttorch.step\\(loss_fn\\)"],
    ),
    # group selectors
    (
        "groups-default-str",
        lambda: groups("adam", [(is_bias, {})]),
        TypeError,
        ["got 'adam'", "an optimizer", "adamw\\(1e-3\\)"],
    ),
    (
        "groups-rule-not-pair",
        lambda: groups(optim.adamw(1e-3), [is_bias]),
        TypeError,
        ["got \\[<function is_bias", "\\(selector, overrides\\)", "'\\*.bias'"],
    ),
    (
        "groups-selector-tuple",
        lambda: groups(optim.adamw(1e-3), [(("x",), {})]),
        TypeError,
        ["got \\('x',\\)", "glob string"],
    ),
    (
        "groups-selector-none",
        lambda: groups(optim.adamw(1e-3), [(None, {})]),
        TypeError,
        ["got None", "glob string"],
    ),
    (
        "groups-unknown-hyper",
        lambda: trained_groups([(is_bias, {"weight_decay_typo": 0.0})]),
        TypeError,
        ["'weight_decay_typo'", "own argument names"],
    ),
    (
        "groups-hyper-nan",
        lambda: trained_groups([(is_bias, {"weight_decay": float("nan")})]),
        ValueError,
        ["weight_decay=nan", "finite"],
    ),
    (
        "groups-hyper-str",
        lambda: trained_groups([(is_bias, {"weight_decay": "0"})]),
        TypeError,
        ["'0' of type str"],
    ),
    (
        "groups-matches-nothing",
        lambda: trained_groups([("nonexistent.*", {"weight_decay": 0.0})]),
        ValueError,
        ["matches no parameter", "'0.weight'", "Fix the selector"],
    ),
    (
        "groups-shadowed-rule",
        lambda: trained_groups([(is_bias, {}), (is_bias, {"weight_decay": 0.1})]),
        ValueError,
        ["rule 1", "earlier rule", "drop the rule"],
    ),
    (
        "with-module-instance",
        lambda: with_module(nn.LayerNorm(4)),
        TypeError,
        ["got LayerNorm", "predicate", "in_module\\("],
    ),
    (
        "with-module-class",
        lambda: with_module(nn.Conv2d),
        TypeError,
        ["Conv2d", "predicate", "in_module\\("],
    ),
    (
        "in-module-str",
        lambda: in_module("LayerNorm"),
        TypeError,
        ["\\('LayerNorm',\\)", "nn.Module classes", "in_module\\(torch.nn.LayerNorm\\)"],
    ),
    # schedules per epoch and sequential
    ("per-epoch-0", lambda: schedules.per_epoch(COS, 0), ValueError, ["got 0", "integer >= 1"]),
    ("per-epoch-bool", lambda: schedules.per_epoch(COS, True), TypeError, ["True of type bool"]),
    ("per-epoch-float", lambda: schedules.per_epoch(COS, 2.5), TypeError, ["2.5 of type float"]),
    (
        "sequential-count",
        lambda: schedules.sequential([COS, COS], [3, 5]),
        ValueError,
        ["2 schedules need 1 milestones", "got \\[3, 5\\]"],
    ),
    (
        "sequential-unsorted",
        lambda: schedules.sequential([COS, COS, COS], [5, 3]),
        ValueError,
        ["\\[5, 3\\]", "increase strictly", "Sort them"],
    ),
    (
        "sequential-repeated",
        lambda: schedules.sequential([COS, COS, COS], [3, 3]),
        ValueError,
        ["\\[3, 3\\]", "increase strictly"],
    ),
    (
        "sequential-at-0",
        lambda: schedules.sequential([COS, COS], [0]),
        ValueError,
        ["got 0", "integer >= 1"],
    ),
    (
        "sequential-bool",
        lambda: schedules.sequential([COS, COS], [True]),
        TypeError,
        ["True of type bool"],
    ),
    (
        "sequential-empty",
        lambda: schedules.sequential([], []),
        ValueError,
        ["at least one schedule"],
    ),
    (
        "sequential-float-in",
        lambda: schedules.sequential([COS, 0.1], [3]),
        TypeError,
        ["schedules\\[1\\] is 0.1", "callable step -> rate"],
    ),
    ("cosine-0-steps", lambda: schedules.cosine(1e-3, 0), ValueError, ["got 0", "integer >= 1"]),
    ("cosine-nan", lambda: schedules.cosine(float("nan"), 10), ValueError, ["peak=nan", "finite"]),
    # populations
    ("population-0", lambda: pop(0), ValueError, ["got 0", "integer >= 1"]),
    ("population-bool", lambda: pop(True), TypeError, ["True of type bool"]),
    (
        "population-hyper-scalar",
        lambda: pop(hyper={"lr": 1e-3}),
        TypeError,
        ["is 0.001", "one value per member", "leave 'lr' out of hyper"],
    ),
    (
        "population-hyper-count",
        lambda: pop(hyper={"lr": [1e-3, 2e-3]}),
        ValueError,
        ["2 values for 3 members"],
    ),
    (
        "population-hyper-unknown",
        lambda: pop(hyper={"bogus": [1, 2, 3]}),
        ValueError,
        ["'bogus'", "\\['lr', 'weight_decay'\\]"],
    ),
    (
        "population-hyper-nan",
        lambda: pop(hyper={"lr": [1e-3, float("nan"), 1e-3]}),
        ValueError,
        ["lr=nan", "finite"],
    ),
    (
        "population-hyper-2d",
        lambda: pop(hyper={"lr": torch.ones(3, 2)}),
        TypeError,
        ["shape \\(3, 2\\)", "one value per member"],
    ),
    (
        "population-duplicate-members",
        lambda: pop(seeds=[1, 1, 2]),
        ValueError,
        ["members 0 and 1", "seeds=\\[1, 1, 2\\]", "its own seed"],
    ),
    (
        "population-seed-bool",
        lambda: pop(seeds=[True, 2, 3]),
        TypeError,
        ["seeds\\[0\\]", "True of type bool"],
    ),
    (
        "population-seed-count",
        lambda: pop(seeds=[1, 2]),
        ValueError,
        ["2 seeds given for 3 members"],
    ),
    ("population-init", lambda: pop(init="bogus"), ValueError, ["'bogus'", "'seeds' or 'copies'"]),
    (
        "population-from-torch",
        lambda: fasttorch.create_population(lin(), FT(torch.optim.SGD, 0.1), 3),
        TypeError,
        ["from_torch", "vmap", "fasttorch.optim.sgd"],
    ),
    ("member-out-of-range", lambda: fasttorch.member(pop(), 3), IndexError, ["index 3", "0 to 2"]),
    (
        "member-negative-out-of-range",
        lambda: fasttorch.member(pop(), -4),
        IndexError,
        ["index -4", "-3 to -1"],
    ),
    (
        "member-1d-tensor",
        lambda: fasttorch.member(pop(), torch.tensor([1])),
        TypeError,
        ["shape \\(1,\\)", "0-d integer tensor", "argmin"],
    ),
    (
        "member-float",
        lambda: fasttorch.member(pop(), 1.0),
        TypeError,
        ["1.0 of type float", "an int"],
    ),
    (
        "member-float-tensor",
        lambda: fasttorch.member(pop(), torch.tensor(1.0)),
        TypeError,
        ["torch.float32", "integer tensor"],
    ),
    ("member-bool", lambda: fasttorch.member(pop(), True), TypeError, ["True of type bool"]),
    (
        "member-bool-tensor",
        lambda: fasttorch.member(pop(), torch.tensor(True)),
        TypeError,
        ["torch.bool"],
    ),
    (
        "member-of-one-model",
        lambda: fasttorch.member(trained(), 0),
        ValueError,
        ["not a population", "create_population"],
    ),
    (
        "population-plain-step",
        lambda: S(pop(), BATCH),
        ValueError,
        ["population of 3 members", "fasttorch.vmapped\\(step, 3\\)", "member\\(population, i\\)"],
    ),
    (
        "vmapped-n-mismatch",
        lambda: fasttorch.vmapped(S, 4)(pop(), BATCH),
        ValueError,
        ["built for 4", "holds 3", "vmapped\\(step, 3\\)"],
    ),
    (
        "in-dims-size",
        lambda: fasttorch.vmapped(S, 3, in_dims=0)(pop(), BATCH),
        ValueError,
        ["shape \\(4, 3\\)", "3 entries along dimension 0", "torch.stack"],
    ),
    (
        "in-dims-str",
        lambda: fasttorch.vmapped(S, 3, in_dims="0"),
        TypeError,
        ["in_dims='0'", "an int d"],
    ),
    (
        "in-dims-absent-dim",
        lambda: fasttorch.vmapped(S, 3, in_dims=2)(pop(), BATCH),
        ValueError,
        ["dimension 2, absent"],
    ),
    (
        "in-dims-tree",
        lambda: fasttorch.vmapped(S, 3, in_dims=(0, None, None))(pop(), BATCH),
        ValueError,
        ["does not match the batch", "a tuple of 2"],
    ),
    ("vmapped-bool", lambda: fasttorch.vmapped(S, True), TypeError, ["True of type bool"]),
    (
        "export-population",
        lambda: export_safetensors(pop(), pytest_tmp() / "x.safetensors"),
        ValueError,
        ["population of 3 members", "fasttorch.member\\(population, i\\)"],
    ),
    (
        "export-models",
        lambda: export_safetensors(two(), pytest_tmp() / "x.safetensors"),
        TypeError,
        ["members \\['a', 'b'\\]", "export_safetensors\\(state\\[name\\], file\\)"],
    ),
]


def trained_groups(rules: Any) -> fasttorch.TrainState:
    return fasttorch.TrainState.create(net(), groups(optim.adamw(1e-3), rules))


@pytest.mark.parametrize(
    ("call", "error", "fragments"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_refused_with_what_was_given_what_is_valid_and_how_to_fix(
    call: Callable[[], Any], error: type[Exception], fragments: list[str]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own deprecation notes, not the refusal
        with pytest.raises(error) as info:
            call()
    message = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    for fragment in fragments:
        assert re.search(fragment, message), f"{fragment!r} not in: {message}"


# --------------------------------------------------------------------------- accepted


def torch_loop(
    model: nn.Module, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> nn.Module:
    model = copy.deepcopy(model)
    kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    opt = cls(model.parameters(), **kw)
    for batch in data():
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


ACCEPTED = {
    "lr-0": (Adam, {"lr": 0.0}),
    "weight-decay-inf": (AdamW, {"weight_decay": float("inf")}),
    "foreach-truthy-str": (Adam, {"foreach": "yes"}),
    "amsgrad-int": (Adam, {"amsgrad": 1}),
    "betas-list": (Adam, {"betas": [0.8, 0.99]}),
    "tensor-lr-1d": (Adam, {"lr": torch.tensor([1e-3])}),
    "tensor-lr-float64": (AdamW, {"lr": torch.tensor(3e-4, dtype=torch.float64)}),
    "tensor-lr-requires-grad": (Adam, {"lr": torch.tensor(1e-3, requires_grad=True)}),
}


# Every case eagerly; compiled, one tensor lr and one non-finite hyperparameter.
RUNS = [(c, "eager") for c in ACCEPTED] + [
    ("tensor-lr-1d", "compiled"),
    ("weight-decay-inf", "compiled"),
]


@pytest.mark.parametrize(("case", "mode"), RUNS, ids=[f"{c}-{m}" for c, m in RUNS])
def test_accepted_from_torch_inputs_train_as_torch_does(case: str, mode: str) -> None:
    """What torch accepts, from_torch accepts, and computes torch's eager loop's numbers
    bit for bit (compiled: Adam and AdamW trace torch's default form, module docstring),
    NaN where torch gives NaN."""
    cls, kwargs = ACCEPTED[case]
    model = lin()
    ref = torch_loop(model, cls, kwargs)
    kw = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    state = fasttorch.TrainState.create(copy.deepcopy(model), FT(cls, **kw))
    step = S if mode == "eager" else fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    for batch in data():
        state, _ = step(state, batch)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state.params[n], p.detach(), **EXACT, equal_nan=True)


def test_accepted_indices_and_rules_mean_what_they_say() -> None:
    """A negative member index counts from the end (Python's rule, said in the
    out-of-range message), a 0-d tensor index is its value (what argmin returns),
    ``only`` with a repeated name is ``only`` with it once, and no group rules is the
    default optimizer alone."""
    population = pop()
    for a, b in ((-1, 2), (torch.tensor(1), 1)):
        got, want = fasttorch.member(population, a), fasttorch.member(population, b)
        for k, v in want.params.items():
            torch.testing.assert_close(got.params[k], v, **EXACT)
    gan = fasttorch.several({"a": ms(), "b": ms()})
    assert gan.only("a", "a").idle == gan.only("a").idle == ("b",)
    plain = fasttorch.TrainState.create(net(), optim.adamw(1e-3))
    grouped = trained_groups([])
    for batch in data():
        plain, _ = S(plain, batch)
        grouped, _ = S(grouped, batch)
    for k, v in plain.params.items():
        torch.testing.assert_close(grouped.params[k], v, **EXACT)


def test_a_schedule_shorter_than_training_holds_its_documented_end() -> None:
    """torchvision's per-epoch warm-up then cosine, trained past the cosine's length:
    within its length torch's SequentialLR stepped per epoch (rule 1: float64 both
    sides, Python floats against tensors, within one float64 rounding per epoch); past
    it the cosine stays at ``end`` where torch's rises again, as ``cosine`` documents."""
    assert "torch's rises again after; this one stays at ``end``" in " ".join(
        (schedules.cosine.__doc__ or "").split()
    )
    lr, warm, length, per_epoch, epochs = 0.5, 2, 5, 3, 10
    ours = schedules.per_epoch(
        schedules.sequential(
            [schedules.linear_warmup(lr, warm, init=0.01 * lr), schedules.cosine(lr, length)],
            [warm],
        ),
        per_epoch,
    )
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    first = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warm)
    main = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=length)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [first, main], milestones=[warm])
    for epoch in range(epochs):
        got = [float(ours(torch.tensor(epoch * per_epoch + i))) for i in range(per_epoch)]
        want = opt.param_groups[0]["lr"]
        if epoch <= warm + length:
            assert got == pytest.approx([want] * per_epoch, rel=(epoch + 1) * 2**-52, abs=0)
        else:
            assert got == [0.0] * per_epoch and want > 0.0  # torch's cosine rises again
        opt.step()
        sched.step()


def test_a_checkpoint_without_the_target_network_warns_and_keeps_the_template() -> None:
    """A checkpoint written before Frozen members were saved: not silent."""
    saved = fasttorch.Models.create(a=trained())
    template = target(lin())
    with pytest.warns(UserWarning, match=r"holds no Frozen members.*\['t'\] keep the template"):
        loaded, _ = saved_then_loaded(saved, template)
    for k, v in template["t"].tensors.items():
        torch.testing.assert_close(loaded["t"].tensors[k], v, **EXACT)


# --------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_loss_bypassing_apply_is_refused(mode: str) -> None:
    copied = copy.deepcopy(lin())

    def bypass(apply: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((copied(x) - y) ** 2).mean()

    step = fasttorch.step(bypass)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    with pytest.raises(ValueError, match=r"reached none of the state's parameters.*apply\(x\)"):
        step(trained(), BATCH)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_an_error_in_the_loss_leaves_the_donated_state_usable(mode: str) -> None:
    """The user's own exception and message; then the same state trains on, equal to a
    state that never met the error (rule 1)."""

    def typo(apply: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        if x.shape[0] == 4:  # a shape: known while tracing
            raise KeyError("lables")
        return mse(apply, batch)

    def wrap(loss_fn: Any) -> fasttorch.Step:
        s = fasttorch.step(loss_fn)  # donates, eagerly
        return fasttorch.compiled(s, backend="aot_eager") if mode == "compiled" else s

    state, fresh = trained(), trained()
    with pytest.raises(KeyError, match="lables"):
        wrap(typo)(state, BATCH)
    good = wrap(mse)
    state, _ = good(state, BATCH)
    fresh, _ = S(fresh, BATCH)
    for k, v in fresh.params.items():
        torch.testing.assert_close(state.params[k], v, **EXACT)
