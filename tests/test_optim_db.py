"""``from_torch`` on torch's own optimizer test database, case by case.

``torch.testing._internal.common_optimizers.optim_db`` holds an ``OptimizerInfo`` per
``torch.optim`` class; its ``optim_inputs_func(device="cpu")`` gives every hyperparameter
combination torch tests on a CPU. Each input runs here as given and with each of the
class's switches (``foreach``; ``fused`` where torch has a CPU kernel; ``capturable``
where the class takes it; ``differentiable``) set to False and to True, fp32. A new torch
release brings its own inputs: this module checks them without an edit.

Each case is, eagerly on a CPU, either equal to torch's loop (``torch.optim.X(...)``,
``step()`` on a deep copy of the model, the same batches) bit for bit
(tests/tolerance.py's rule 1: ``from_torch`` calls the same torch kernel with the same
numbers), or refused when the optimizer is built, with one of the reasons listed in
``REFUSALS``. One input per class also runs compiled (``backend="aot_eager"``) against
``torch.compile`` of torch's own step with ``capturable=True`` and a tensor lr, the
kernel ``from_torch`` traces: rule 2 there, as the gradients come from the compiled
backward (``FACTOR`` x the fp32 loop's own error against float64, measured here).
Adam, AdamW, Adamax, NAdam and RAdam trace torch's default (non-capturable) form
instead, its host arithmetic in float64 tensors: compiled, every input torch runs
without ``capturable`` or ``fused`` (as given, and with ``foreach=True``) equals torch's
eager loop with those flags bit for bit (rule 1: aot_eager runs eager's kernels, the
backward included), except NAdam and RAdam with ``foreach=True`` (rule 2, at the test).
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from reference import batches, mse, reference_run
from tolerance import EXACT, fp32_reference_error, params_atol
from torch import nn

import fasttorch
from fasttorch import optim
from fasttorch.optim._torch_algorithms import ALGORITHMS, REFUSED


def _load_optim_db() -> list[Any]:
    """torch's ``optim_db``, imported without leaving torch's test setup behind.

    Its module imports ``expecttest`` (a test dependency of torch, not of fasttorch):
    a stub module satisfies that import. Importing torch's test utilities freezes
    ``torch.backends`` flags (``disable_global_flags``) and wraps TorchScript calls for
    its profiler: both are put back, so the rest of the suite runs as without it.
    """
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stub = types.ModuleType("expecttest")
            stub.TestCase = type("TestCase", (), {})  # type: ignore[attr-defined]
            sys.modules["expecttest"] = stub
    frozen = torch.backends.flags_frozen()
    calls = (torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__)
    from torch.testing._internal.common_optimizers import optim_db

    if not frozen:
        # flags_frozen's own module globals (torch.backends is a wrapper module)
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
        assert not torch.backends.flags_frozen()
    torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = calls  # type: ignore[method-assign]
    return list(optim_db)


OPTIM_DB = _load_optim_db()
STEPS = 3
SWITCHES = ("foreach", "fused", "capturable", "differentiable")

# Why a case may be refused, as from_torch says it (searched in its message).
REFUSALS = {
    "needs a closure": "it re-evaluates the loss through a closure",
    "sparse gradients": "it updates from sparse gradients",
    "differentiable=True": r"differentiable=True",
    "capturable=True": r"capturable=True",
    "SGD momentum with dampening": "momentum with dampening",
}


@dataclass(frozen=True)
class Case:
    """One optim_db input with its switches, as a test parameter."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    desc: str

    @property
    def id(self) -> str:
        return re.sub(r"[^A-Za-z0-9_=.&-]+", "_", f"{self.cls.__name__}-{self.desc}")


def _switches(info: Any) -> tuple[str, ...]:
    """The switches the class's constructor takes that torch runs on a CPU."""
    accepted = inspect.signature(info.optim_cls.__init__).parameters
    out = []
    for k in SWITCHES:
        if k not in accepted:
            continue
        if k == "fused" and (
            "fused" not in info.supported_impls or "cpu" not in info.supports_fused_on
        ):
            continue
        out.append(k)
    return tuple(out)


def _cases() -> list[Case]:
    cases = []
    for info in OPTIM_DB:
        for inp in info.optim_inputs_func(device="cpu"):
            if inp.params is not None:  # its own parameter groups (none on a CPU in 2.13)
                continue
            cases.append(Case(info.optim_cls, dict(inp.kwargs), inp.desc))
            for k in _switches(info):
                for v in (False, True):
                    cases.append(
                        Case(info.optim_cls, {**inp.kwargs, k: v}, f"{inp.desc} & {k}={v}")
                    )
    return cases


CASES = _cases()


def _model(cls: type[torch.optim.Optimizer]) -> nn.Module:
    torch.manual_seed(0)
    bias = cls is not torch.optim.Muon  # Muon trains matrices only
    return nn.Sequential(nn.Linear(4, 5, bias=bias), nn.Tanh(), nn.Linear(5, 2, bias=bias))


def _data() -> list[Any]:
    return batches(STEPS, 6, d_in=4, d_out=2)


def _torch_loop(model: nn.Module, case: Case, data: list[Any]) -> nn.Module | Exception:
    """torch's eager loop on a deep copy, or the exception torch raised."""
    model = copy.deepcopy(model)
    try:
        opt = case.cls(model.parameters(), **_copy(case.kwargs))
        for batch in data:
            mse(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    except Exception as e:  # torch does not run this case on a CPU
        return e
    return model


def _copy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A tensor lr is the caller's: each side gets its own."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def outcome(case: Case) -> str:
    """``"equal"``, ``"refused: <reason>"`` or ``"different: <how>"`` for one case."""
    model, data = _model(case.cls), _data()
    try:
        opt = optim.from_torch(case.cls, **_copy(case.kwargs))
        state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    except (ValueError, TypeError) as e:
        for reason, pattern in REFUSALS.items():
            if re.search(pattern, str(e)):
                return f"refused: {reason}"
        return f"different: refused with an unlisted reason: {e}"
    ref = _torch_loop(model, case, data)
    if isinstance(ref, Exception):
        return f"different: accepted, but torch raises {type(ref).__name__}: {ref}"
    step = fasttorch.step(mse)
    try:
        for batch in data:
            state, _ = step(state, batch)
    except Exception as e:
        return f"different: raised in a step: {type(e).__name__}: {e}"
    for n, p in ref.named_parameters():
        if not torch.equal(state.params[n], p.detach()):
            diff = float((state.params[n] - p.detach()).abs().max())
            return f"different: {n} off by {diff:.3g}"
    return "equal"


def test_the_database_covers_every_class_from_torch_knows() -> None:
    """The cases below are torch's: each class fasttorch has a record (or a reason)
    for has inputs there, so none is checked by nothing."""
    names = {c.cls.__name__ for c in CASES}
    assert names == set(ALGORITHMS) | set(REFUSED)
    assert {c.cls.__name__ for c in COMPILED} == set(ALGORITHMS)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case_equals_torch_or_is_refused(case: Case) -> None:
    got = outcome(case)
    assert not got.startswith("different"), f"{case.kwargs}: {got}"


def _compiled_cases() -> list[Case]:
    """One input per class fasttorch runs: torch's last, which sets the most options."""
    out = []
    for info in OPTIM_DB:
        inputs = [i for i in info.optim_inputs_func(device="cpu") if i.params is None]
        if info.optim_cls.__name__ in ALGORITHMS and inputs:
            out.append(Case(info.optim_cls, dict(inputs[-1].kwargs), inputs[-1].desc))
    return out


COMPILED = _compiled_cases()


def _torch_compiled(case: Case) -> Any:
    """make_opt: torch's class with capturable=True (where it has it) and a tensor lr,
    its step under ``torch.compile``: what fasttorch's compiled step traces."""

    def make(params: Any) -> torch.optim.Optimizer:
        kw = _copy(case.kwargs)
        if "capturable" in inspect.signature(case.cls.__init__).parameters:
            kw["capturable"] = True
        lr = kw.get("lr", inspect.signature(case.cls.__init__).parameters["lr"].default)
        kw["lr"] = lr if isinstance(lr, torch.Tensor) else torch.tensor(lr)
        opt = case.cls(list(params), **kw)
        opt.step = torch.compile(opt.step, backend="aot_eager")  # type: ignore[method-assign]
        return opt

    return make


@pytest.mark.parametrize("case", COMPILED, ids=[c.id for c in COMPILED])
def test_compiled_case_equals_torch_compiled(case: Case) -> None:
    """Rule 2 (module docstring): FACTOR x the fp32 eager loop's own error, measured on
    this case, model and data against the same loop in float64."""
    model, data = _model(case.cls), _data()
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), optim.from_torch(case.cls, **_copy(case.kwargs))
    )
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    if ALGORITHMS[case.cls.__name__].eager_only:  # Adafactor: refused before tracing
        with pytest.raises(RuntimeError, match="cannot run in a compiled step: torch's"):
            step(state, data[0])
        return
    for batch in data:
        state, _ = step(state, batch)
    windows = [[b] for b in data]
    ref, _ = reference_run(model, windows, make_opt=_torch_compiled(case))
    errors = fp32_reference_error(
        model, windows, make_opt=lambda ps: case.cls(list(ps), **_copy(case.kwargs))
    )
    want = {n: p.detach() for n, p in ref.named_parameters()}
    bound = params_atol(errors, want)
    for n, p in state.params.items():
        torch.testing.assert_close(p, want[n], rtol=0.0, atol=bound, msg=lambda m, n=n: f"{n}: {m}")


TRACED = sorted(n for n, a in ALGORITHMS.items() if a.traced is not None)
# torch's _multi_tensor_nadam and _multi_tensor_radam order their arithmetic otherwise
# than the single-tensor forms (torch's two forms differ from each other in the last
# bits); the traced form is the single-tensor one, torch's CPU default: rule 2 against
# foreach=True (FACTOR x the fp32 loop's own error against float64, measured here).
FOREACH_REORDERED = {"NAdam", "RAdam"}


def _default_form_cases() -> list[Case]:
    """The inputs torch runs in its default (non-capturable) form, of each class whose
    default form from_torch traces: each as given and with ``foreach=True`` (the
    ``_multi_tensor_*`` form), and a tensor lr (torch computes with it in its dtype)."""
    out = []
    for c in CASES:
        if c.cls.__name__ not in TRACED or set(c.kwargs) & set(SWITCHES):
            continue
        out += [c, Case(c.cls, {**c.kwargs, "foreach": True}, f"{c.desc} & foreach=True")]
    tensor_lr = {"lr": torch.tensor(3e-4), "weight_decay": 0.1}
    out += [Case(getattr(torch.optim, n), tensor_lr, "tensor lr") for n in TRACED]
    return out


DEFAULT_FORM = _default_form_cases()


@pytest.mark.parametrize("case", DEFAULT_FORM, ids=[c.id for c in DEFAULT_FORM])
def test_compiled_default_form_equals_torch_bit_for_bit(case: Case) -> None:
    """Rule 1 (module docstring): the compiled step against ``torch.optim.X(**kwargs)``
    stepped eagerly, its default flags (no ``capturable``), on a deep copy."""
    model, data = _model(case.cls), _data()
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), optim.from_torch(case.cls, **_copy(case.kwargs))
    )
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    for batch in data:
        state, _ = step(state, batch)
    ref = _torch_loop(model, case, data)
    assert isinstance(ref, nn.Module), ref
    bound = EXACT
    if case.kwargs.get("foreach") and case.cls.__name__ in FOREACH_REORDERED:
        errors = fp32_reference_error(
            model, [[b] for b in data], make_opt=lambda ps: case.cls(list(ps), **_copy(case.kwargs))
        )
        want = {n: p.detach() for n, p in ref.named_parameters()}
        bound = {"rtol": 0.0, "atol": params_atol(errors, want)}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(
            state.params[n], p.detach(), **bound, msg=lambda m, n=n: f"{n}: {m}"
        )


class _Scaled(nn.Module):
    """A linear layer times a learned 0-d scale: a scalar parameter beside matrices."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.tensor(0.75))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", TRACED)
def test_compiled_default_form_with_a_scalar_parameter(name: str) -> None:
    """Rule 1. A 0-d parameter: beside it a float64 0-d tensor would promote where
    torch's Python float does not (the replicas round it first)."""
    cls, kwargs = getattr(torch.optim, name), {"weight_decay": 0.1}
    model, data = _Scaled(), _data()
    state = fasttorch.TrainState.create(copy.deepcopy(model), optim.from_torch(cls, **kwargs))
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    for batch in data:
        state, _ = step(state, batch)
    ref = _torch_loop(model, Case(cls, kwargs, "scalar parameter"), data)
    assert isinstance(ref, nn.Module), ref
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state.params[n], p.detach(), **EXACT, msg=lambda m, n=n: n)


if __name__ == "__main__":  # python tests/test_optim_db.py: the eager cases by outcome
    import collections

    counts = collections.Counter(outcome(c) for c in CASES)
    print(f"torch {torch.__version__}: {len(CASES)} cases")
    for what, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"{n:5d}  {what}")
