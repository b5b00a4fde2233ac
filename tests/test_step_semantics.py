"""What a step means beyond its arithmetic: unused parameters, how the loss reaches the
model, submodule modes, seeds, what a new state shares, and concurrent calls."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import adam_twin, f32, mse, reference_run
from tolerance import EXACT, params_atol, reference_error
from torch import nn

import fasttorch
from fasttorch import _compat

F = fasttorch.optim

needs_grad_in_graph = pytest.mark.skipif(
    not _compat.AUTOGRAD_GRAD_IN_GRAPH,
    reason="compiled steps on torch < 2.12 take gradients with torch.func.grad, which "
    "gives zeros for unused parameters (docs/concepts.md)",
)


class TwoHeads(nn.Module):
    """A body and two heads; ``forward`` uses the first head only (a pooler under an
    MLM loss, a frozen branch), ``forward(x, head=2)`` the second."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.spare = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, head: int = 1) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h) if head == 1 else self.spare(h)


def _windows(steps: int, micro: int, size: int = 8) -> list[list[tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [
            (torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g))
            for _ in range(micro)
        ]
        for _ in range(steps)
    ]


OPTIMIZERS = {
    "sgd": (
        lambda: F.sgd(0.1, momentum=0.9, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, weight_decay=0.1),
    ),
    # adam and adamw against their torch twin (tests/reference.adam_twin): torch's default
    # form's double bias corrections move early steps more than rule 2's bound.
    "adamw": (
        lambda: F.adamw(0.05, weight_decay=0.1),
        adam_twin(torch.optim.AdamW, 0.05, weight_decay=0.1),
    ),
    "adam_eps0": (lambda: F.adam(0.05, eps=0.0), adam_twin(torch.optim.Adam, 0.05, eps=0.0)),
    "groups": (
        lambda: F.groups(
            F.adamw(0.05, weight_decay=0.1), [(lambda n, p: p.ndim < 2, {"weight_decay": 0.0})]
        ),
        lambda p: _torch_groups(p),
    ),
    "from_torch": (
        lambda: F.from_torch(torch.optim.AdamW, lr=0.05, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, 0.05, weight_decay=0.1),
    ),
}


def _torch_groups(params, fused=False):
    params = list(params)
    return adam_twin(torch.optim.AdamW, 0.05, weight_decay=0.1, fused=fused)(
        [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": f32(0.0)},
        ]
    )


# A donated step on a CPU runs torch's fused kernel (the opaque update): its twins.
DONATED_TWINS = {
    "adamw": adam_twin(torch.optim.AdamW, 0.05, weight_decay=0.1, fused=True),
    "adam_eps0": adam_twin(torch.optim.Adam, 0.05, eps=0.0, fused=True),
    "groups": lambda p: _torch_groups(p, fused=True),
}


def _train(model, opt, windows, *, mode, donate, micro, across=False, loss_fn=mse):
    state = fasttorch.TrainState.create(model, opt)
    step = fasttorch.step(loss_fn, donate=donate)
    step = fasttorch.grad_accumulate(step, micro, across_calls=across)
    step = fasttorch.clip_scaled(step, 0.5)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    norms = []
    for window in windows:
        if across:
            for mb in window:
                state, metrics = step(state, mb)
        else:
            xs, ys = zip(*window)
            state, metrics = step(state, (torch.cat(xs), torch.cat(ys)))
        norms.append(metrics["grad_norm"])
    return state, torch.stack(norms)


def _check_against_torch(opt_name, *, mode, donate, micro, across=False, loss_fn=mse):
    make, make_torch = OPTIMIZERS[opt_name]
    if donate:
        make_torch = DONATED_TWINS.get(opt_name, make_torch)
    torch.manual_seed(0)
    model = TwoHeads()
    initial = copy.deepcopy(model)
    windows = _windows(3, micro)
    ref, log = reference_run(
        model, windows, make_opt=make_torch, clip=0.5, loss_fn=loss_fn
    )  # a deep copy with torch.optim
    errors = reference_error(initial, windows, make_opt=make_torch, clip=0.5, loss_fn=loss_fn)
    state, norms = _train(
        model,
        make(),
        windows,
        mode=mode,
        donate=donate,
        micro=micro,
        across=across,
        loss_fn=loss_fn,
    )
    atol = params_atol(errors.params, state.params)
    for name, p in ref.named_parameters():
        bound = EXACT if p.grad is None and name.startswith("spare") else {"rtol": 0, "atol": atol}
        torch.testing.assert_close(state.params[name], p.detach(), **bound, msg=name)
    torch.testing.assert_close(
        norms, torch.tensor([e["grad_norm"] for e in log]), rtol=4 * errors.grad_norm + 1e-6, atol=0
    )
    return state, initial


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("micro", [1, 2])
def test_unused_parameters_are_not_updated_as_in_torch_optim_eager(opt_name, donate, micro):
    state, initial = _check_against_torch(opt_name, mode="eager", donate=donate, micro=micro)
    for name, p in initial.spare.named_parameters():  # no decay, no momentum, no NaN
        torch.testing.assert_close(state.params[f"spare.{name}"], p.detach(), **EXACT)
    for slot in state.opt_state.slots.values():  # moments and per-parameter steps untouched
        for name, t in slot.items():
            if name.startswith("spare"):
                assert not t.any(), name


@needs_grad_in_graph
@pytest.mark.parametrize(
    ("opt_name", "donate", "micro"), [("adam_eps0", True, 2), ("groups", False, 1)]
)
def test_unused_parameters_are_not_updated_as_in_torch_optim_compiled(opt_name, donate, micro):
    state, initial = _check_against_torch(opt_name, mode="compiled", donate=donate, micro=micro)
    torch.testing.assert_close(state.params["spare.weight"], initial.spare.weight, **EXACT)


def _alternating(apply, batch):
    """Head 1 for a microbatch of 8 rows, head 2 otherwise: two graphs, two unused sets."""
    x, y = batch
    return nn.functional.mse_loss(apply(x, head=1 if x.shape[0] == 8 else 2), y)


def _alternating_ref(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x, head=1 if x.shape[0] == 8 else 2), y)


@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=needs_grad_in_graph)])
def test_a_parameter_used_by_any_microbatch_of_the_window_is_updated(mode):
    """Across calls, microbatch 1 reaches ``head`` and microbatch 2 ``spare``: both are
    used in the window, as torch.optim sees a .grad on both."""
    torch.manual_seed(0)
    model = TwoHeads()
    g = torch.Generator().manual_seed(2)
    windows = [
        [(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)) for n in (8, 4)]
        for _ in range(3)
    ]
    make_torch = lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, weight_decay=0.1)  # noqa: E731
    rows = lambda mb: float(mb[0].shape[0])  # noqa: E731  (weighted by sample count)
    ref, _ = reference_run(
        model, windows, make_opt=make_torch, loss_fn=_alternating_ref, weight=rows
    )
    state = fasttorch.TrainState.create(model, F.sgd(0.1, momentum=0.9, weight_decay=0.1))
    step = fasttorch.grad_accumulate(
        fasttorch.step(_alternating, donate=False), 2, across_calls=True
    )
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    for window in windows:
        for mb in window:
            state, _ = step(state, mb)
    errors = reference_error(
        model, windows, make_opt=make_torch, loss_fn=_alternating_ref, weight=rows
    )
    atol = params_atol(errors.params, state.params)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=0, atol=atol, msg=name)
    assert not torch.equal(state.params["spare.weight"], model.spare.weight)


# --------------------------------------------------------------------------- direct calls


def _direct_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("target", ["model", "deepcopy"])
def test_a_loss_that_calls_the_model_instead_of_apply_is_refused(target, mode, donate, accumulate):
    """model(x) trains the model's own tensors, which only a donated eager state
    shares: elsewhere nothing would train (grad norm 0); a copy of the model (the
    tutorial's copy.deepcopy(model)) trains nothing anywhere. Refused in every mode,
    the donated eager one included, before anything is written: the error says to use
    apply, and the state stays usable."""
    model = _direct_model()
    called = copy.deepcopy(model) if target == "deepcopy" else model

    def direct(apply, batch):
        x, y = batch
        return nn.functional.mse_loss(called(x), y)

    state = fasttorch.TrainState.create(model, F.sgd(0.1))
    before = {k: p.clone() for k, p in state.params.items()}
    step = fasttorch.grad_accumulate(fasttorch.step(direct, donate=donate), accumulate)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    # Eagerly the step saw that apply was never called; compiled, the graph's gradients
    # reach none of the parameter inputs (apply's note is eager-only: inside
    # torch.utils.checkpoint a graph refuses its side effect). The same guidance.
    why = r"\(loss function 'direct' never called apply\)" if mode == "eager" else r"\(it has 4\)"
    with pytest.raises(
        ValueError,
        match=r"reached none of the state's parameters " + why + r".*deepcopy.*apply\(x\)",
    ):
        step(state, _windows(1, 1)[0][0])
    assert int(state.step) == 0
    for k, p in state.params.items():
        torch.testing.assert_close(p, before[k], **EXACT)  # the same tensors, unwritten


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_donated_eager_loss_whose_value_reaches_no_parameter_is_refused(accumulate):
    """apply is called, but the loss is computed from a copy of the model: the donated
    eager step (the module's own tensors, the .grad engine under grad_accumulate)
    finds no parameter reached, as the other modes do, instead of training nothing."""
    model = _direct_model()
    other = copy.deepcopy(model)

    def unused_apply(apply, batch):
        x, y = batch
        apply(x)
        return nn.functional.mse_loss(other(x), y)

    state = fasttorch.TrainState.create(model, F.sgd(0.1))
    step = fasttorch.grad_accumulate(fasttorch.step(unused_apply), accumulate)
    with pytest.raises(ValueError, match=r"reached none of the state's parameters.*apply\(x\)"):
        step(state, _windows(1, 1)[0][0])
    assert int(state.step) == 0  # refused before the update: still usable


def test_a_loss_that_uses_one_part_of_the_model_directly_is_refused():
    model = _direct_model()

    def mixed(apply, batch):
        x, y = batch
        return nn.functional.mse_loss(apply(x) + model[2](torch.ones(1, 16)), y)

    state = fasttorch.TrainState.create(model, F.sgd(0.1))
    with pytest.raises(ValueError, match=r"own parameter '2\.weight'.*apply"):
        fasttorch.step(mixed, donate=False)(state, _windows(1, 1)[0][0])


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_frozen_teacher_called_directly_is_fine(mode):
    """Distillation: a teacher that is not the state's module is called as it is."""
    torch.manual_seed(1)
    teacher = nn.Linear(8, 4).requires_grad_(False)
    student = _direct_model()
    ref = copy.deepcopy(student)

    def distill(apply, batch):
        x, _ = batch
        return nn.functional.mse_loss(apply(x), teacher(x))

    state = fasttorch.TrainState.create(student, F.sgd(0.1))
    step = fasttorch.step(distill, donate=False)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    windows = _windows(2, 1)
    for (batch,) in windows:
        state, _ = step(state, batch)
    make_opt = lambda p: torch.optim.SGD(p, 0.1)  # noqa: E731
    ref_loss = lambda m, b: nn.functional.mse_loss(m(b[0]), teacher.to(b[0].dtype)(b[0]))  # noqa: E731
    trained, _ = reference_run(ref, windows, make_opt=make_opt, loss_fn=ref_loss)
    errors = reference_error(ref, windows, make_opt=make_opt, loss_fn=ref_loss)
    atol = params_atol(errors.params, state.params)
    for name, p in trained.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=0, atol=atol, msg=name)
    assert not torch.equal(state.params["0.weight"], ref[0].weight)


# --------------------------------------------------------------------------- modes


class FrozenBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.0)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.inp(x)))))


@pytest.mark.parametrize("evaluate_between", [False, True])
def test_a_submodule_frozen_with_eval_stays_frozen_as_in_the_plain_loop(evaluate_between):
    """bn.eval() before create: the plain loop normalizes with the running statistics
    and never updates them; so must the step, also after state.apply and
    model.eval() between steps (an evaluation), which switch every submodule off."""
    torch.manual_seed(0)
    model = FrozenBN()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
    model.bn.eval()
    ref = copy.deepcopy(model)
    state = fasttorch.TrainState.create(model, F.sgd(0.1))
    assert model.training and not model.bn.training
    step = fasttorch.step(mse, donate=False)
    windows = _windows(3, 1)
    for (batch,) in windows:
        state, _ = step(state, batch)
        assert not model.bn.training and model.inp.training
        if evaluate_between:
            state.apply(batch[0])
            assert not model.bn.training and model.inp.training
            model.eval()
    # The plain loop (reference_run would call model.train() on its copy, unfreezing it)
    ref2 = copy.deepcopy(ref)
    opt = torch.optim.SGD(ref2.parameters(), 0.1)
    for (batch,) in windows:
        mse(ref2, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for name, b in ref2.named_buffers():
        torch.testing.assert_close(state.buffers[name], b, **EXACT)  # never updated
    assert int(state.buffers["bn.num_batches_tracked"]) == 0
    errors = reference_error(ref, windows, make_opt=lambda p: torch.optim.SGD(p, 0.1))
    atol = params_atol(errors.params, state.params)
    for name, p in ref2.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=0, atol=atol, msg=name)


def test_a_root_left_in_eval_mode_is_trained_in_the_modes_it_was_created_with():
    torch.manual_seed(0)
    model = FrozenBN()
    model.bn.eval()
    state = fasttorch.TrainState.create(model, F.sgd(0.1))
    model.eval()  # an evaluation left it so
    state, _ = fasttorch.step(mse)(state, _windows(1, 1)[0][0])
    assert model.training and model.out.training and not model.bn.training


# --------------------------------------------------------------------------- seeds


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.lin(x), 0.5, training=self.training)


def _masks_after(seed_global, **create_kwargs):
    torch.manual_seed(seed_global)
    state = fasttorch.TrainState.create(Dropped(), F.sgd(0.0), **create_kwargs)
    step = fasttorch.step(lambda apply, b: (apply(b) == 0).float().mean() * 0 + apply(b).sum())
    x = torch.ones(64, 8)
    _, m = fasttorch.step(lambda apply, b: (apply(b).sum(), apply(b) == 0))(state, x)
    del step
    return m["aux"]


def test_the_default_seed_follows_torch_manual_seed():
    """A seed sweep (torch.manual_seed(s) before create) gets different dropout masks,
    the same seed the same masks; an explicit seed still decides alone."""
    a, b, a2 = _masks_after(1), _masks_after(2), _masks_after(1)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)
    assert torch.equal(_masks_after(1, seed=7), _masks_after(2, seed=7))


def test_the_default_seed_does_not_replay_the_stream_that_initialized_the_model():
    from fasttorch.state import default_seed

    torch.manual_seed(3)
    assert default_seed() != 3
    assert default_seed() == default_seed()  # reads, does not draw


# --------------------------------------------------------------------------- sharing


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_copying_step_shares_no_tensor_with_its_input(mode):
    """donate=False: the hyperparameters (passed through unchanged) are copies too, so
    writing into the new state's leaves leaves the old state as it was."""
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(TwoHeads(), F.adamw(0.1))
    step = fasttorch.step(mse, donate=False)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    new, _ = step(state, _windows(1, 1)[0][0])
    old_ptrs = {t.data_ptr() for t in torch.utils._pytree.tree_leaves(state)}
    for t in torch.utils._pytree.tree_leaves(new):
        assert t.data_ptr() not in old_ptrs
    lr = state.opt_state.hyper["lr"].clone()
    new.opt_state.hyper["lr"].fill_(5.0)
    assert torch.equal(state.opt_state.hyper["lr"], lr)


def test_a_state_with_another_models_tensors_is_refused():
    """functional_call runs any tensors through the template: a wider Linear weight
    would silently train a different model."""
    torch.manual_seed(0)

    def mlp(width):
        return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4))

    narrow = fasttorch.TrainState.create(mlp(16), F.sgd(0.1))
    wide = fasttorch.TrainState.create(mlp(32), F.sgd(0.1))
    mixed = narrow.replace(params=wide.params)  # runs, as the wider model, through narrow's
    with pytest.raises(ValueError, match=r"params\['0.weight'\] has shape \(32, 8\).*\(16, 8\)"):
        fasttorch.step(mse, donate=False)(mixed, _windows(1, 1)[0][0])
    extra = narrow.replace(params={**narrow.params, "head.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"\['head.weight'\] is not a parameter or buffer"):
        fasttorch.step(mse, donate=False)(extra, _windows(1, 1)[0][0])


# --------------------------------------------------------------------------- threads


def test_one_accumulating_step_called_from_two_threads_gives_each_its_own_result():
    """Two threads share one step object (its scratch window) and one module: each
    thread's result equals the same call made alone."""
    import threading

    torch.manual_seed(0)
    model = TwoHeads()
    step = fasttorch.grad_accumulate(fasttorch.step(mse, donate=False), 2)
    states = [fasttorch.TrainState.create(model, F.adam(0.05, eps=0.0)) for _ in range(2)]
    data = [_windows(20, 1, size=16), _windows(20, 1, size=16)]
    for d in data[1]:  # a different stream per thread
        d[0] = (d[0][0] * 2, d[0][1])

    def run(i, out):
        s = states[i]
        for (batch,) in data[i]:
            s, _ = step(s, batch)
        out[i] = s

    expected: dict[int, object] = {}
    for i in range(2):
        run(i, expected)
    got: dict[int, object] = {}
    threads = [threading.Thread(target=run, args=(i, got)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for name, p in expected[i].params.items():
            torch.testing.assert_close(got[i].params[name], p, **EXACT)


# --------------------------------------------------------------------------- transforms


def _watched(step):
    """A user's transform, written as docs/transforms.md teaches: it reads the state's
    step counter and a parameter before and after calling its inner update, and
    reports what it saw as metrics (copies: the state's tensors may be donated)."""
    inner = step.update

    def update(state, g):
        seen = {"step_before": state.step.clone(), "w_before": state.params["0.weight"].clone()}
        new, metrics = inner(state, g)
        seen.update(step_after=state.step.clone(), w_after=state.params["0.weight"].clone())
        seen.update(step_new=new.step.clone(), w_new=new.params["0.weight"].clone())
        return new, {**metrics, **seen}

    return step.with_phases("watched", update=update)


@pytest.mark.parametrize("amp", ["none", "fp16 inside", "fp16 outside"])
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_transform_sees_its_input_state_unchanged_after_its_inner_update(
    mode, donate, accumulate, amp
):
    """The state a phase is given is a value: after the inner update returns it still
    holds the old step count and parameters, eagerly as in a compiled step, donated or
    not. (A donated eager step once updated it in place there, so that an average
    written from the docs ran one step late.)"""
    step = fasttorch.step(mse, donate=donate)
    step = fasttorch.with_amp(step, "fp16") if amp == "fp16 inside" else step
    step = _watched(step)
    step = fasttorch.with_amp(step, "fp16") if amp == "fp16 outside" else step
    step = fasttorch.grad_accumulate(step, accumulate)
    assert not step.in_place_update  # a transform that does not say it reads nothing after
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(_direct_model(), F.sgd(0.1, momentum=0.9))
    for (batch,) in _windows(3, 1):
        count, w = int(state.step), state.params["0.weight"].clone()
        state, metrics = step(state, batch)
        # Rule 1: each side is a copy of the same tensor, or the same update's result.
        assert int(metrics["step_before"]) == int(metrics["step_after"]) == count
        torch.testing.assert_close(metrics["w_before"], w, **EXACT)
        torch.testing.assert_close(metrics["w_after"], w, **EXACT)
        assert int(metrics["step_new"]) == int(state.step) == count + 1
        torch.testing.assert_close(metrics["w_new"], state.params["0.weight"], **EXACT)
        assert not torch.equal(metrics["w_new"], w)  # the update did change it


def test_steps_of_the_library_transforms_still_update_in_place(monkeypatch):
    """Their update phases read nothing of their input state after the inner one
    (``phases.no_state_read_after_inner``): a donated eager step writes the optimizer's
    results into the state's tensors directly, with no copy at the commit."""
    step = mse_step = fasttorch.step(mse)
    for wrap in (
        lambda s: fasttorch.with_amp(s, "fp16"),
        lambda s: fasttorch.clip_scaled(s, 1.0),
        lambda s: fasttorch.skip_nonfinite(s),
        lambda s: fasttorch.ema(s, 0.9),
        lambda s: fasttorch.grad_accumulate(s, 2),
    ):
        step = wrap(step)
        assert step.in_place_update, step.transforms
    assert not _watched(fasttorch.step(mse)).in_place_update
    assert not fasttorch.ema(_watched(fasttorch.step(mse)), 0.9).in_place_update
    copied: list[torch.Tensor] = []  # what the eager commit copies into the state
    from fasttorch._core import state as state_mod

    commit_copy = state_mod._copy_by_dtype
    monkeypatch.setattr(
        state_mod, "_copy_by_dtype", lambda d, s: (copied.extend(d), commit_copy(d, s))
    )
    # No skip flag (with_amp's fp16, skip_nonfinite), which updates out of place anyway.
    plain = fasttorch.grad_accumulate(fasttorch.ema(fasttorch.clip_scaled(mse_step, 1.0), 0.9), 2)
    for s, in_place in ((plain, True), (_watched(mse_step), False)):
        torch.manual_seed(0)
        state = fasttorch.TrainState.create(_direct_model(), F.sgd(0.1))
        w = state.params["0.weight"]
        copied.clear()
        for (batch,) in _windows(2, 1):
            state, _ = s(state, batch)
        assert state.params["0.weight"] is w
        assert any(t is w for t in copied) is not in_place, s.transforms
