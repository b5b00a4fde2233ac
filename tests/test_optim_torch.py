"""from_torch, groups and load_torch_state_dict against torch.optim on a deep copy.

Tolerance rule. Eager on a CPU, fasttorch calls the same torch kernel as
``torch.optim.X.step()`` with the same numbers: the parameters must be equal bit for bit.
Compiled, Adam, AdamW, Adamax, NAdam and RAdam run torch's default form with its host
arithmetic in float64 tensors, and the graph (``aot_eager``) runs eager's kernels,
backward included: bit for bit with the eager loop again. The other classes run
torch's capturable kernel compiled (the only one that keeps the step count on the
device); their reference is torch's own optimizer with ``capturable=True`` and a tensor
lr, stepped by ``torch.compile(opt.step)``: the same kernel again, but the
gradients come from the compiled step's backward, which may round differently from the
eager one. Those comparisons take tests/tolerance.py's rule 2: ``FACTOR`` times the
fp32 loop's own error against the same loop in float64, measured here for the same
optimizer, model and data; with a half-precision forward, plus rule 4's
``steps * lr * u``.
"""

from __future__ import annotations

import copy
import fnmatch
import inspect
import re
from typing import Any

import pytest
import torch
from reference import LayerNormNet, assert_params_close, batches, mse, reference_run
from tolerance import EXACT, fp32_reference_error, params_atol
from torch import nn

import fasttorch
from fasttorch import optim
from fasttorch.optim._torch_algorithms import ALGORITHMS
from fasttorch.testing import forbid_host_sync

STEPS = 6
LR = 0.01
# The lr fasttorch's own optimizers hold (a float32 tensor), as a Python number for
# torch's loop; from_torch keeps the float's own value (LR).
LR32 = float(torch.tensor(LR))
FP16 = {"init_scale": 2.0**22, "growth_interval": 3}

# Each algorithm with some options off their defaults.
ALGOS: dict[str, dict[str, Any]] = {
    "Adam": {"betas": (0.8, 0.99), "weight_decay": 0.01},
    "AdamW": {"weight_decay": 0.1, "amsgrad": True},
    "SGD": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "RMSprop": {"momentum": 0.5, "centered": True},
    "Adagrad": {"lr_decay": 0.01, "initial_accumulator_value": 0.1},
    "Adadelta": {"rho": 0.8},
    "Adamax": {"weight_decay": 0.01},
    "NAdam": {"decoupled_weight_decay": True, "weight_decay": 0.01},
    "RAdam": {},
    "ASGD": {"t0": 3},
    "Rprop": {"etas": (0.4, 1.1)},
    "Adafactor": {"weight_decay": 0.01},
    "Muon": {"momentum": 0.9},
}
COMPILABLE = sorted(set(ALGOS) - {"Adafactor"})  # Adafactor reads norms with .item()


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = LayerNormNet()
    if name == "Muon":  # Muon trains matrices only
        for p in model.parameters():
            p.requires_grad_(p.ndim == 2)
    return model


def _torch_opt(name: str, *, compiled: bool = False, **extra: Any) -> Any:
    """make_opt for reference_run: torch.optim.X, capturable and compiled if asked."""
    cls = getattr(torch.optim, name)

    def make(params: Any) -> torch.optim.Optimizer:
        kw = {**ALGOS[name], **extra}
        if compiled and "capturable" in inspect.signature(cls.__init__).parameters:
            kw["capturable"] = True
        lr = torch.tensor(LR) if compiled else LR
        opt = cls([p for p in params if p.requires_grad], lr=lr, **kw)
        if compiled:
            opt.step = torch.compile(opt.step, backend="aot_eager")  # type: ignore[method-assign]
        return opt

    return make


def _run(state: fasttorch.TrainState, step: Any, data: list[Any]) -> fasttorch.TrainState:
    for batch in data:
        state, _ = step(state, batch)
    return state


def _assert_close(
    state: fasttorch.TrainState,
    model: nn.Module,
    precision: str,
    *,
    errors: dict[str, float],
) -> None:
    """The trained parameters within rule 2's bound from ``errors`` (the fp32 loop's
    own, :func:`_errors`), plus rule 4's for a half-precision forward."""
    ref = {n: p.detach() for n, p in model.named_parameters() if n in state.params}
    bound = params_atol(errors, ref, precision=precision, steps=STEPS, lr=LR)
    for n, p in state.params.items():  # the trained ones (Muon: the matrices)
        torch.testing.assert_close(p, ref[n], rtol=0.0, atol=bound, msg=lambda m, n=n: f"{n}: {m}")


_ERRORS: dict[Any, dict[str, float]] = {}


def _errors(name: str, windows: list[Any], clip: float | None = None) -> dict[str, float]:
    """Rule 2's measure: each parameter's error of the fp32 loop with torch.optim.``name``
    (eager) on ``windows`` against the same loop in float64 (memoized per case)."""
    key = (name, len(windows), len(windows[0]), windows[0][0][0].shape, clip)
    if key not in _ERRORS:
        _ERRORS[key] = fp32_reference_error(
            _model(name), windows, make_opt=_torch_opt(name), clip=clip
        )
    return _ERRORS[key]


def _loop_errors(
    model: nn.Module, data: list[Any], make_opt: Any, before: Any = None
) -> dict[str, float]:
    """Rule 2's measure for :func:`_plain_loop` (per-group options, lr changes): its
    fp32 run's error against the same loop in float64."""
    ref32 = dict(_plain_loop(model, data, make_opt, before).named_parameters())
    data64 = [tuple(t.double() if t.is_floating_point() else t for t in b) for b in data]
    model64 = copy.deepcopy(model).double()
    ref64 = dict(_plain_loop(model64, data64, make_opt, before).named_parameters())
    return {
        k: float((v.detach().double() - ref64[k].detach()).abs().max()) for k, v in ref32.items()
    }


def _assert_equal(state: fasttorch.TrainState, model: nn.Module) -> None:
    ref = dict(model.named_parameters())
    for n, p in state.params.items():
        assert torch.equal(p, ref[n].detach()), f"{n}: {(p - ref[n]).abs().max()}"


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_eager_is_torch_bit_for_bit(name: str) -> None:
    model = _model(name)
    data = batches(STEPS, 16)
    ref, _ = reference_run(model, [[b] for b in data], make_opt=_torch_opt(name))
    opt = optim.from_torch(getattr(torch.optim, name), LR, **ALGOS[name])
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    state = _run(state, fasttorch.step(mse), data)
    _assert_equal(state, ref)
    assert int(state.opt_state.count) == STEPS


@pytest.mark.parametrize("name", COMPILABLE)
def test_compiled_matches_torch_compiled(name: str) -> None:
    """fullgraph=True (compiled's default), no host sync after the first call. Adam and
    AdamW: torch's eager default loop bit for bit (module docstring)."""
    model = _model(name)
    data = batches(STEPS, 16)
    default_form = ALGORITHMS[name].traced is not None
    make_opt = _torch_opt(name, compiled=not default_form)
    ref, _ = reference_run(model, [[b] for b in data], make_opt=make_opt)
    opt = optim.from_torch(getattr(torch.optim, name), LR, **ALGOS[name])
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    state = _run(state, step, data[:1])
    with forbid_host_sync():
        state = _run(state, step, data[1:])
    if default_form:
        _assert_equal(state, ref)
        return
    _assert_close(state, ref, "fp32", errors=_errors(name, [[b] for b in data]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["AdamW", "RMSprop", "NAdam", "Rprop"])
def test_cuda_eager_is_capturable_and_sync_free(name: str) -> None:
    """On an accelerator the eager update is torch's capturable kernel: no sync at all."""
    model = _model(name).cuda()
    data = [tuple(t.cuda() for t in b) for b in batches(STEPS, 16)]
    cls = getattr(torch.optim, name)
    ref = copy.deepcopy(model)
    ref_opt = cls(
        ref.parameters(), lr=torch.tensor(LR, device="cuda"), capturable=True, **ALGOS[name]
    )
    for batch in data:
        mse(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), optim.from_torch(cls, LR, **ALGOS[name])
    )
    step = fasttorch.step(mse)
    state = _run(state, step, data[:1])
    with forbid_host_sync("cuda"):
        state = _run(state, step, data[1:])
    cpu_data = [[b] for b in batches(STEPS, 16)]  # rule 2's error, measured on the CPU
    _assert_close(state, ref, "fp32", errors=_errors(name, cpu_data))


def test_changing_lr_does_not_recompile() -> None:
    model = _model("RAdam")
    opt = optim.from_torch(torch.optim.RAdam, LR)
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    data = batches(4, 16)
    state = _run(state, step, data[:2])
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    state = state.replace(opt_state=optim.set_hyperparams(state.opt_state, lr=0.5))
    state = _run(state, step, data[2:])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert float(state.opt_state.hyper["lr"]) == 0.5


def _composed(precision: str, mode: str) -> Any:
    s = fasttorch.with_amp(fasttorch.step(mse), precision, **(FP16 if precision == "fp16" else {}))
    s = fasttorch.clip_scaled(fasttorch.grad_accumulate(s, 2), 1.0)
    return fasttorch.compiled(s, backend="aot_eager") if mode == "compiled" else s


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(ALGOS))
def test_composed_with_amp_accumulation_clip(name: str, precision: str) -> None:
    _check_composed(name, precision, "eager")


@pytest.mark.parametrize("name, precision", [("AdamW", "fp16"), ("RMSprop", "bf16")])
def test_composed_compiled(name: str, precision: str) -> None:
    _check_composed(name, precision, "compiled")


def _check_composed(name: str, precision: str, mode: str) -> None:
    model = _model(name)
    data = batches(STEPS, 32)
    windows = [list(zip(x.tensor_split(2), y.tensor_split(2))) for x, y in data]
    ref, _ = reference_run(
        model,
        windows,
        make_opt=_torch_opt(name, compiled=mode == "compiled"),
        precision=precision,
        clip=1.0,
        scaler_kwargs=FP16 if precision == "fp16" else None,
    )
    opt = optim.from_torch(getattr(torch.optim, name), LR, **ALGOS[name])
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    state = _run(state, _composed(precision, mode), data)
    _assert_close(state, ref, precision, errors=_errors(name, windows, clip=1.0))


def test_fused_adamw_is_an_optimizer_choice() -> None:
    model = _model("AdamW")
    data = batches(STEPS, 16)
    ref, _ = reference_run(model, [[b] for b in data], make_opt=_torch_opt("AdamW", fused=True))
    opt = optim.from_torch(torch.optim.AdamW, LR, **ALGOS["AdamW"], fused=True)
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    with forbid_host_sync():  # the fused kernel takes the step count and lr as tensors
        state = _run(state, fasttorch.step(mse), data)
    _assert_equal(state, ref)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_fused_runs_outside_the_graphs_of_a_compiled_cpu_step(name: str) -> None:
    """``fused=True`` (torch's fused kernel, which torch does not let a compiler trace):
    a compiled CPU step that donates its state compiles the window's microbatch only
    and runs torch's fused kernel after it, as the eager step does: the eager step's
    bits (rule 1), with the update in no graph."""
    model, data = _model(name), batches(STEPS, 32)
    opt = optim.from_torch(getattr(torch.optim, name), LR, **ALGOS[name], fused=True)
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def composed() -> fasttorch.Step:
        return fasttorch.clip_scaled(fasttorch.grad_accumulate(fasttorch.step(mse), 2), 1.0)

    eager = _run(fasttorch.TrainState.create(copy.deepcopy(model), opt), composed(), data)
    fast = fasttorch.compiled(composed(), backend=keep)
    state = _run(fasttorch.TrainState.create(copy.deepcopy(model), opt), fast, data)
    assert len(graphs) == 1  # the microbatch's
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert not any("fused" in t for t in targets), targets
    for n, p in eager.params.items():
        torch.testing.assert_close(state.params[n], p, **EXACT)


def test_a_fused_group_runs_the_whole_update_outside_the_graphs() -> None:
    """In ``groups``, one ``fused=True`` member is enough: the compiled CPU step runs
    the whole update outside its graphs, each group's own kernel, the eager step's
    bits."""
    model, data = _model("AdamW"), batches(STEPS, 32)
    fused = optim.from_torch(torch.optim.AdamW, LR, fused=True)
    opt = optim.groups(optim.sgd(LR, momentum=0.9, opaque=False), [("*.weight", fused)])
    assert opt.update_outside_graphs and not opt.in_place_in_graph
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    step = fasttorch.grad_accumulate(fasttorch.step(mse), 2)
    eager = _run(fasttorch.TrainState.create(copy.deepcopy(model), opt), step, data)
    fast = fasttorch.compiled(fasttorch.grad_accumulate(fasttorch.step(mse), 2), backend=keep)
    state = _run(fasttorch.TrainState.create(copy.deepcopy(model), opt), fast, data)
    assert len(graphs) == 1
    for n, p in eager.params.items():
        torch.testing.assert_close(state.params[n], p, **EXACT)


def test_fused_refuses_a_step_that_would_trace_it_with_its_reason() -> None:
    """Where the update would be traced (``donate=False``; on a GPU), torch's refusal
    of its fused kernels in a graph is said in plain words."""
    opt = optim.from_torch(torch.optim.AdamW, LR, fused=True)
    state = fasttorch.TrainState.create(_model("AdamW"), opt)
    step = fasttorch.compiled(fasttorch.step(mse, donate=False), backend="aot_eager")
    with pytest.raises(Exception, match="torch.compiler.disable"):
        step(state, batches(1, 4)[0])
    with pytest.raises(RuntimeError, match="only on a CPU, in a step that donates"):
        opt.check_compilable()


def test_schedule_as_lr() -> None:
    sched = fasttorch.schedules.warmup(2, fasttorch.schedules.cosine(0.05, 4), init=0.0)
    model = _model("NAdam")
    data = batches(STEPS, 16)
    lrs = [float(sched(torch.tensor(i))) for i in range(STEPS)]
    ref, _ = reference_run(
        model,
        [[b] for b in data],
        make_opt=lambda ps: torch.optim.NAdam(list(ps), lr=lrs[0]),
        lr_at=lambda i: lrs[i],
    )
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), optim.from_torch(torch.optim.NAdam, sched)
    )
    assert "lr" not in state.opt_state.hyper
    state = _run(state, fasttorch.step(mse), data)
    _assert_equal(state, ref)


def test_schedule_as_lr_compiled() -> None:
    """A schedule as lr, compiled: torch's eager default NAdam with its lr set to the
    schedule's value every step, bit for bit (module docstring)."""
    sched = fasttorch.schedules.warmup(2, fasttorch.schedules.cosine(0.05, 4), init=0.0)
    model = _model("NAdam")
    data = batches(STEPS, 16)

    def set_lr(k: int, opt: Any) -> None:
        opt.param_groups[0]["lr"] = float(sched(torch.tensor(k)))

    ref = _plain_loop(
        model, data, lambda named: torch.optim.NAdam([p for _, p in named], lr=0.0), set_lr
    )
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), optim.from_torch(torch.optim.NAdam, sched)
    )
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    state = _run(state, step, data[:1])
    with forbid_host_sync():
        state = _run(state, step, data[1:])
    _assert_equal(state, ref)


def test_state_round_trips_through_a_checkpoint(tmp_path: Any) -> None:
    model = _model("ASGD")
    opt = optim.from_torch(torch.optim.ASGD, LR, **ALGOS["ASGD"])
    step = fasttorch.step(mse, donate=False)
    data = batches(4, 16)
    state = _run(fasttorch.TrainState.create(copy.deepcopy(model), opt), step, data[:2])
    path = fasttorch.checkpoint.save(tmp_path, state)
    fresh = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    resumed, _ = fasttorch.checkpoint.load(path, fresh)
    a, b = _run(state, step, data[2:]), _run(resumed, step, data[2:])
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_refused_algorithms_say_why(cls: Any) -> None:
    with pytest.raises(ValueError, match="not supported: it"):
        optim.from_torch(cls)


def test_every_torch_optim_class_has_a_record_or_a_reason() -> None:
    # A class a new torch release adds fails here until it gets its record (or a reason).
    from fasttorch.optim._torch_algorithms import ALGORITHMS, REFUSED

    classes = {
        n
        for n, c in vars(torch.optim).items()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    }
    assert classes == set(ALGORITHMS) | set(REFUSED)
    assert set(ALGOS) == set(ALGORITHMS)  # the bit-for-bit tests check every record


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_an_optimizer_pickles_and_copies_with_its_record(name: str) -> None:
    # A TrainState keeps its optimizer as static configuration: copies and pickles of
    # it (spawned processes, deep copies of a state) carry the record's slot builder.
    import pickle

    opt = optim.from_torch(getattr(torch.optim, name), LR, **ALGOS[name])
    params = {"w": torch.ones(3, 2)}
    for again in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert again == opt
        got, want = again.init(params).slots, opt.init(params).slots
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k]["w"], want[k]["w"]) for k in want)


def test_adafactor_refuses_a_compiled_step_with_its_reason() -> None:
    state = fasttorch.TrainState.create(
        _model("Adafactor"), optim.from_torch(torch.optim.Adafactor, LR)
    )
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    # Refused before tracing, in its own words (not wrapped in the compiler's error).
    with pytest.raises(RuntimeError, match="reads the step count and parameter norms"):
        step(state, batches(1, 4)[0])


@pytest.mark.parametrize("given", ["instance", "class"])
def test_train_state_points_torch_optim_to_from_torch(given: str) -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters()) if given == "instance" else torch.optim.AdamW
    with pytest.raises(TypeError, match=r"from_torch\(torch.optim.AdamW"):
        fasttorch.TrainState.create(model, opt)  # type: ignore[arg-type]


def test_optimizer_is_hashable_static_configuration() -> None:
    a = optim.from_torch(torch.optim.Adam, betas=[0.8, 0.9])  # type: ignore[arg-type]
    b = optim.from_torch(torch.optim.Adam, betas=(0.8, 0.9))
    assert a == b and hash(a) == hash(b) and dict(a.group)["betas"] == (0.8, 0.9)
    assert a.replace(betas=[0.7, 0.9]).options == (("betas", (0.7, 0.9)),)


def test_bad_arguments() -> None:
    with pytest.raises(
        ValueError, match=r"capturable=True is not supported \(only False.*fasttorch chooses"
    ):
        optim.from_torch(torch.optim.Adam, capturable=True)
    with pytest.raises(
        ValueError, match=r"differentiable=True is not supported \(only.*it lets autograd"
    ):
        optim.from_torch(torch.optim.SGD, differentiable=True)
    with pytest.raises(ValueError, match="tensor lr must hold one floating-point value"):
        optim.from_torch(torch.optim.SGD, torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="not supported for capturable=False and foreach=True"):
        optim.from_torch(torch.optim.Adam, torch.tensor(0.1), foreach=True)  # torch's own rule
    with pytest.raises(ValueError, match="dampening"):
        optim.from_torch(torch.optim.SGD, momentum=0.9, dampening=0.1)
    with pytest.raises(TypeError, match="torch.optim class"):
        optim.from_torch(optim.adamw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid lr=-1.0"):
        optim.from_torch(torch.optim.Adam, -1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter"):  # torch's own check
        optim.from_torch(torch.optim.Adam, betas=(1.5, 0.9))


def test_no_op_switches_are_accepted() -> None:
    """capturable=False and differentiable=False are torch's defaults: accepted."""
    a = optim.from_torch(torch.optim.Adam, 0.1)
    b = optim.from_torch(torch.optim.Adam, 0.1, capturable=False, differentiable=False)
    assert dict(a.group) == dict(b.group)


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_default_lr_is_the_torch_class_default(name: str) -> None:
    cls = getattr(torch.optim, name)
    default = inspect.signature(cls.__init__).parameters["lr"].default
    opt = optim.from_torch(cls)
    assert opt.lr == default and dict(opt.group)["lr"] == default
    state = fasttorch.TrainState.create(_model(name), opt)
    assert state.opt_state.hyper["lr"].item() == default  # the float's own value


def test_float_lr_keeps_its_value_through_set_hyperparams() -> None:
    """lr=3e-4 is torch's 3e-4 (float64 holds every Python float), before and after
    set_hyperparams; eagerly the run is torch's with the same Python floats, bit for bit."""
    model = _model("Adam")
    data = batches(STEPS, 16)

    def change(k: int, opt: Any) -> None:
        if k == 3:
            opt.param_groups[0]["lr"] = 7e-5

    ref = _plain_loop(
        model, data, lambda named: torch.optim.Adam([p for _, p in named], lr=3e-4), change
    )
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), optim.from_torch(torch.optim.Adam, 3e-4)
    )
    assert state.opt_state.hyper["lr"].item() == 3e-4
    step = fasttorch.step(mse)
    for k, batch in enumerate(data):
        if k == 3:
            state = state.replace(opt_state=optim.set_hyperparams(state.opt_state, lr=7e-5))
            assert state.opt_state.hyper["lr"].item() == 7e-5
        state, metrics = step(state, batch)
    assert float(metrics["lr"]) == 7e-5
    _assert_equal(state, ref)


def test_tensor_lr_is_torchs_tensor_lr() -> None:
    """A tensor lr runs as torch runs one (its dtype, its value), and stays static
    configuration: equal optimizers hash alike."""
    model = _model("Adam")
    data = batches(STEPS, 16)
    lr = torch.tensor(3e-4)
    ref = _plain_loop(
        model, data, lambda named: torch.optim.Adam([p for _, p in named], lr=lr.clone())
    )
    opt = optim.from_torch(torch.optim.Adam, lr)
    assert opt == optim.from_torch(torch.optim.Adam, lr.clone()) and hash(opt) == hash(
        optim.from_torch(torch.optim.Adam, lr.clone())
    )
    assert opt != optim.from_torch(torch.optim.Adam, float(lr))  # a float is a float
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    assert state.opt_state.hyper["lr"].dtype == torch.float32
    _assert_equal(_run(state, fasttorch.step(mse), data), ref)


def test_per_parameter_rules_are_checked_when_the_state_is_created() -> None:
    """Muon on a model with 1-D parameters: torch's own error at create, not in step 1."""
    with pytest.raises(ValueError, match="Muon only supports 2D parameters") as e:
        fasttorch.TrainState.create(LayerNormNet(), optim.from_torch(torch.optim.Muon))
    assert "checked when the state is created" in "\n".join(e.value.__notes__)
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        optim.from_torch(torch.optim.Muon).init({"w": torch.ones(2, 2), "b": torch.ones(2)})


class _Embed(nn.Module):
    """An embedding whose rows 5.. no batch uses: zero gradients, zero moments."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 2, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x))


def _embed_data() -> list[Any]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 5, (8,), generator=g), torch.randn(8, 2, generator=g))
        for _ in range(STEPS)
    ]


# 0 at step 0, up to 0.01, back down to 0 at step 4 and after: through 0 twice.
THROUGH_ZERO = fasttorch.schedules.warmup(2, fasttorch.schedules.cosine(0.01, 2))


@pytest.mark.parametrize("lr", ["zero", "schedule"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("name", COMPILABLE)
def test_no_nan_at_lr_zero(name: str, mode: str, lr: str) -> None:
    """No NaN at lr 0 with unused embedding rows, eager and compiled, against torch's
    EAGER loop (torch's compiled capturable Adam writes 0/0 there, docs/design.md).

    Eagerly the kernels are torch's eager ones: bit for bit. Compiled: rule 2 (the
    capturable kernel, the compiled backward), with the fp32 loop's error measured on
    this model, data and lr sequence; the rows no batch reaches must come out finite.
    """
    torch.manual_seed(0)
    model = _Embed(bias=name != "Muon")
    data = _embed_data()
    lrs = (
        [0.0] * STEPS
        if lr == "zero"
        else [float(THROUGH_ZERO(torch.tensor(k))) for k in range(STEPS)]
    )
    assert lrs.count(0.0) >= 2
    cls = getattr(torch.optim, name)
    # torch's defaults: no L2 decay that would make the unused rows' gradients nonzero
    kw: dict[str, Any] = {"lr": lrs[0]}

    def set_lr(k: int, opt: Any) -> None:
        opt.param_groups[0]["lr"] = lrs[k]

    def make(named: Any) -> Any:
        return cls([p for _, p in named], **kw)

    ref = _plain_loop(model, data, make, set_lr)
    sched = 0.0 if lr == "zero" else THROUGH_ZERO
    state = fasttorch.TrainState.create(copy.deepcopy(model), optim.from_torch(cls, sched))
    step = fasttorch.step(mse)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    state = _run(state, step, data)
    for n, p in state.params.items():
        assert torch.isfinite(p).all(), f"{n}: {p}"
    if mode == "eager":
        _assert_equal(state, ref)
        return
    if name == "Muon":
        # Muon orthogonalizes in bfloat16: a compiled backward's last-bit difference
        # flips bf16 roundings, far beyond rule 2. Its reference is torch's compiled
        # Muon with a tensor lr (no division by lr there, nothing to avoid).
        ref = copy.deepcopy(model)
        opt = cls(ref.parameters(), **{**kw, "lr": torch.tensor(lrs[0])})
        ref_step = torch.compile(opt.step, backend="aot_eager")
        for k, batch in enumerate(data):
            opt.param_groups[0]["lr"].fill_(lrs[k])
            mse(ref, batch).backward()
            ref_step()
            opt.zero_grad(set_to_none=True)
    _assert_close(state, ref, "fp32", errors=_loop_errors(model, data, make, set_lr))


@pytest.mark.gpu
@pytest.mark.parametrize("foreach", [None, False])
def test_cuda_eager_adamw_at_lr_zero_keeps_the_parameters(foreach: bool | None) -> None:
    """Eagerly on an accelerator AdamW runs torch's capturable kernel: at lr 0 the
    parameters stay exactly as they were (torch's eager loop: p * (1 - 0) + (-0) * u)."""
    torch.manual_seed(0)
    model = _Embed(bias=True).cuda()
    data = [tuple(t.cuda() for t in b) for b in _embed_data()]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = optim.from_torch(torch.optim.AdamW, 0.0, foreach=foreach)
    state = _run(fasttorch.TrainState.create(model, opt), fasttorch.step(mse), data)
    for n, p in state.params.items():
        torch.testing.assert_close(p, before[n], **EXACT, msg=lambda m, n=n: f"{n}: {m}")


# ------------------------------------------------------------------------ groups


def _no_decay(name: str, p: torch.Tensor) -> bool:
    return p.ndim < 2


def _torch_groups(params: Any, **overrides_for_hidden: Any) -> list[dict[str, Any]]:
    """The same split in torch's param_groups form (default, no-decay, hidden)."""
    named = [(n, p) for n, p in params]
    no_decay = [p for n, p in named if _no_decay(n, p)]
    hidden = [p for n, p in named if not _no_decay(n, p) and n.startswith("hidden.")]
    rest = [p for n, p in named if not _no_decay(n, p) and not n.startswith("hidden.")]
    return [
        {"params": rest},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": hidden, **overrides_for_hidden},
    ]


RULES: list[tuple[optim.Selector, dict[str, Any]]] = [
    (_no_decay, {"weight_decay": 0.0}),
    (re.compile(r"^hidden\."), {"lr": 0.002}),
]


def _plain_loop(model: nn.Module, data: list[Any], make_opt: Any, before: Any = None) -> nn.Module:
    """The fp32 loop: a deep copy of ``model`` and ``make_opt(named_parameters)``;
    ``before(k, opt)``, if given, before step ``k`` (to change a learning rate)."""
    model = copy.deepcopy(model)
    opt = make_opt(list(model.named_parameters()))
    for k, batch in enumerate(data):
        if before is not None:
            before(k, opt)
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


HIDDEN_LR = float(torch.tensor(0.002))


@pytest.mark.parametrize(
    "make, torch_cls, kw",
    [
        (lambda: optim.from_torch(torch.optim.AdamW, LR, weight_decay=0.1), "AdamW", {}),
        (lambda: optim.from_torch(torch.optim.RMSprop, LR, weight_decay=0.1), "RMSprop", {}),
        (lambda: optim.adamw(LR, weight_decay=0.1), "AdamW", {}),
        (lambda: optim.sgd(LR, momentum=0.9, weight_decay=0.1), "SGD", {"momentum": 0.9}),
    ],
    ids=["from_torch_adamw", "from_torch_rmsprop", "adamw", "sgd"],
)
def test_groups_match_torch_param_groups(make: Any, torch_cls: str, kw: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(STEPS, 16)

    exact = isinstance(make(), optim.TorchOptimizer)  # from_torch keeps the floats' values

    def make_ref(named: Any) -> Any:
        lr, hidden = (LR, 0.002) if exact else (LR32, HIDDEN_LR)
        return getattr(torch.optim, torch_cls)(
            _torch_groups(named, lr=hidden), lr=lr, weight_decay=0.1, **kw
        )

    ref = _plain_loop(model, data, make_ref)
    opt = optim.groups(make(), RULES)
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    assert opt.assign(state.params) == {
        "inp.weight": 0,
        "inp.bias": 1,
        "norm.weight": 1,
        "norm.bias": 1,
        "hidden.weight": 2,
        "hidden.bias": 1,  # first match wins: the no-decay rule comes first
        "out.weight": 0,
        "out.bias": 1,
    }
    state = _run(state, fasttorch.step(mse), data)
    if isinstance(opt.optimizers[0], optim.TorchOptimizer):
        _assert_equal(state, ref)
    else:
        _assert_close(state, ref, "fp32", errors=_loop_errors(model, data, make_ref))


def test_groups_compiled_and_group_lr_change() -> None:
    """A group's lr changed mid-run (torch: param_groups[i]["lr"] = ...), compiled:
    torch's eager default AdamW loop bit for bit (module docstring)."""
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(STEPS, 16)
    new_lr = 0.03

    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(
        _torch_groups(list(ref.named_parameters()), lr=0.002), lr=LR, weight_decay=0.1
    )
    opt = optim.groups(optim.from_torch(torch.optim.AdamW, LR, weight_decay=0.1), RULES)
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    for k, batch in enumerate(data):
        if k == 3:
            ref_opt.param_groups[2]["lr"] = new_lr
            state = state.replace(
                opt_state=optim.set_hyperparams(state.opt_state, **{"group1.lr": new_lr})
            )
        mse(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        if k == 0:  # the first call compiles
            state, _ = step(state, batch)
            continue
        with forbid_host_sync():
            state, _ = step(state, batch)
    _assert_equal(state, ref)


def test_groups_with_another_optimizer_muon_and_adamw() -> None:
    """Muon for the matrices, AdamW for the rest, as torch users pair two optimizers."""
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(STEPS, 16)
    ref = copy.deepcopy(model)
    mats = [p for p in ref.parameters() if p.ndim == 2]
    rest = [p for p in ref.parameters() if p.ndim != 2]
    ref_opts = [torch.optim.Muon(mats, lr=LR), torch.optim.AdamW(rest, lr=LR)]
    for batch in data:
        mse(ref, batch).backward()
        for o in ref_opts:
            o.step()
            o.zero_grad(set_to_none=True)
    opt = optim.groups(
        optim.from_torch(torch.optim.Muon, LR),
        [(lambda n, p: p.ndim != 2, optim.from_torch(torch.optim.AdamW, LR))],
    )
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    state = _run(state, fasttorch.step(mse), data)
    _assert_equal(state, ref)


GLOB_RULES: list[tuple[optim.Selector, dict[str, Any]]] = [
    ("*.bias", {"weight_decay": 0.0}),
    ("norm.*", {"weight_decay": 0.0}),
    ("hidden.*", {"lr": 0.002}),
]


def _glob_groups(named: Any, lr: float) -> list[dict[str, Any]]:
    """GLOB_RULES in torch's param_groups form (first rule that matches)."""
    where = {
        n: next((i for i, (g, _) in enumerate(GLOB_RULES) if fnmatch.fnmatchcase(n, g)), -1)
        for n, _ in named
    }
    rest = {"params": [p for n, p in named if where[n] == -1]}
    groups = [
        {"params": [p for n, p in named if where[n] == i], **o}
        for i, (_, o) in enumerate(GLOB_RULES)
    ]
    groups[-1]["lr"] = lr  # float32's 0.002, as the state holds it
    return [rest, *groups]


def test_groups_glob_selectors_compiled_equal_eager_and_torch() -> None:
    """Glob selectors in a compiled step: chosen when the state is created, so the
    graph reads names (fnmatch itself does not trace)."""
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(STEPS, 16)

    def make_ref(named: Any) -> Any:
        return torch.optim.AdamW(_glob_groups(named, HIDDEN_LR), lr=LR32, weight_decay=0.1)

    ref = _plain_loop(model, data, make_ref)
    opt = optim.groups(optim.adamw(LR, weight_decay=0.1), GLOB_RULES)
    eager = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    assert isinstance(eager.opt_state, optim.GroupsState)
    assert eager.opt_state.names == (
        ("inp.weight", "out.weight"),
        ("inp.bias", "norm.bias", "hidden.bias", "out.bias"),
        ("norm.weight",),
        ("hidden.weight",),
    )
    fast = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    eager = _run(eager, fasttorch.step(mse), data)
    fast = _run(fast, fasttorch.compiled(fasttorch.step(mse), backend="aot_eager"), data)
    assert fast.opt_state.names == eager.opt_state.names  # kept through the steps
    errors = _loop_errors(model, data, make_ref)
    _assert_close(eager, ref, "fp32", errors=errors)
    _assert_close(fast, ref, "fp32", errors=errors)
    # The same operations in the same order: eager and compiled agree bit for bit.
    for n, p in fast.params.items():
        torch.testing.assert_close(p, eager.params[n], **EXACT, msg=lambda m, n=n: f"{n}: {m}")


def test_groups_state_without_names_runs_glob_selectors_in_the_compiled_step() -> None:
    """A plain OptState (built by hand, not by Groups.init) names no groups: the step
    runs the selectors itself, and the globs, translated to regular expressions once,
    trace under compile (fnmatch does not)."""
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(STEPS, 16)
    opt = optim.groups(optim.adamw(LR, weight_decay=0.1), GLOB_RULES)

    def unnamed() -> fasttorch.TrainState:
        state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
        o = state.opt_state
        return state.replace(opt_state=optim.OptState(count=o.count, hyper=o.hyper, slots=o.slots))

    assert type(unnamed().opt_state) is optim.OptState
    named = _run(fasttorch.TrainState.create(copy.deepcopy(model), opt), fasttorch.step(mse), data)
    fast = _run(unnamed(), fasttorch.compiled(fasttorch.step(mse), backend="aot_eager"), data)
    for n, p in fast.params.items():
        torch.testing.assert_close(p, named.params[n], **EXACT, msg=lambda m, n=n: f"{n}: {m}")


def test_groups_within_a_rule_equal_the_flattened_rules() -> None:
    """A rule's optimizer may itself be groups(...): its own rules' hyperparameters
    (stored "group0.group0.weight_decay") reach it, and the run is the flat rule list's,
    eager and compiled, bit for bit."""
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(STEPS, 16)
    inner = optim.groups(optim.adamw(LR), [("*.bias", {"weight_decay": 0.0})])
    nested = optim.groups(optim.sgd(LR), [("out.*", inner)])
    flat = optim.groups(
        optim.sgd(LR),
        [("out.bias", optim.adamw(LR, weight_decay=0.0)), ("out.*", optim.adamw(LR))],
    )
    state = fasttorch.TrainState.create(copy.deepcopy(model), nested)
    assert float(state.opt_state.hyper["group0.group0.weight_decay"]) == 0.0
    want = _run(fasttorch.TrainState.create(copy.deepcopy(model), flat), fasttorch.step(mse), data)
    for step in (fasttorch.step(mse), fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")):
        got = _run(fasttorch.TrainState.create(copy.deepcopy(model), nested), step, data)
        for n, p in got.params.items():
            torch.testing.assert_close(p, want.params[n], **EXACT, msg=lambda m, n=n: f"{n}: {m}")


def test_groups_errors() -> None:
    params = {"a.weight": torch.ones(2, 2), "a.bias": torch.ones(2)}
    with pytest.raises(ValueError, match="matches no parameter"):
        optim.groups(optim.adamw(LR), [("*.gamma", {"weight_decay": 0.0})]).init(params)
    # the second rule only sees what the first left over
    with pytest.raises(ValueError, match=r"rule 1 \(selector '\*.bias'\)"):
        optim.groups(optim.sgd(LR), [("a.*", {"lr": 0.1}), ("*.bias", {"lr": 0.2})]).init(params)
    with pytest.raises(TypeError, match="cannot override"):
        optim.groups(optim.adamw(LR), [("*.bias", {"momentum": 0.0})])
    with pytest.raises(TypeError, match="list of \\(selector, overrides\\)"):
        optim.groups(optim.adamw(LR), {"*.bias": {}})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="default optimizer is itself groups"):
        optim.groups(optim.groups(optim.sgd(LR), [("a.*", {"lr": 0.1})]), [])


# ------------------------------------------------------------- load_torch_state_dict


@pytest.mark.parametrize(
    "name, make",
    [
        ("AdamW", lambda: optim.from_torch(torch.optim.AdamW, LR, weight_decay=0.1)),
        ("Rprop", lambda: optim.from_torch(torch.optim.Rprop, LR)),
        ("AdamW", lambda: optim.adamw(LR, weight_decay=0.1)),
        ("SGD", lambda: optim.sgd(LR, momentum=0.9)),
    ],
    ids=["from_torch_adamw", "from_torch_rprop", "adamw", "sgd"],
)
def test_load_torch_state_dict_continues_the_run(name: str, make: Any) -> None:
    torch.manual_seed(0)
    model = LayerNormNet()
    kw = {"weight_decay": 0.1} if name == "AdamW" else {"momentum": 0.9} if name == "SGD" else {}
    data = batches(2 * STEPS, 16)
    opt = getattr(torch.optim, name)(model.parameters(), lr=LR32, **kw)

    def train(batches_: list[Any]) -> None:
        for batch in batches_:
            mse(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    train(data[:STEPS])  # the plain loop, half way
    state = fasttorch.TrainState.create(copy.deepcopy(model), make())
    steps = STEPS if name == "SGD" else None  # SGD keeps no count
    state = optim.load_torch_state_dict(state, opt.state_dict(), steps=steps)
    assert int(state.step) == STEPS == int(state.opt_state.count)
    train(data[STEPS:])  # both go on
    state = _run(state, fasttorch.step(mse), data[STEPS:])
    if isinstance(state.optimizer, optim.TorchOptimizer):
        _assert_equal(state, model)
        for slot, by_name in state.opt_state.slots.items():
            for n, p in model.named_parameters():
                assert torch.equal(by_name[n], opt.state[p][slot].to(by_name[n].device))
    else:
        # fasttorch's own adamw/sgd round some products once where torch's
        # add(..., alpha=) fuses them (tests/test_optim.py): one ulp of O(1) values.
        assert_params_close(state, model, rtol=1e-6, atol=1e-6)


def test_load_torch_state_dict_errors() -> None:
    model = LayerNormNet()
    opt = torch.optim.Adam(model.parameters(), amsgrad=True)
    mse(model, batches(1, 4)[0]).backward()
    opt.step()
    state = fasttorch.TrainState.create(model, optim.from_torch(torch.optim.Adam))
    with pytest.raises(ValueError, match="'max_exp_avg_sq', which TorchOptimizer does not"):
        optim.load_torch_state_dict(state, opt.state_dict())
    with pytest.raises(ValueError, match="has 8 parameters and the state trains 2"):
        optim.load_torch_state_dict(state, opt.state_dict(), names=["a", "b"])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    with pytest.raises(ValueError, match="pass steps=N"):
        optim.load_torch_state_dict(
            fasttorch.TrainState.create(model, optim.sgd(0.1, momentum=0.9)), sgd.state_dict()
        )
