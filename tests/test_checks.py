"""Argument checks: bad numbers, bools for numbers and numbers for bools, typos and
misuse are refused where the mistake is made, with the API, the argument, what was
given and what is valid in the message; the state given to a step is not consumed."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from reference import LayerNormNet, batches, mse

import fasttorch
from fasttorch import _checks, optim, schedules
from fasttorch.loop import EarlyStopping, every, until

HUGE = 10**400  # an int no float holds


def _state(opt=None):
    torch.manual_seed(0)
    return fasttorch.TrainState.create(LayerNormNet(), opt or optim.sgd(0.1))


def test_real_count_and_flag():
    assert _checks.real("api", "x", 3) == 3.0 and type(_checks.real("api", "x", 3)) is float
    assert _checks.real("api", "x", float("inf"), finite=False) == float("inf")
    for bad in (True, "1.0", None, 1j):
        with pytest.raises(TypeError, match=r"api: x must be a number .* got"):
            _checks.real("api", "x", bad)
    with pytest.raises(ValueError, match=r"api: x must be finite and >= 0, got x=-1\.5"):
        _checks.real("api", "x", -1.5, low=0.0)
    with pytest.raises(ValueError, match=r"finite and > 0 and < 1, got x=1\b"):
        _checks.real("api", "x", 1, low=0.0, low_open=True, high=1.0, high_open=True)
    with pytest.raises(ValueError, match="x must be finite, got x=nan"):
        _checks.real("api", "x", float("nan"))
    with pytest.raises(ValueError, match=r"\(401 characters\), too large for a float") as info:
        _checks.real("api", "x", HUGE)
    assert len(str(info.value)) < 200  # not 400 digits
    assert _checks.count("api", "n", 2) == 2
    for bad in (True, 2.0, "2"):
        with pytest.raises(TypeError, match=r"n must be an integer >= 1, got"):
            _checks.count("api", "n", bad)
    with pytest.raises(ValueError, match=r"n must be an integer >= 0, got -1"):
        _checks.count("api", "n", -1, low=0)
    assert _checks.flag("api", "on", False) is False
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="api: on must be a bool"):
            _checks.flag("api", "on", bad)
    # A wrong type is also a ValueError: callers that caught ValueError keep working.
    assert issubclass(_checks.ArgumentTypeError, ValueError)


def test_a_check_can_word_what_is_valid_in_its_own_terms():
    # rule= / kind= replace the generated wording, never the bounds that are checked.
    with pytest.raises(ValueError, match=r"^ema: decay must be in \[0, 1\), got decay=1\.0\.$"):
        _checks.real("ema", "decay", 1.0, low=0.0, high=1.0, high_open=True, rule="in [0, 1)")
    assert _checks.real("ema", "decay", 0.5, high=1.0, high_open=True, rule="in [0, 1)") == 0.5
    with pytest.raises(ValueError, match=r"k must be an integer >= 1, or None, got 0 of type int"):
        _checks.count("api", "k", 0, kind="an integer >= 1, or None")
    with pytest.raises(TypeError, match=r"k must be an integer >= 1, or None, got 1\.5"):
        _checks.count("api", "k", 1.5, kind="an integer >= 1, or None")
    assert [_checks.is_real(v) for v in (1, 2.5, True, "1", None)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert [_checks.is_int(v) for v in (1, 2.0, False, "1")] == [True, False, False, False]


def test_warn_once_lives_in_checks_and_steps_keeps_its_name():
    from fasttorch import steps

    assert steps.warn_once is _checks.warn_once


PACKAGE = Path(fasttorch.__file__).resolve().parent


def _trees() -> dict[str, ast.Module]:
    return {
        f.relative_to(PACKAGE.parent).as_posix(): ast.parse(f.read_text())
        for f in sorted(PACKAGE.rglob("*.py"))
    }


def test_every_module_takes_warn_once_from_checks():
    # A module that needs only warn_once should not import the step machinery for it.
    elsewhere = [
        f"{path}:{node.lineno} (from {node.module})"
        for path, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and any(a.name == "warn_once" for a in node.names)
        and node.module != "fasttorch._checks"
    ]
    assert not elsewhere


def _isinstance_of(node: ast.expr) -> tuple[str, set[str]] | None:
    """``("x", {"int", "float"})`` for ``isinstance(x, (int, float))``, else None."""
    if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance"):
        return None
    target, types = node.args
    names = types.elts if isinstance(types, ast.Tuple) else [types]
    return ast.unparse(target), {ast.unparse(t) for t in names}


def test_number_checks_are_the_shared_ones():
    # `isinstance(x, bool) or not isinstance(x, int)`, and its variants, written by
    # hand: the rule "a number, not a bool" lives in _checks (real, count, is_real, is_int).
    found = []
    for path, tree in _trees().items():
        if path == "fasttorch/_checks.py":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.BoolOp):
                continue
            tests = [
                _isinstance_of(v.operand if isinstance(v, ast.UnaryOp) else v) for v in node.values
            ]
            # (a JSON scalar check, isinstance(x, (bool, int, str)), accepts bools: not one)
            subjects = {t[0] for t in tests if t and t[1] == {"bool"}}
            numeric = {t[0] for t in tests if t and t[1] & {"int", "float"} and "bool" not in t[1]}
            if subjects & numeric:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)[:60]}")
    assert not found, found


def test_the_scan_finds_a_hand_written_number_check():
    tree = ast.parse("if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 1: pass")
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.BoolOp)]
    assert _isinstance_of(node.values[0]) == ("n", {"bool"})
    assert _isinstance_of(node.values[1].operand) == ("n", {"int", "float"})


BAD_ARGUMENTS: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("donate='no'", lambda: fasttorch.step(mse, donate="no"), TypeError, "donate must be"),
    ("cosine(-1)", lambda: schedules.cosine(-1.0, 10), ValueError, r"peak must be .*>= 0"),
    ("constant(-1)", lambda: schedules.constant(-0.1), ValueError, "value must be"),
    ("warmup_init", lambda: schedules.linear_warmup(1.0, 3, init=-1.0), ValueError, "init"),
    ("cosine_end", lambda: schedules.cosine(1.0, 3, end=-1.0), ValueError, "end must"),
    ("step_decay", lambda: schedules.step_decay(-1.0, 3), ValueError, "init must"),
    (
        "warmup(init)",
        lambda: schedules.warmup(2, schedules.constant(1.0), init=-1),
        ValueError,
        "Warmup: init must",
    ),
    (
        "init_scale",
        lambda: fasttorch.with_amp(fasttorch.step(mse), "fp16", init_scale=True),
        TypeError,
        "init_scale must be a number",
    ),
    (
        "growth_interval",
        lambda: fasttorch.with_amp(fasttorch.step(mse), "fp16", growth_interval="10"),
        TypeError,
        "growth_interval must be an integer",
    ),
    (
        "nesterov",
        lambda: optim.sgd(0.1, momentum=0.9, nesterov="yes"),
        TypeError,
        "nesterov must be a bool",
    ),
    (
        "clip_scaled",
        lambda: fasttorch.clip_scaled(fasttorch.step(mse), HUGE),
        ValueError,
        "max_norm .* too large",
    ),
    (
        "scale_loss",
        lambda: fasttorch.scale_loss(fasttorch.step(mse), HUGE),
        ValueError,
        "factor .* too large",
    ),
    ("sgd(lr)", lambda: optim.sgd(HUGE), ValueError, "lr .* too large"),
    ("adamw(eps)", lambda: optim.adamw(1e-3, eps=-HUGE), ValueError, "eps .* too large"),
    (
        "set_hyperparams",
        lambda: optim.set_hyperparams(_state().opt_state, lr=HUGE),
        ValueError,
        "set_hyperparams: lr .* too large",
    ),
    ("linear_warmup", lambda: schedules.linear_warmup(HUGE, 3), ValueError, "peak .* too large"),
    (
        "seed",
        lambda: fasttorch.TrainState.create(LayerNormNet(), optim.sgd(0.1), seed=2**70),
        ValueError,
        r"seed=.* does not fit in 64 bits",
    ),
    ("until(start)", lambda: until(3, start="a"), TypeError, "until: start must be an integer"),
    ("until(max_seconds)", lambda: until(max_seconds="1"), TypeError, "max_seconds must be"),
    ("every", lambda: every(True), TypeError, "every: k must be an integer"),
    ("EarlyStopping", lambda: EarlyStopping(2, min_delta="0"), TypeError, "min_delta must"),
    (
        "compiled(mode)",
        lambda: fasttorch.compiled(fasttorch.step(mse), mode="reduce-overheed"),
        ValueError,
        r"unknown mode='reduce-overheed'.*'reduce-overhead'",
    ),
    (
        "compiled(backend)",
        lambda: fasttorch.compiled(fasttorch.step(mse), backend="inductr"),
        ValueError,
        r"unknown backend='inductr'.*'inductor'",
    ),
    (
        "compiled(fn, backend)",
        lambda: fasttorch.compiled(lambda s, b: (s, {}), backend="eagr"),
        ValueError,
        "unknown backend",
    ),
    (
        "compiled(fullgraph)",
        lambda: fasttorch.compiled(fasttorch.step(mse), fullgraph="no"),
        TypeError,
        "fullgraph must be a bool",
    ),
    (
        "with_phases typo",
        lambda: fasttorch.step(mse).with_phases("mine", updat=None),
        TypeError,
        r"'updat', which is not a phase .* valid names are loss, grad, update",
    ),
]


@pytest.mark.parametrize(
    ("build", "kind", "words"),
    [case[1:] for case in BAD_ARGUMENTS],
    ids=[case[0] for case in BAD_ARGUMENTS],
)
def test_bad_arguments_are_refused_where_given(build, kind, words):
    with pytest.raises(kind, match=words):
        build()


@pytest.mark.parametrize(
    ("weight", "kind", "words"),
    [
        (-1, ValueError, r"Loss.weight must be finite and >= 0, got Loss.weight=-1"),
        ("abc", TypeError, r"Loss.weight must be a number .* got 'abc'"),
    ],
)
def test_a_loss_weight_that_is_no_count_is_refused(weight, kind, words):
    def loss_fn(apply, batch):
        return fasttorch.Loss(mse(apply, batch), weight=weight)

    step = fasttorch.grad_accumulate(fasttorch.step(loss_fn, donate=False), 2)
    with pytest.raises(kind, match=words):
        step(_state(), batches(1, 8)[0])


def test_an_update_returning_only_the_state_gets_an_error_naming_the_contract():
    step = fasttorch.step(mse, donate=False)
    inner = step.update
    bad = step.with_phases("mine", update=lambda state, g: inner(state, g)[0])
    with pytest.raises(
        TypeError, match=r"update phase returned a TrainState.*\(new_state, metrics\)"
    ):
        bad(_state(), batches(1, 8)[0])


def test_a_swapped_optimizer_is_refused_before_the_state_is_given_to_the_step():
    state = _state(optim.sgd(0.1)).replace(optimizer=optim.adamw(1e-3))
    with pytest.raises(ValueError, match=r"does not belong to its optimizer Adam.*opt_state=new"):
        fasttorch.step(mse)(state, batches(1, 8)[0])
    assert len(state.params) > 0  # alive (a donated state raises): it was never taken
    fixed = state.replace(opt_state=state.optimizer.init(state.params))
    new, _ = fasttorch.step(mse)(fixed, batches(1, 8)[0])
    assert int(new.step) == 1


def test_states_compare_and_hash_by_identity():
    a, b = _state(), _state()
    assert a == a and a != b and hash(a) == hash(a)
    assert len({a, b, a}) == 2
    assert a.opt_state == a.opt_state and a.opt_state != b.opt_state
