"""vmapped: a population trained in one call equals n hand-written torch.optim loops."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from reference import LayerNormNet, batches, mse, reference_run
from tolerance import EXACT, fp32_reference_error, params_atol
from torch import nn

import fasttorch
from fasttorch import optim

counters = torch._dynamo.utils.counters

N = 3
LRS = [1e-3, 1e-2, 3e-2]
WDS = [0.0, 0.01, 0.1]


def _population(make=LayerNormNet, n=N, **kw):
    kw.setdefault("hyper", {"lr": LRS[:n], "weight_decay": WDS[:n]})
    return fasttorch.create_population(make, optim.adamw(1e-3), n, **kw)


def _member_model(pop, i, make=LayerNormNet):
    model = make()
    model.load_state_dict(fasttorch.member_state_dict(pop, i))
    return model


def _adamw(i):
    return lambda ps: torch.optim.AdamW(ps, lr=LRS[i], weight_decay=WDS[i])


def _assert_member_matches(pop, i, model, windows, loss_fn=mse, **kw):
    """Member ``i`` against its own hand-written loop, within rule 2 (tests/tolerance.py)."""
    ref, _ = reference_run(model, windows, make_opt=_adamw(i), loss_fn=loss_fn, **kw)
    got = fasttorch.member(pop, i)
    errors = fp32_reference_error(model, windows, make_opt=_adamw(i), loss_fn=loss_fn, **kw)
    atol = params_atol(errors, got.params)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got.params[name], p.detach(), rtol=0, atol=atol)


class TanhNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def _run(step, pop, data):
    for b in data:
        pop, metrics = step(pop, b)
    return pop, metrics


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_mlp_members_equal_their_own_torch_optim_loops(compile):
    torch.manual_seed(0)
    pop = _population()
    models = [_member_model(pop, i) for i in range(N)]
    data = batches(5, 16)
    step = fasttorch.vmapped(fasttorch.clip_scaled(fasttorch.step(mse), 0.5), N)
    if compile:
        step = fasttorch.compiled(step, backend="aot_eager")
    pop, metrics = _run(step, pop, data)
    assert metrics["loss"].shape == (N,) and int(pop.step) == 5
    for i in range(N):
        _assert_member_matches(pop, i, models[i], [[b] for b in data], clip=0.5)
    if compile:
        assert not counters["graph_break"]
        assert counters["stats"]["unique_graphs"] == 1
        assert sum(counters["recompiles"].values()) == 0


def test_members_start_from_independent_inits_and_copies_start_equal():
    pop = _population()
    w = pop.params["inp.weight"]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
    torch.manual_seed(1)
    expect = LayerNormNet()  # member 1's seed is 1
    torch.testing.assert_close(w[1], expect.inp.weight.detach(), **EXACT)
    same = _population(init="copies")
    assert torch.equal(same.params["inp.weight"][0], same.params["inp.weight"][2])
    # From a module: reset_parameters() under each member's seed, on copies.
    module = nn.Linear(4, 2)
    before = module.weight.detach().clone()
    reset = fasttorch.create_population(module, optim.sgd(0.1), 2, seeds=[5, 6])
    torch.manual_seed(5)
    torch.testing.assert_close(reset.params["weight"][0], nn.Linear(4, 2).weight, **EXACT)
    assert torch.equal(module.weight, before)


def test_a_batch_each_and_per_member_hyperparameters():
    torch.manual_seed(0)
    pop = _population()
    models = [_member_model(pop, i) for i in range(N)]
    data = [batches(4, 8, seed=s) for s in range(N)]
    stacked = [
        tuple(torch.stack([data[i][k][j] for i in range(N)]) for j in range(2)) for k in range(4)
    ]
    step = fasttorch.vmapped(fasttorch.step(mse), N, in_dims=0)
    pop, _ = _run(step, pop, stacked)
    assert pop.opt_state.hyper["lr"].tolist() == pytest.approx(LRS)
    for i in range(N):
        _assert_member_matches(pop, i, models[i], [[b] for b in data[i]])


SGD_LRS = [0.05, 0.1, 0.2]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_nan_in_one_member_skips_only_that_member(compile):
    # SGD, no LayerNorm: under vmap autocast meets the batched forms of the ops (a
    # linear's product and bias add may round separately), so the half-precision side
    # is held to rule 4 (tests/tolerance.py), which an update proportional to the
    # gradient obeys; Adam's normalized update of a near-zero gradient does not.
    torch.manual_seed(0)
    pop = fasttorch.create_population(
        TanhNet, optim.sgd(0.1, momentum=0.9), N, hyper={"lr": SGD_LRS}
    )
    models = [_member_model(pop, i, TanhNet) for i in range(N)]
    data = [batches(3, 8, seed=s) for s in range(N)]
    data[1][1] = (data[1][1][0] * math.nan, data[1][1][1])
    stacked = [
        tuple(torch.stack([data[i][k][j] for i in range(N)]) for j in range(2)) for k in range(3)
    ]
    step = fasttorch.vmapped(
        fasttorch.with_amp(fasttorch.skip_nonfinite(fasttorch.step(mse)), "fp16"), N, in_dims=0
    )
    if compile:
        step = fasttorch.compiled(step, backend="aot_eager")
    pop, metrics = _run(step, pop, stacked)
    assert pop.substates["nonfinite"].skipped_total.tolist() == [0, 1, 0]
    # Each member's own fp16 loss scale: only member 1's was halved.
    assert pop.substates["amp"].scale.tolist() == [2.0**16, 2.0**15, 2.0**16]
    for i in (0, 2):
        windows = [[b] for b in data[i]]

        def make_opt(ps, i=i):
            return torch.optim.SGD(ps, lr=SGD_LRS[i], momentum=0.9)

        ref, _ = reference_run(models[i], windows, make_opt=make_opt, precision="fp16")
        errors = fp32_reference_error(models[i], windows, make_opt=make_opt)
        got = fasttorch.member(pop, i)
        atol = params_atol(errors, got.params, precision="fp16", steps=3, lr=SGD_LRS[i])
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got.params[name], p.detach(), rtol=0, atol=atol)
    # Every member counted three steps; member 1's optimizer applied two updates.
    assert int(pop.step) == 3
    assert pop.opt_state.slots["momentum_buffer"]["inp.weight"].shape[0] == N


def test_grad_accumulate_schedule_and_ema_compose():
    torch.manual_seed(0)
    sched = fasttorch.schedules.warmup(2, fasttorch.schedules.constant(1e-2))
    pop = fasttorch.create_population(LayerNormNet, optim.adamw(sched), N)
    models = [_member_model(pop, i) for i in range(N)]
    data = batches(3, 16)
    inner = fasttorch.ema(fasttorch.grad_accumulate(fasttorch.step(mse), 2), 0.9)
    pop, metrics = _run(fasttorch.vmapped(inner, N), pop, data)
    assert metrics["lr"].tolist() == pytest.approx([1e-2] * N)
    # Member i equals the same fasttorch step run on member i alone (that one is held to
    # the hand-written loop by test_grad_accumulate.py and test_ema.py), within rule 2.
    for i in range(N):
        single = fasttorch.TrainState.create(copy.deepcopy(models[i]), optim.adamw(sched))
        single, _ = _run(inner, single, data)
        got = fasttorch.member(pop, i)
        windows = [list(torch.utils._pytree.tree_map(lambda t: t.tensor_split(2), b)) for b in data]
        windows = [list(zip(*w)) for w in windows]
        errors = fp32_reference_error(
            models[i], windows, make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-2)
        )
        atol = params_atol(errors, got.params)
        for k, p in single.params.items():
            torch.testing.assert_close(got.params[k], p, rtol=0, atol=atol)
            ema_got, ema_single = got.substates["ema"].params[k], single.substates["ema"].params[k]
            torch.testing.assert_close(ema_got, ema_single, rtol=0, atol=atol)


def test_accumulation_clip_amp_ema_compile_as_one_graph_without_recompiles():
    torch.manual_seed(0)
    pop = _population()
    inner = fasttorch.clip_scaled(
        fasttorch.ema(
            fasttorch.grad_accumulate(fasttorch.with_amp(fasttorch.step(mse), "fp16"), 2), 0.9
        ),
        1.0,
    )
    data = batches(4, 16)
    eager = fasttorch.vmapped(inner, N)
    fast = fasttorch.compiled(eager, backend="aot_eager")
    pop, metrics = _run(fast, pop, data[:2])
    # New per-member learning rates: new values of the same [n] tensor, no recompile.
    lrs = torch.tensor([5e-3, 1e-3, 2e-3])
    pop = pop.replace(opt_state=pop.opt_state.replace(hyper={**pop.opt_state.hyper, "lr": lrs}))
    pop, metrics = _run(fast, pop, data[2:])
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    assert metrics["loss_scale"].shape == (N,) and metrics["lr"].tolist() == lrs.tolist()
    assert pop.substates["ema"].count.tolist() == [4] * N


class ConvNet(nn.Module):
    """A convnet without BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.relu(self.conv2(x))
        return self.head(x.flatten(1))


def _xent(apply, batch):
    x, y = batch
    return nn.functional.cross_entropy(apply(x), y)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_convnet_members_equal_their_own_loops(compile):
    torch.manual_seed(0)
    pop = _population(ConvNet)
    models = [_member_model(pop, i, ConvNet) for i in range(N)]
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(3)
    ]
    step = fasttorch.vmapped(fasttorch.step(_xent), N)
    if compile:
        step = fasttorch.compiled(step, backend="aot_eager")
    pop, _ = _run(step, pop, data)
    for i in range(N):
        _assert_member_matches(pop, i, models[i], [[b] for b in data], loss_fn=_xent)


class TinyGPT(nn.Module):
    """Embeddings, one pre-LN causal attention block with dropout, LayerNorm, head."""

    def __init__(self, vocab: int = 16, d: int = 16, t: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(t, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y))
        return self.head(self.ln2(x))


def _lm(apply, batch):
    x, y = batch
    return nn.functional.cross_entropy(apply(x).flatten(0, 1), y.flatten())


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 16, (4, 8), generator=g))
        for _ in range(n)
    ]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_gpt_without_dropout_members_equal_their_own_loops(compile):
    torch.manual_seed(0)
    pop = _population(TinyGPT)
    models = [_member_model(pop, i, TinyGPT) for i in range(N)]
    data = _tokens(3)
    step = fasttorch.vmapped(fasttorch.step(_lm), N)
    if compile:
        step = fasttorch.compiled(step, backend="aot_eager")
    pop, _ = _run(step, pop, data)
    for i in range(N):
        _assert_member_matches(pop, i, models[i], [[b] for b in data], loss_fn=_lm)


def test_gpt_dropout_draws_differ_between_members_and_repeat_per_population():
    make = lambda: TinyGPT(dropout=0.5)  # noqa: E731
    pop = fasttorch.create_population(make, optim.adamw(1e-2), N, init="copies", seed=3)
    step = fasttorch.vmapped(fasttorch.step(_lm, donate=False), N)
    a, ma = step(pop, _tokens(1)[0])
    b, mb = step(pop, _tokens(1)[0])
    # Same members, same batch, same hyperparameters: only dropout can tell them apart.
    w = a.params["proj.weight"]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
    assert not torch.equal(ma["loss"][0], ma["loss"][1])
    # Pure: the same population state and batch give the same draws and results.
    torch.testing.assert_close(b.params["proj.weight"], w, **EXACT)
    # Without dropout the copies stay equal.
    plain = fasttorch.create_population(TinyGPT, optim.adamw(1e-2), N, init="copies")
    c, _ = step(plain, _tokens(1)[0])
    assert torch.equal(c.params["proj.weight"][0], c.params["proj.weight"][2])


def test_member_trains_on_alone_and_exports_a_state_dict():
    torch.manual_seed(0)
    pop = _population()
    pop, _ = _run(fasttorch.vmapped(fasttorch.step(mse), N), pop, batches(2, 8))
    one = fasttorch.member(pop, 2)
    assert int(one.step) == 2 and "population" not in one.substates
    assert float(one.opt_state.hyper["lr"]) == pytest.approx(LRS[2])
    plain = LayerNormNet()
    plain.load_state_dict(fasttorch.member_state_dict(pop, 2))
    torch.testing.assert_close(plain.out.weight.detach(), pop.params["out.weight"][2], **EXACT)
    one, _ = fasttorch.step(mse)(one, batches(1, 8)[0])
    assert int(one.step) == 3


def test_eval_step_gives_one_metric_per_member():
    torch.manual_seed(0)
    pop = _population()
    b = batches(1, 8)[0]
    ev = fasttorch.vmapped_eval(fasttorch.eval_step(mse), N)
    out = ev(pop, b)
    assert out["loss"].shape == (N,)
    for i in range(N):
        expect = mse(_member_model(pop, i).eval(), b)
        torch.testing.assert_close(out["loss"][i], expect.detach(), rtol=0, atol=1e-6)


class _Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))


def test_refusals_at_wrap_and_create_time():
    plain = fasttorch.step(mse)
    with pytest.raises(ValueError, match="compiled must be the outermost"):
        fasttorch.vmapped(fasttorch.compiled(plain), N)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        fasttorch.vmapped(plain, 0)
    with pytest.raises(ValueError, match="sync_on_last"):
        fasttorch.vmapped(fasttorch.sync_on_last(plain), N)
    with pytest.raises(TypeError, match="wraps the phases"):
        fasttorch.vmapped(lambda s, b: (s, {}), N)
    with pytest.raises(ValueError, match="BatchNorm1d that tracks running statistics"):
        fasttorch.create_population(lambda: nn.BatchNorm1d(3), optim.sgd(0.1), 2)
    with pytest.raises(TypeError, match="from_torch"):
        fasttorch.create_population(LayerNormNet, optim.from_torch(torch.optim.AdamW, lr=1e-3), 2)
    with pytest.raises(ValueError, match="unknown hyperparameter 'momentum'"):
        fasttorch.create_population(LayerNormNet, optim.adamw(1e-3), 2, hyper={"momentum": [0, 1]})
    with pytest.raises(ValueError, match="3 values for 2 members"):
        fasttorch.create_population(LayerNormNet, optim.adamw(1e-3), 2, hyper={"lr": [1, 2, 3]})
    with pytest.raises(ValueError, match="reset_parameters"):
        fasttorch.create_population(_Bare(), optim.sgd(0.1), 2)
    step = fasttorch.vmapped(plain, 2)
    with pytest.raises(ValueError, match="built for 2 members but the population holds 3"):
        step(_population(), batches(1, 8)[0])
    single = fasttorch.TrainState.create(LayerNormNet(), optim.sgd(0.1))
    with pytest.raises(ValueError, match="single model's TrainState"):
        step(single, batches(1, 8)[0])


def test_checkpoint_save_load_resume_is_bit_exact(tmp_path):
    def make():
        return fasttorch.create_population(
            LayerNormNet, optim.adamw(1e-2), N, hyper={"lr": LRS}, seed=7
        )

    def make_step():
        step = fasttorch.with_amp(fasttorch.step(_dropout_mse), "fp16")
        return fasttorch.vmapped(fasttorch.skip_nonfinite(step), N)

    step = make_step()
    data = batches(4, 8)
    pop = make()
    for b in data[:2]:
        pop, _ = step(pop, b)
    path = fasttorch.checkpoint.save(tmp_path, pop, data={"next": 2})
    assert path.name == "step_000000002"
    resumed, extra = fasttorch.checkpoint.load(path, make_step().init(make()))
    assert extra == {"next": 2}
    other = make_step()
    for b in data[2:]:
        pop, m1 = step(pop, b)
        resumed, m2 = other(resumed, b)
    flat1 = torch.utils._pytree.tree_leaves(pop)
    flat2 = torch.utils._pytree.tree_leaves(resumed)
    assert len(flat1) == len(flat2)
    for a, b in zip(flat1, flat2):
        torch.testing.assert_close(a, b, **EXACT)  # dropout draws included (the RNG)
    torch.testing.assert_close(m1["loss"], m2["loss"], **EXACT)


def _dropout_mse(apply, batch):
    x, y = batch
    return mse(lambda t: nn.functional.dropout(apply(t), 0.2), (x, y))
