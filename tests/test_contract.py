"""The cross-cutting contract: every fasttorch transform through the same fasttorch.testing checks.

Each case is one transform (or the plain step) run by ``check_step``: pure, dtype kept,
composes with the other transforms, compiles with no graph break and no recompile, no
host sync eager or compiled, and, where a plain-PyTorch loop is written, equal to it.
"""

from __future__ import annotations

import pytest
import torch
from reference import BatchNormNet, batches, mse, reference_run
from tolerance import fp32_reference_error, params_atol

import fasttorch
from fasttorch.testing import CHECKS, assert_states_close, check_step, forbid_host_sync

DATA = batches(4, 8)
LR = 1e-2


def tiny():
    """Few ops, so each case's compiles stay cheap."""
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _model(model_cls=tiny):
    torch.manual_seed(0)
    return model_cls()


def _factory(model_cls=tiny, opt=lambda: fasttorch.optim.adamw(LR)):
    def make():
        return fasttorch.TrainState.create(_model(model_cls), opt())

    return make


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _windows(data, n):
    windows = [list(torch.utils._pytree.tree_map(lambda t: t.tensor_split(n), b)) for b in data]
    return [list(zip(*w)) for w in windows]


def _ref(precision="fp32", clip=None, n=1, ema_decay=None):
    """The hand-written loop (tests/reference.py) over windows of n microbatches."""

    def run(model, data):
        trained, _ = reference_run(
            model, _windows(data, n), make_opt=_adamw, precision=precision, clip=clip
        )
        return trained

    def atol():
        """Rule 2 (+ rule 4 in fp16), tests/README.md: the fp32 loop's own error here.
        An average of parameters (ema) is within the parameters' bound."""
        model = _model()
        errors = fp32_reference_error(model, _windows(DATA, n), make_opt=_adamw, clip=clip)
        params = dict(model.named_parameters())
        return params_atol(errors, params, precision=precision, steps=len(DATA), lr=LR)

    run.atol = atol
    return run


def _cases():
    s = fasttorch.step(mse)
    cases = {
        "plain": (s, _ref()),
        "with_amp_bf16": (fasttorch.with_amp(s, "bf16"), None),
        "with_amp_fp16": (fasttorch.with_amp(s, "fp16"), _ref("fp16")),
        "grad_accumulate_within": (fasttorch.grad_accumulate(s, 2), _ref(n=2)),
        "grad_accumulate_across": (fasttorch.grad_accumulate(s, 2, across_calls=True), None),
        "clip_scaled": (fasttorch.clip_scaled(s, 0.5), _ref(clip=0.5)),
        "ema": (fasttorch.ema(s, 0.9, warmup=10.0), _ref()),
        "compiled_chain": (
            fasttorch.compiled(
                fasttorch.ema(
                    fasttorch.clip_scaled(
                        fasttorch.grad_accumulate(fasttorch.with_amp(s, "fp16"), 2), 1.0
                    ),
                    0.9,
                ),
                backend="aot_eager",
            ),
            _ref("fp16", clip=1.0, n=2),
        ),
    }
    if hasattr(fasttorch, "skip_nonfinite"):
        cases["skip_nonfinite"] = (fasttorch.skip_nonfinite(s), _ref())
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_every_transform_keeps_the_contract(name):
    step, reference = CASES[name]
    atol = reference.atol() if reference is not None else 0.0
    report = check_step(step, _factory(), DATA, reference=reference, rtol=0, atol=atol)
    assert set(report) == set(CHECKS)
    ran = {k for k, v in report.items() if v == "ok"}
    assert {"pure", "dtype", "compiles", "no_host_sync"} <= ran, report
    assert ("reference" in ran) == (reference is not None), report
    if name != "compiled_chain":
        assert report["composes"] == "ok", report


def test_batchnorm_buffers_and_a_custom_callable():
    """A step built from the phases is checked as a callable, BatchNorm buffers included.

    The grad phase lets BatchNorm update its running statistics in place (the driver
    clones them first when it does not donate); a custom step must do the same, and
    the purity check catches one that does not.
    """
    base = fasttorch.step(mse, donate=False)

    def careless(state, batch):
        return base.update(state, base.grad(base.loss, state, batch, 1.0))

    with pytest.raises(AssertionError, match=r"pure.*\.buffers\['bn.running_mean'\]"):
        check_step(careless, _factory(BatchNormNet), DATA, checks=("pure",))

    def custom(state, batch):
        state = state.replace(buffers={k: b.clone() for k, b in state.buffers.items()})
        return base.update(state, base.grad(base.loss, state, batch, 1.0))

    report = check_step(custom, _factory(BatchNormNet), DATA, checks=("pure", "dtype", "composes"))
    assert report["composes"].startswith("skipped: not a fasttorch.Step")
    assert report["pure"] == report["dtype"] == "ok"


def test_profiled_compiled_step(tmp_path):
    fast = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    prof = fasttorch.profiled(fast, dir=tmp_path, wait=0, warmup=1, active=1)
    report = check_step(prof, _factory(), DATA, checks=("dtype", "no_host_sync"))
    assert report == {"dtype": "ok", "no_host_sync": "ok"}
    assert list(tmp_path.glob("*.pt.trace.json"))
    unprofiled = fasttorch.profiled(fasttorch.step(mse), dir=tmp_path)
    assert check_step(unprofiled, _factory(), DATA, checks=("compiles",)) == {
        "compiles": "skipped: profiled(step) cannot be compiled; check profiled(compiled(step))"
    }


def test_the_checks_catch_broken_steps():
    s = fasttorch.step(mse, donate=False)

    def syncs(state, batch):
        new, m = s(state, batch)
        if m["loss"] > 0:  # a host sync
            m["loss"] = m["loss"] * 1
        return new, m

    with pytest.raises(AssertionError, match=r"check_step\[no_host_sync\].*Tensor.__bool__"):
        check_step(syncs, _factory(), DATA, checks=("no_host_sync",))

    def impure(state, batch):
        new, m = s(state, batch)
        state.params["2.bias"].add_(1.0)
        return new, m

    with pytest.raises(AssertionError, match=r"check_step\[pure\].*\.params\['2.bias'\]"):
        check_step(impure, _factory(), DATA, checks=("pure",))

    def widens(state, batch):
        new, m = s(state, batch)
        return new.replace(params={k: v.double() for k, v in new.params.items()}), m

    with pytest.raises(
        AssertionError, match=r"check_step\[dtype\].*torch.float64.*was torch.float32"
    ):
        check_step(widens, _factory(), DATA, checks=("dtype",))

    def breaks(apply, batch):
        torch._dynamo.graph_break()
        return mse(apply, batch)

    with pytest.raises(Exception, match="(?i)graph.break"):
        check_step(fasttorch.step(breaks), _factory(), DATA, checks=("compiles",))

    with pytest.raises(AssertionError, match=r"check_step\[reference\].*the reference loop"):
        check_step(s, _factory(), DATA, checks=("reference",), reference=_ref(clip=0.01))

    with pytest.raises(ValueError, match="unknown checks"):
        check_step(s, _factory(), DATA, checks=("fast",))


def test_assert_states_close_names_the_leaf():
    state = _factory()()
    assert_states_close(state, state.replace(), rtol=0, atol=0)
    other = state.replace(params={**state.params, "0.bias": state.params["0.bias"] + 1})
    with pytest.raises(AssertionError, match=r"states differ at \.params\['0.bias'\]"):
        assert_states_close(state, other)
    with pytest.raises(AssertionError, match="only in the second"):
        assert_states_close(state, state.replace(substates={"x": torch.zeros(())}))
    with forbid_host_sync(), pytest.raises(AssertionError, match="Tensor.item"):
        torch.ones(()).item()
