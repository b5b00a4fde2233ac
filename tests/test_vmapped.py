"""vmapped: a population trained in one call equals n hand-written torch.optim loops."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from reference import LayerNormNet, adam_twin, batches, mse, reference_run
from tolerance import EXACT, fp32_reference_error, gamma, params_atol, unit_roundoff
from torch import nn

import fasttorch
from fasttorch import optim
from fasttorch.transforms.vmapped import _PerTensor

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
    """Member ``i``'s AdamW: adamw's torch twin (tests/reference.adam_twin); torch's
    default form's float64 bias corrections move early steps more than rule 2's bound
    at lr 3e-2."""
    return adam_twin(torch.optim.AdamW, LRS[i], weight_decay=WDS[i])


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
    assert metrics["loss"].shape == (N,) and pop.step.tolist() == [5] * N
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
    assert pop.step.tolist() == [3] * N
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
        # opaque=False: the _foreach form a population's (undonated) members run
        single = fasttorch.TrainState.create(
            copy.deepcopy(models[i]), optim.adamw(sched, opaque=False)
        )
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


def _seeded_adamw(i, rng_seed):
    """Member ``i``'s optimizer, built right after ``torch.manual_seed(rng_seed)``: the
    hand loop seeds its dropout as a lone run does, just before it trains."""

    def make(ps):
        torch.manual_seed(rng_seed)
        return _adamw(i)(ps)

    return make


def _gpt_dropout():
    return TinyGPT(dropout=0.5)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_gpt_with_dropout_members_equal_their_own_loops(compile):
    """Each member draws its own dropout masks: those of its hand loop seeded with its
    generator's seed (torch's global generator, the plain nn.Dropout)."""
    rng_seeds = [11, 12, 13]
    torch.manual_seed(0)
    pop = _population(_gpt_dropout, rng_seeds=rng_seeds)
    models = [_member_model(pop, i, _gpt_dropout) for i in range(N)]
    data = _tokens(3)
    step = fasttorch.vmapped(fasttorch.step(_lm), N)
    if compile:
        step = fasttorch.compiled(step, backend="aot_eager")
    with torch.random.fork_rng(devices=[]):
        pop, _ = _run(step, pop, data)
        windows = [[b] for b in data]
        for i in range(N):
            make_opt = _seeded_adamw(i, rng_seeds[i])
            ref, _ = reference_run(models[i], windows, make_opt=make_opt, loss_fn=_lm)
            errors = fp32_reference_error(models[i], windows, make_opt=make_opt, loss_fn=_lm)
            got = fasttorch.member(pop, i)
            atol = params_atol(errors, got.params)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(got.params[name], p.detach(), rtol=0, atol=atol)
            # The generator advanced as the loop's did: three steps of two draws each.
            torch.testing.assert_close(got.rng, torch.get_rng_state(), **EXACT)
    # Rule 2 is far below what a different mask moves: the members' masks differ.
    assert not torch.equal(pop.rng[0], pop.rng[1])


def test_members_equal_independent_fasttorch_runs_with_their_seeds():
    """Default seeding: member ``i`` is the run ``torch.manual_seed(i); make_model();
    TrainState.create(...)`` trains (its weights and its dropout generator), step counter
    and generator state included."""
    pop0 = _population(_gpt_dropout)
    data = _tokens(3)
    plain = fasttorch.step(_lm)
    pop, _ = _run(fasttorch.vmapped(fasttorch.step(_lm, donate=False), N), pop0, data)
    for i in range(N):
        torch.manual_seed(i)
        model = _gpt_dropout()
        single = fasttorch.TrainState.create(model, optim.adamw(LRS[i], weight_decay=WDS[i]))
        single, _ = _run(plain, single, data)
        got = fasttorch.member(pop, i)
        assert torch.equal(got.step, single.step) and torch.equal(got.rng, single.rng)
        torch.manual_seed(i)
        rng_seed = fasttorch.state.default_seed()  # what TrainState.create took
        errors = fp32_reference_error(
            _member_model(pop0, i, _gpt_dropout),
            [[b] for b in data],
            make_opt=_seeded_adamw(i, rng_seed),
            loss_fn=_lm,
        )
        atol = params_atol(errors, got.params)
        for k, p in single.params.items():
            torch.testing.assert_close(got.params[k], p, rtol=0, atol=atol)


def test_dropout_draws_differ_between_members_and_repeat_per_population():
    model = _gpt_dropout()
    pop = fasttorch.create_population(
        model, optim.adamw(1e-2), N, init="copies", rng_seeds=[3, 4, 5]
    )
    step = fasttorch.vmapped(fasttorch.step(_lm, donate=False), N)
    a, ma = step(pop, _tokens(1)[0])
    b, mb = step(pop, _tokens(1)[0])
    # Same members, same batch, same hyperparameters: only dropout can tell them apart.
    w = a.params["proj.weight"]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
    assert not torch.equal(ma["loss"][0], ma["loss"][1])
    # Pure: the same population state and batch give the same draws and results, and
    # the input's generator states are left as they were.
    torch.testing.assert_close(b.params["proj.weight"], w, **EXACT)
    torch.testing.assert_close(b.rng, a.rng, **EXACT)
    assert not torch.equal(pop.rng, a.rng)
    # The same generator seed for two members: the same masks, whatever the others draw.
    same = fasttorch.create_population(
        model, optim.adamw(1e-2), N, init="copies", rng_seeds=[3, 9, 3]
    )
    c, _ = step(same, _tokens(1)[0])
    torch.testing.assert_close(c.params["proj.weight"][0], w[0], **EXACT)
    torch.testing.assert_close(c.params["proj.weight"][2], w[0], **EXACT)


def _noisy(apply, batch):
    """Input noise and per-sample weights drawn in the loss: torch.randn_like, torch.rand.

    Drawn in float32 whatever the batch's dtype, so that the float64 run of rule 2
    draws the same values."""
    x, y = batch
    x = x + 0.1 * torch.randn_like(x, dtype=torch.float32).to(x.dtype)
    w = (torch.rand(x.shape[0], 1) + 0.5).to(x.dtype)
    return ((apply(x) - y) ** 2 * w).mean()


def test_rand_and_randn_draw_from_each_members_generator():
    rng_seeds = [21, 22, 23]
    torch.manual_seed(0)
    pop = _population(TanhNet, rng_seeds=rng_seeds)
    models = [_member_model(pop, i, TanhNet) for i in range(N)]
    data = batches(3, 8)
    pop, _ = _run(fasttorch.vmapped(fasttorch.step(_noisy), N), pop, data)
    with torch.random.fork_rng(devices=[]):
        for i in range(N):
            make_opt = _seeded_adamw(i, rng_seeds[i])
            windows = [[b] for b in data]
            ref, _ = reference_run(models[i], windows, make_opt=make_opt, loss_fn=_noisy)
            torch.testing.assert_close(pop.rng[i], torch.get_rng_state(), **EXACT)
            errors = fp32_reference_error(models[i], windows, make_opt=make_opt, loss_fn=_noisy)
            atol = params_atol(errors, pop.params)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(pop.params[name][i], p.detach(), rtol=0, atol=atol)


def test_random_ops_without_a_member_generator_are_refused():
    def sampled(apply, batch):
        x, y = batch
        return mse(apply, (x + torch.randint(0, 2, x.shape).float(), y))

    pop = _population()
    with pytest.raises(RuntimeError, match="randomness") as info:
        fasttorch.vmapped(fasttorch.step(sampled), N)(pop, batches(1, 8)[0])
    assert "draws from its own generator" in "".join(info.value.__notes__)


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
            LayerNormNet, optim.adamw(1e-2), N, hyper={"lr": LRS}, rng_seeds=[7, 8, 9]
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


class DropNet(nn.Module):
    """TanhNet with dropout on its hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.25)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.inp(x))))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_members_equal_their_own_fasttorch_runs(precision):
    """bf16, and fp16 with each member's own loss scale (each starts from its own; member 1
    meets an inf and halves its scale alone): member ``i`` against the same step run on
    its own state.

    The linear layers round once, as the single model's addmm (vmapped gives the bias
    to the batched product), but the float32 sums run in another order: rule 4
    (tests/tolerance.py) with one half rounding per chain on top of rule 2. The dropout
    masks are the same bits.
    """
    torch.manual_seed(0)
    pop0 = fasttorch.create_population(
        DropNet, optim.sgd(0.1, momentum=0.9), N, hyper={"lr": SGD_LRS}
    )
    data = [batches(3, 8, seed=s) for s in range(N)]
    if precision == "fp16":
        data[1][1] = (data[1][1][0] * math.inf, data[1][1][1])
    stacked = [
        tuple(torch.stack([data[i][k][j] for i in range(N)]) for j in range(2)) for k in range(3)
    ]
    inner = fasttorch.with_amp(fasttorch.step(mse, donate=False), precision)
    step = fasttorch.vmapped(inner, N, in_dims=0)
    pop0 = step.init(pop0)
    if precision == "fp16":  # each member's own initial loss scale, a [n] tensor
        amp = pop0.substates["amp"].replace(scale=torch.tensor([2.0**10, 2.0**16, 2.0**12]))
        pop0 = pop0.replace(substates={**pop0.substates, "amp": amp})
    pop, _ = _run(step, pop0, stacked)
    if precision == "fp16":
        assert pop.substates["amp"].scale.tolist() == [2.0**10, 2.0**15, 2.0**12]
    for i in range(N):
        single, _ = _run(inner, fasttorch.member(pop0, i), data[i])
        got = fasttorch.member(pop, i)
        torch.testing.assert_close(got.rng, single.rng, **EXACT)
        torch.testing.assert_close(got.step, single.step, **EXACT)
        if precision == "fp16":
            amp, single_amp = got.substates["amp"], single.substates["amp"]
            torch.testing.assert_close(amp.scale, single_amp.scale, **EXACT)
        # Rule 2's fp32 loop: the skipped step (the inf) changes nothing, so it is left out.
        windows = [[b] for b in data[i] if bool(torch.isfinite(b[0]).all())]
        torch.manual_seed(i)
        make_opt = _seeded_sgd(i, fasttorch.state.default_seed())
        errors = fp32_reference_error(_member_model(pop0, i, DropNet), windows, make_opt=make_opt)
        atol = params_atol(errors, got.params, precision=precision, steps=3, lr=SGD_LRS[i])
        for k, p in single.params.items():
            torch.testing.assert_close(got.params[k], p, rtol=0, atol=atol)


def _seeded_sgd(i, rng_seed):
    def make(ps):
        torch.manual_seed(rng_seed)
        return torch.optim.SGD(ps, lr=SGD_LRS[i], momentum=0.9)

    return make


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_population_step_runs_without_host_sync(mode):
    from test_no_host_sync import forbid_host_sync

    torch.manual_seed(0)
    pop = fasttorch.create_population(DropNet, optim.adamw(1e-2), N, hyper={"lr": LRS})
    inner = fasttorch.clip_scaled(
        fasttorch.grad_accumulate(fasttorch.with_amp(fasttorch.step(mse), "fp16"), 2), 1.0
    )
    step = fasttorch.vmapped(fasttorch.ema(inner, 0.9), N)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    data = batches(5, 8)
    pop, _ = _run(step, pop, data[:2])  # compile first: tracing may inspect values
    bad = (data[2][0] * math.inf, data[2][1])
    with forbid_host_sync(), torch.profiler.profile() as prof:
        pop, metrics = _run(step, pop, [bad, *data[3:]])
    reads = [e.name for e in prof.events() if e.name == "aten::_local_scalar_dense"]
    assert not reads, len(reads)
    assert metrics["loss"].shape == (N,) and pop.step.tolist() == [5] * N


@pytest.mark.slow
def test_inductor_population_with_dropout_matches_eager():
    """The one population test that pays for inductor: a tiny MLP with dropout. The
    members' draws are an opaque operator to inductor (the same bits as eager); inductor
    fuses and reorders the rest, so rule 2 bounds the gap."""
    torch.manual_seed(0)
    pop0 = fasttorch.create_population(DropNet, optim.sgd(0.1), 2, hyper={"lr": [0.1, 0.2]})
    data = batches(3, 8)
    inner = fasttorch.vmapped(fasttorch.step(mse, donate=False), 2)
    eager, _ = _run(inner, pop0, data)
    fast, _ = _run(fasttorch.compiled(inner), pop0, data)
    torch.testing.assert_close(fast.rng, eager.rng, **EXACT)
    for i in range(2):
        torch.manual_seed(i)
        rng_seed = fasttorch.state.default_seed()

        def make_opt(ps, i=i, rng_seed=rng_seed):
            torch.manual_seed(rng_seed)
            return torch.optim.SGD(ps, lr=[0.1, 0.2][i])

        errors = fp32_reference_error(
            _member_model(pop0, i, DropNet), [[b] for b in data], make_opt=make_opt
        )
        got = fasttorch.member(fast, i)
        atol = params_atol(errors, got.params)
        for k, p in fasttorch.member(eager, i).params.items():
            torch.testing.assert_close(got.params[k], p, rtol=0, atol=atol)


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _within_one_rounding(got, exact, magnitude, k, dtype):
    """Rule 3 and one rounding: a float32 sum of ``k`` terms is within
    ``gamma(k) * sum |terms|`` (``magnitude``) of the exact sum, and rounding it once to
    ``dtype`` moves it by at most ``u`` of itself. A second rounding (of the product,
    then of the product plus the bias) can add ``u`` of the product again."""
    fp32 = gamma(k) * magnitude
    bound = unit_roundoff(dtype) * (exact.abs() + fp32) + fp32
    assert got.dtype == dtype
    excess = (got.double() - exact).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} of {got.numel()} beyond one rounding"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(16, 8), (2, 16, 8)], ids=["2d", "3d"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "own"])
@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "half_weights"])
def test_half_precision_linear_rounds_once_as_the_unbatched_kernel(
    precision, shape, shared, autocast
):
    """Under vmap a half-precision linear with per-member weights and biases gives its
    output and its weight and bias gradients rounded once from the float32 sum, as the
    single model's addmm does (held to the exact value: rule 3 plus one rounding), in
    the dtype the single model gets; the unbatched kernel is held to the same bound."""
    dtype = HALF[precision]
    n = 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*((n, *shape) if not shared else shape), generator=g)
    w = torch.randn(n, 24, shape[-1], generator=g)
    b = torch.randn(n, 24, generator=g)
    up = torch.randn(*shape[:-1], 24, generator=g)  # the gradient flowing into the output
    if not autocast:  # a model kept in the half dtype: no autocast, the same rounding
        x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)

    def loss_and_out(wb, xi):
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = nn.functional.linear(xi, *wb)
        return (out.float() * up).sum(), out

    def member(wb, xi):
        with _PerTensor(None):
            return torch.func.grad(loss_and_out, has_aux=True)(wb, xi)

    (gw, gb), out = torch.func.vmap(member, in_dims=(0, None if shared else 0))((w, b), x)
    up_h = up.to(dtype).double()  # out.float()'s backward rounds the gradient to dtype
    for i in range(n):
        xi = (x if shared else x[i]).to(dtype).double()
        wi, bi = w[i].to(dtype).double(), b[i].to(dtype).double()
        rows = xi.reshape(-1, shape[-1])
        ups = up_h.reshape(-1, 24)
        cases = {
            "out": (out[i], nn.functional.linear(xi, wi, bi), xi.abs() @ wi.abs().T + bi.abs()),
            "weight": (gw[i], ups.T @ rows, ups.abs().T @ rows.abs()),
            "bias": (gb[i], ups.sum(0), ups.abs().sum(0)),
        }
        (single_gw, single_gb), single_out = torch.func.grad(loss_and_out, has_aux=True)(
            (w[i], b[i]), x if shared else x[i]
        )
        singles = {"out": single_out, "weight": single_gw, "bias": single_gb}
        for name, (got, exact, magnitude) in cases.items():
            k = shape[-1] + 1 if name == "out" else rows.shape[0]
            # Gradients come back in the parameter's dtype, their values rounded once.
            as_dtype = got.to(dtype) if name != "out" else got
            _within_one_rounding(as_dtype, exact, magnitude, k, dtype)
            _within_one_rounding(singles[name].to(dtype), exact, magnitude, k, dtype)
            assert singles[name].dtype == got.dtype


def _max_error(params, exact):
    return max(
        float((params[k].detach().double() - p.detach()).abs().max()) for k, p in exact.items()
    )


def test_bf16_member_is_as_close_to_float64_as_its_hand_loop():
    """A bf16 member of a LayerNorm MLP against the float64 loop, beside its own
    hand-written bf16 loop (torch.optim under autocast) against the same float64 loop.

    The population's linear layers round as the hand loop's (one rounding of each
    product plus bias); its LayerNorm sums the weight and bias gradients in float32,
    where torch's mixed-dtype CPU kernel adds them row by row in bf16 (more roundings,
    not fewer). So the population is no further from float64 than the hand loop, up to
    the rounding flips of rule 4 (tests/tolerance.py: ``steps * lr * u`` with one half
    rounding per chain) on rule 2's fp32 bound. SGD: its update is proportional to the
    gradient, so the float64 comparison is meaningful (not Adam's sign of a near-zero
    first step, tests/README.md)."""
    torch.manual_seed(0)
    steps = 10
    pop0 = fasttorch.create_population(
        LayerNormNet, optim.sgd(0.1, momentum=0.9), N, hyper={"lr": SGD_LRS}
    )
    data = batches(steps, 16)
    step = fasttorch.vmapped(fasttorch.with_amp(fasttorch.step(mse, donate=False), "bf16"), N)
    pop, _ = _run(step, step.init(pop0), data)
    windows = [[b] for b in data]
    windows64 = [[(x.double(), y.double())] for x, y in data]
    for i in range(N):

        def make_opt(ps, i=i):
            return torch.optim.SGD(ps, lr=SGD_LRS[i], momentum=0.9)

        model = _member_model(pop0, i)
        hand, _ = reference_run(model, windows, make_opt=make_opt, precision="bf16")
        exact, _ = reference_run(copy.deepcopy(model).double(), windows64, make_opt=make_opt)
        exact_params = dict(exact.named_parameters())
        got = fasttorch.member(pop, i).params

        errors = fp32_reference_error(model, windows, make_opt=make_opt)
        atol = params_atol(errors, got, precision="bf16", steps=steps, lr=SGD_LRS[i])
        hand_error = _max_error(dict(hand.named_parameters()), exact_params)
        pop_error = _max_error(got, exact_params)
        assert pop_error <= hand_error + atol, (pop_error, hand_error, atol)


def test_member_takes_an_int_or_a_0d_integer_tensor():
    torch.manual_seed(0)
    pop = _population()
    losses = torch.tensor([0.3, 0.1, 0.2])
    best = fasttorch.member(pop, losses.argmin())  # a 0-d int64 tensor
    torch.testing.assert_close(best.params["out.weight"], pop.params["out.weight"][1], **EXACT)
    last = fasttorch.member_state_dict(pop, torch.tensor(-1, dtype=torch.int32))
    torch.testing.assert_close(last["out.weight"], pop.params["out.weight"][2], **EXACT)
    with pytest.raises(
        IndexError, match="index 3 is out of range .* 3 members; valid indices are 0 to 2"
    ):
        fasttorch.member(pop, torch.tensor(3))
    with pytest.raises(TypeError, match=r"tensor of shape \(2,\).*0-d integer tensor"):
        fasttorch.member(pop, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="1.0 of type float.*an int, or a 0-d integer tensor"):
        fasttorch.member(pop, 1.0)
    with pytest.raises(TypeError, match="dtype torch.float32"):
        fasttorch.member(pop, torch.tensor(1.0))


def test_a_population_given_to_a_plain_step_is_refused_at_the_call():
    pop = _population()
    for plain in (
        fasttorch.step(mse),
        fasttorch.compiled(fasttorch.step(mse), backend="aot_eager"),
    ):
        with pytest.raises(
            ValueError, match=r"trains one model.*population of 3 members.*vmapped\(step, 3\)"
        ):
            plain(pop, batches(1, 8)[0])
    assert pop.step.tolist() == [0] * N  # refused before anything ran


def test_in_dims_that_do_not_fit_the_batch_are_refused_at_wrap_or_call():
    pop = _population()
    x, y = batches(1, 8)[0]
    with pytest.raises(TypeError, match="in_dims='0' .*None .* an int d"):
        fasttorch.vmapped(fasttorch.step(mse), N, in_dims="0")
    with pytest.raises(TypeError, match="in_dims=1.5"):
        fasttorch.vmapped_eval(fasttorch.eval_step(mse), N, in_dims=1.5)
    cases = [
        (
            0,
            r"in_dims=0 maps batch\[0\] \(shape \(8, 8\)\) along dimension 0, of size 8, "
            r"but the population has 3 members.*in_dims=None",
        ),
        ((None, 1), r"maps batch\[1\] \(shape \(8, 4\)\) along dimension 1, of size 4"),
        ((0,), r"in_dims=\(0,\) does not match the batch \(a tuple of 2\)"),
        ((None, 2), r"along dimension 2, absent"),
    ]
    for dims, match in cases:
        with pytest.raises(ValueError, match=match):
            fasttorch.vmapped(fasttorch.step(mse), N, in_dims=dims)(pop, (x, y))
    ev = fasttorch.vmapped_eval(fasttorch.eval_step(mse), N, in_dims=0)
    with pytest.raises(ValueError, match="vmapped_eval: in_dims=0 maps batch"):
        ev(pop, (x, y))
    # What fits: x per member, y shared.
    ok = fasttorch.vmapped(fasttorch.step(mse, donate=False), N, in_dims=(0, None))
    new, _ = ok(pop, (torch.stack([x] * N), y))
    assert new.step.tolist() == [1] * N


def test_hyper_needs_one_value_per_member():
    make = LayerNormNet
    with pytest.raises(
        TypeError, match=r"hyper\['lr'\] is 0.001; it takes one value per member, 3 numbers"
    ):
        fasttorch.create_population(make, optim.adamw(1e-3), 3, hyper={"lr": 1e-3})
    with pytest.raises(TypeError, match=r"hyper\['lr'\] is 'abc'"):
        fasttorch.create_population(make, optim.adamw(1e-3), 3, hyper={"lr": "abc"})
    with pytest.raises(TypeError, match=r"a tensor of shape \(\)"):
        fasttorch.create_population(make, optim.adamw(1e-3), 3, hyper={"lr": torch.tensor(1e-3)})
    with pytest.raises(TypeError, match="hyper must map hyperparameter names"):
        fasttorch.create_population(make, optim.adamw(1e-3), 3, hyper=[1e-3] * 3)
    pop = fasttorch.create_population(
        make, optim.adamw(1e-3), 3, hyper={"lr": torch.tensor([1e-3, 2e-3, 3e-3])}
    )
    assert pop.opt_state.hyper["lr"].tolist() == pytest.approx([1e-3, 2e-3, 3e-3])


def test_export_safetensors_refuses_a_population(tmp_path):
    pop = _population()
    with pytest.raises(
        ValueError, match=r"population of 3 members.*fasttorch.member\(population, i\)"
    ):
        fasttorch.checkpoint.export_safetensors(pop, tmp_path / "pop.safetensors")
    assert not (tmp_path / "pop.safetensors").exists()
    out = fasttorch.checkpoint.export_safetensors(
        fasttorch.member(pop, 1), tmp_path / "one.safetensors"
    )
    from safetensors.torch import load_file

    plain = LayerNormNet()
    plain.load_state_dict(load_file(out))
    torch.testing.assert_close(plain.out.weight.detach(), pop.params["out.weight"][1], **EXACT)
