"""``adam(..., opaque=True)``: in a CPU step that donates its state, the update is torch's
fused CPU kernel, the eager step's call; a compiled step runs it outside its graphs, and a
graph that holds it has one operator (``fasttorch::adam_fused_``) that makes the same
call. The window's mean and the clip's coefficient are folded into the factor the kernel
divides out."""

from __future__ import annotations

import collections
import copy
import operator
import warnings

import pytest
import torch
from reference import LayerNormNet, adam_twin, batches, mse, reference_run
from tolerance import EXACT, fp32_reference_error, params_atol, reference_error

import fasttorch
from fasttorch import optim, phases

ADAM_OP = torch.ops.fasttorch.adam_fused_.default
LR = 1e-2


def _ops(run) -> collections.Counter[str]:
    """The operators ``run()`` calls, nested ones too, by the profiler's names."""
    with torch.profiler.profile() as prof:
        run()
    return collections.Counter(e.name for e in prof.events())


def _warm_ops(step, state, data) -> collections.Counter[str]:
    """The operators of ``step``'s second call (the first compiles)."""
    state, _ = step(state, data[0])
    return _ops(lambda: step(state, data[1]))


class Graphs:
    """A backend that keeps dynamo's graphs and runs them as AOT autograd's ATen
    graphs, op by op (``aot_eager``)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example: list[torch.Tensor]):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(gm)
        return aot_eager(gm, example)

    def calls(self, target: object) -> int:
        return sum(
            n.op == "call_function" and n.target in (target, ADAM_OP)
            for gm in self.graphs
            for n in gm.graph.nodes
        )

    def ours(self) -> int:
        """Calls of fasttorch's operators in the graphs."""
        return sum(
            n.op == "call_function" and str(n.target).startswith("fasttorch.")
            for gm in self.graphs
            for n in gm.graph.nodes
        )

    def per_tensor_calls(self) -> int:
        """Calls in the graphs other than getitem, the operator and the model's."""
        return sum(
            n.op in ("call_function", "call_method") and n.target is not operator.getitem
            for gm in self.graphs
            for n in gm.graph.nodes
        )


def _composed(donate: bool = True) -> fasttorch.Step:
    s = fasttorch.with_amp(fasttorch.step(mse, donate=donate), "bf16")
    return fasttorch.clip_scaled(fasttorch.grad_accumulate(s, 2), 1.0)


def _train(model, opt, step, data):
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    for b in data:
        state, _ = step(state, b)
    return state


@pytest.mark.parametrize("make", [optim.adamw, optim.adam], ids=["adamw", "adam"])
def test_the_opaque_update_gives_the_eager_steps_bits(make):
    """Rule 1: the operator runs the donated eager step's kernel on the same values."""
    torch.manual_seed(0)
    model, data = LayerNormNet(), batches(4, 16)
    opaque = make(LR, weight_decay=0.1, opaque=True)
    backend = Graphs()
    eager = _train(model, opaque, _composed(), data)
    fast = _train(model, opaque, fasttorch.compiled(_composed(), backend=backend), data)
    plain_step = fasttorch.compiled(_composed(), backend="aot_eager")
    plain = _train(model, make(LR, weight_decay=0.1), plain_step, data)
    # One graph, the microbatch's: the update runs outside, as the eager step runs it.
    assert len(backend.graphs) == 1 and backend.ours() == 0
    for name, p in eager.params.items():
        torch.testing.assert_close(fast.params[name], p, **EXACT)
        for slot in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                fast.opt_state.slots[slot][name], eager.opt_state.slots[slot][name], **EXACT
            )
    assert int(fast.opt_state.count) == int(eager.opt_state.count) == 4
    # Rule 2 (+ 4: bf16) against the hand-written loop, as without the operator.
    windows = [list(zip(x.tensor_split(2), y.tensor_split(2))) for x, y in data]
    torch_opt = torch.optim.AdamW if make is optim.adamw else torch.optim.Adam

    def make_opt(params):
        return torch_opt(params, lr=LR, weight_decay=0.1)

    ref, _ = reference_run(model, windows, make_opt=make_opt, precision="bf16", clip=1.0)
    error = reference_error(model, windows, make_opt=make_opt, clip=1.0)
    atol = params_atol(error.params, plain.params, precision="bf16", steps=4, lr=LR)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(fast.params[name], p.detach(), rtol=0, atol=atol)


@pytest.mark.parametrize("composed", [False, True], ids=["plain", "accumulated_clipped"])
def test_the_graphs_of_the_opaque_step_grow_with_the_model_only(composed):
    """With the update outside the graphs, what dynamo traces grows with the model's
    calls only; traced (``opaque=False``), the update adds calls per parameter
    tensor."""

    def calls(width: int, opaque: bool) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(width)))
        backend = Graphs()
        inner = fasttorch.step(mse)
        if composed:
            inner = fasttorch.clip_scaled(fasttorch.grad_accumulate(inner, 2), 1.0)
        step = fasttorch.compiled(inner, backend=backend)
        state = fasttorch.TrainState.create(model, optim.adamw(LR, opaque=opaque))
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        step(state, (x, y))
        return backend.per_tensor_calls()

    # Each Linear adds its forward and backward calls (the same either way) and, with
    # the update in the graph, per tensor: its norm and Adam's lerp (2 tensors a layer).
    # A window adds nothing per tensor that depends on the option: its mean and the
    # clip's scaling are one _foreach call each in the traced form.
    model_and_update = calls(6, False) - calls(3, False)
    model_only = calls(6, True) - calls(3, True)
    assert model_and_update - model_only == 3 * 2 * 2  # 3 more layers, 2 tensors each


def _aten_ops(opt: optim.Adam) -> collections.Counter[str]:
    """The ATen operators (and those functionalized: the operator they wrap) of the
    composed step's graphs, by name, with ``opt``."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, example):
        graphs.append(gm)
        return gm.forward

    step = fasttorch.compiled(_composed(), backend=aot_autograd(fw_compiler=keep))
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), opt)
    step(state, batches(1, 16)[0])
    names: collections.Counter[str] = collections.Counter()
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op == "call_function":
                wrapped = "auto_functionalized" in str(n.target)
                names[str(n.args[0] if wrapped else n.target)] += 1
    return names


def test_the_windows_mean_and_the_clip_fold_into_the_kernels_factor():
    """In a donated compiled CPU step with the opaque optimizer, the update (outside
    the graphs) is the global norm, the clip's multiply and torch's fused AdamW, one
    ``_foreach`` or fused call each: the window's mean is no pass of its own but the
    factor the fused kernel divides out, and the graphs hold none of it; without the
    option, the graphs hold the update, a norm per tensor."""
    opaque = _aten_ops(optim.adamw(LR, opaque=True))
    assert not any(name.startswith("fasttorch.") for name in opaque)
    assert opaque["aten.linalg_vector_norm.default"] == 0
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), optim.adamw(LR, opaque=True))
    ran = _warm_ops(fasttorch.compiled(_composed(), backend="aot_eager"), state, batches(2, 16))
    assert ran["aten::_foreach_norm"] == ran["aten::_foreach_mul_"] == 1, ran
    assert ran["aten::_fused_adamw_"] == 1
    assert ran["aten::_foreach_div"] == ran["aten::_foreach_div_"] == 0
    assert ran["fasttorch::adam_fused_"] == 0  # the operator is for a graph
    plain = _aten_ops(optim.adamw(LR, opaque=False))
    assert not any(name.startswith("fasttorch.") for name in plain)
    tensors = len(LayerNormNet().state_dict())
    assert plain["aten.linalg_vector_norm.default"] == tensors + 1  # and the norm of norms


def test_a_graph_that_holds_the_opaque_update_calls_one_operator():
    """A function of the user's own that traces the default update phase
    (``fasttorch.phases``) with an opaque, donated ``GradOut`` holds torch's fused
    kernel as one operator, ``fasttorch::adam_fused_``, with the eager call's bits."""
    torch.manual_seed(0)
    model = LayerNormNet()
    grads = [{k: torch.randn_like(v) for k, v in model.named_parameters()} for _ in range(3)]

    def update(state, grads):
        one = torch.ones(())
        g = phases.GradOut(grads=grads, value=one, weight=one, donated=True, opaque=True)
        return phases.update_phase(state, g)

    backend = Graphs()
    traced = torch.compile(update, backend=backend, fullgraph=True)
    out = []
    for fn in (update, traced):
        state = fasttorch.TrainState.create(copy.deepcopy(model), optim.adamw(LR, weight_decay=0.1))
        for g in grads:
            state, _ = fn(state, {k: v.clone() for k, v in g.items()})
        out.append(state)
    assert backend.calls(torch.ops.fasttorch.adam_fused_) == 1
    for name, p in out[0].params.items():
        torch.testing.assert_close(out[1].params[name], p, **EXACT)
    assert int(out[1].opt_state.count) == 3


def test_not_donated_the_update_stays_in_the_graph():
    """``donate=False``: the state's tensors are the caller's; the graph's own form."""
    torch.manual_seed(0)
    backend = Graphs()
    step = fasttorch.compiled(fasttorch.step(mse, donate=False), backend=backend)
    state = fasttorch.TrainState.create(LayerNormNet(), optim.adamw(LR, opaque=True))
    before = {k: v.clone() for k, v in state.params.items()}
    step(state, batches(1, 8)[0])
    assert backend.calls(torch.ops.fasttorch.adam_fused_) == 0
    for k, v in before.items():
        torch.testing.assert_close(state.params[k], v, **EXACT)  # left as it was


def test_changed_hyperparameters_reach_the_operator_without_a_recompile():
    torch.manual_seed(0)
    model, data = LayerNormNet(), batches(4, 16)
    opt = optim.adamw(LR, weight_decay=0.1, opaque=True)
    out = []
    for step in (fasttorch.step(mse), fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")):
        state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
        for i, b in enumerate(data):
            if i == 2:
                state = state.replace(
                    opt_state=optim.set_hyperparams(
                        state.opt_state, in_place=True, lr=LR / 2, weight_decay=0.3, beta2=0.99
                    )
                )
            with warnings.catch_warnings():
                warnings.simplefilter("error", fasttorch.RecompileWarning)
                state, _ = step(state, b)
        out.append(state)
    for name, p in out[0].params.items():
        torch.testing.assert_close(out[1].params[name], p, **EXACT)


def test_groups_pass_in_place_to_the_opaque_optimizer_only():
    """An opaque AdamW beside SGD in groups: compiled equals eager bit for bit."""
    torch.manual_seed(0)
    model, data = LayerNormNet(), batches(4, 16)
    sgd = optim.sgd(LR, momentum=0.9, opaque=False)
    opt = optim.groups(sgd, [("*.weight", optim.adamw(LR, opaque=True))])
    assert opt.in_place_in_graph and not optim.groups(sgd, []).in_place_in_graph
    backend = Graphs()
    eager = _train(model, opt, fasttorch.step(mse), data)
    fast = _train(model, opt, fasttorch.compiled(fasttorch.step(mse), backend=backend), data)
    assert len(backend.graphs) == 1 and backend.ours() == 0  # the gradients'; the update outside
    for name, p in eager.params.items():
        torch.testing.assert_close(fast.params[name], p, **EXACT)


def test_opaque_must_be_a_bool():
    with pytest.raises(TypeError, match="opaque must be a bool"):
        optim.adamw(LR, opaque="yes")  # type: ignore[arg-type]
    assert optim.adamw(LR, opaque=False) != optim.adamw(LR)  # part of the configuration
    assert optim.adamw(LR).opaque and optim.sgd(LR).opaque  # the default


@pytest.mark.slow
def test_inductor_step_runs_the_fused_kernel_on_the_donated_tensors():
    """The one inductor compile here: after the generated gradients' code, torch's
    fused kernel runs once, on the state's own tensors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
    opt = optim.adamw(LR, opaque=True)
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    storage = {k: v.untyped_storage().data_ptr() for k, v in state.params.items()}
    step = fasttorch.compiled(fasttorch.step(mse))
    for b in data[:2]:
        state, _ = step(state, b)
    with torch.profiler.profile() as prof:  # warm: one operator call
        state, _ = step(state, data[2])
    events = prof.events()
    assert [e.name for e in events].count("aten::_fused_adamw_") == 1
    # The only scalar reads are torch's fused CPU kernel's own (its lr and step counts,
    # read in C++ as torch.optim.AdamW(fused=True) on a CPU reads them; no device sync).
    for e in events:
        if e.name == "aten::_local_scalar_dense":
            parents = []
            while e.cpu_parent is not None:
                e = e.cpu_parent
                parents.append(e.name)
            assert "aten::_fused_adamw_" in parents, parents
    assert {k: v.untyped_storage().data_ptr() for k, v in state.params.items()} == storage
    eager = _train(model, opt, fasttorch.step(mse), data)
    assert int(state.opt_state.count) == int(eager.opt_state.count) == 3
    # Inductor's forward and backward round otherwise than eager's: rule 2.
    errors = fp32_reference_error(
        model, [[b] for b in data], make_opt=lambda p: torch.optim.AdamW(p, lr=LR)
    )
    atol = params_atol(errors, eager.params)
    for name, p in eager.params.items():
        torch.testing.assert_close(state.params[name], p, rtol=0, atol=atol)


def test_a_skippable_fp16_step_runs_the_fused_kernel_with_the_skip_flag():
    """With ``with_amp("fp16")`` the update may be skipped: the fused kernel takes the
    skip flag and the loss scale, with the window's total folded into it, as
    ``GradScaler.step`` gives them to ``AdamW(fused=True)``; the loss-scaled norm and
    the clip's multiply are one operator each. The eager step's bits (rule 1) and the
    hand-written GradScaler loop's values (rules 2 + 4).

    The loop's AdamW is torch's fused form with a tensor lr and the hyperparameters'
    float32 values (``adam_twin(..., fused=True)``): torch's default form rounds
    otherwise, and through fp16 rounding flips one element of a run can move 2.2x rule
    4's bound away from the twin's (4.6e-5 with the ``_foreach`` twin; torch against
    torch)."""
    torch.manual_seed(0)
    model, data = LayerNormNet(), batches(4, 16)
    scale = {"init_scale": 2.0**10, "growth_interval": 2}

    def composed() -> fasttorch.Step:
        s = fasttorch.with_amp(fasttorch.step(mse), "fp16", **scale)
        return fasttorch.clip_scaled(fasttorch.grad_accumulate(s, 2), 1.0)

    def train(step):
        opt = optim.adamw(LR, weight_decay=0.1, opaque=True)
        state = composed().init(fasttorch.TrainState.create(copy.deepcopy(model), opt))
        for b in data:
            state, _ = step(state, b)
        return state

    backend = Graphs()
    eager = train(composed())
    fast = train(fasttorch.compiled(composed(), backend=backend))
    assert len(backend.graphs) == 1 and backend.ours() == 0  # the update outside
    for name, p in eager.params.items():
        torch.testing.assert_close(fast.params[name], p, **EXACT)
    assert int(fast.opt_state.count) == int(eager.opt_state.count)
    ran = _warm_ops(fasttorch.compiled(composed(), backend="aot_eager"), train(composed()), data)
    assert ran["aten::_foreach_norm"] == ran["aten::_foreach_mul_"] == 1, ran
    assert ran["aten::_fused_adamw_"] == 1
    windows = [list(zip(x.tensor_split(2), y.tensor_split(2))) for x, y in data]

    make_opt = adam_twin(torch.optim.AdamW, LR, weight_decay=0.1, fused=True)

    ref, _ = reference_run(
        model, windows, make_opt=make_opt, precision="fp16", clip=1.0, scaler_kwargs=scale
    )
    error = reference_error(model, windows, make_opt=make_opt, clip=1.0)
    atol = params_atol(error.params, eager.params, precision="fp16", steps=4, lr=LR)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(fast.params[name], p.detach(), rtol=0, atol=atol)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_runs_torchs_fused_kernel_once(momentum):
    """``sgd``'s opaque update: torch's fused kernel once in the compiled step, outside
    its graph, the eager step's bits (rule 1), and torch's ``SGD(fused=True)``'s given
    the same gradients (the window's mean folded into the kernel's factor: a power of
    two, exact)."""
    torch.manual_seed(0)
    model, data = LayerNormNet(), batches(4, 16)
    opt = optim.sgd(LR, momentum=momentum, weight_decay=0.1)
    backend = Graphs()

    def composed():
        return fasttorch.grad_accumulate(fasttorch.step(mse), 2)

    eager = _train(model, opt, composed(), data)
    fast = _train(model, opt, fasttorch.compiled(composed(), backend=backend), data)
    assert len(backend.graphs) == 1 and backend.ours() == 0
    again = fasttorch.compiled(composed(), backend="aot_eager")
    ran = _warm_ops(again, fasttorch.TrainState.create(copy.deepcopy(model), opt), data)
    assert ran["aten::_fused_sgd_"] == 1 and ran["fasttorch::sgd_fused_"] == 0
    for name, p in eager.params.items():
        torch.testing.assert_close(fast.params[name], p, **EXACT)
    ref = copy.deepcopy(model)
    twin = torch.optim.SGD(
        ref.parameters(), lr=torch.tensor(LR), momentum=momentum, weight_decay=0.1, fused=True
    )
    for x, y in data:
        for xs, ys in zip(x.tensor_split(2), y.tensor_split(2)):
            (mse(ref, (xs, ys)) / 2).backward()
        twin.step()
        twin.zero_grad(set_to_none=True)
    errors = fp32_reference_error(
        model,
        [list(zip(x.tensor_split(2), y.tensor_split(2))) for x, y in data],
        make_opt=lambda p: torch.optim.SGD(p, lr=LR, momentum=momentum, weight_decay=0.1),
    )
    atol = params_atol(errors, eager.params)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(eager.params[name], p.detach(), rtol=0, atol=atol)


class _Transposed(torch.nn.Module):
    """A parameter stored transposed (strides (1, 6)): its gradient from
    ``autograd.grad`` need not have them, and torch's fused CPU kernel pairs elements by
    memory order."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 8).t())
        self.b = torch.nn.Parameter(torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_gradient_in_other_strides_than_its_parameter_is_paired_right(mode):
    """Rule 1 against torch's ``AdamW(fused=True)``, whose ``.grad`` follows the
    parameter's strides (autograd's layout contract)."""
    torch.manual_seed(0)
    model = _Transposed()
    assert not model.w.is_contiguous()
    data = [(torch.randn(4, 8), torch.randn(4, 6)) for _ in range(3)]
    step = fasttorch.step(mse)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    state = _train(model, optim.adamw(LR, weight_decay=0.1), step, data)
    ref = copy.deepcopy(model)
    twin = adam_twin(torch.optim.AdamW, LR, weight_decay=0.1, fused=True)(ref.parameters())
    for b in data:
        mse(ref, b).backward()
        assert ref.w.grad.stride() == ref.w.stride()
        twin.step()
        twin.zero_grad(set_to_none=True)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), **EXACT)
