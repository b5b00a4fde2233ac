"""CUDA graphs capture every donated step, proven on the CPU with inductor's own checks.

``fasttorch.testing.check_cudagraphs`` runs inductor's CUDA-graph predicates on the
step's AOTAutograd graphs. Each capture test has a twin that must be rejected: the same
step with the static marking switched off (today's unmarked donated step), so the check
cannot pass by saying yes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from reference import LayerNormNet, mse
from torch import nn

import fasttorch
from fasttorch import _compat
from fasttorch.optim import set_hyperparams
from fasttorch.testing import check_cudagraphs
from fasttorch.transforms.compiled import GraphCall


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, 2, c // 2).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT's shape, 2 layers: 28 parameter tensors (the head tied to the embedding)."""

    def __init__(self, vocab: int = 32, context: int = 8, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_loss(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x).flatten(0, 1), y.flatten())


def gpt_batches(n: int = 2, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 32, (rows, 8), generator=g), torch.randint(0, 32, (rows, 8), generator=g))
        for _ in range(n)
    ]


def gpt_state(opt=None) -> fasttorch.TrainState:
    torch.manual_seed(0)
    return fasttorch.TrainState.create(GPT(), opt or fasttorch.optim.adamw(1e-3))


def small_state(opt=None) -> fasttorch.TrainState:
    torch.manual_seed(0)
    return fasttorch.TrainState.create(LayerNormNet(), opt or fasttorch.optim.adamw(1e-2))


def small_batches(n: int = 3, rows: int = 8, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(rows, 8, generator=g).to(dtype), torch.randn(rows, 4, generator=g).to(dtype))
        for _ in range(n)
    ]


@pytest.fixture
def unmarked(monkeypatch):
    """The donated step as it was before static marking: no tensor marked."""
    monkeypatch.setattr(_compat, "mark_static_addresses", lambda tensors: None)


def _by_name(reports):
    return {r.name: r for r in reports}


def _all_ok(reports, names):
    assert {r.name for r in reports} == set(names), reports
    for r in reports:
        assert r.ok, r
        assert r.mutated_inputs == 0 and r.static_inputs > 0, r


# --------------------------------------------------------------------------- the GPT numbers


def test_gpt_whole_step_rejected_unmarked(unmarked):
    (r,) = check_cudagraphs(fasttorch.step(gpt_loss), gpt_state(), gpt_batches())
    # 28 parameters, their two AdamW moments, the step count and the optimizer's count.
    assert (r.name, r.captured, r.mutated_inputs, r.static_inputs) == ("full", False, 86, 0)
    assert any("mutated inputs (86 instances)" in why for why in r.reasons), r.reasons


def test_gpt_whole_step_captured():
    (r,) = check_cudagraphs(fasttorch.step(gpt_loss), gpt_state(), gpt_batches(3))
    assert r.ok and r.calls == 3, r
    assert r.static_inputs >= 86 and r.mutated_inputs == 0


def test_gpt_accumulate_rejected_unmarked(unmarked):
    step = fasttorch.grad_accumulate(fasttorch.step(gpt_loss), 4)
    got = _by_name(check_cudagraphs(step, gpt_state(), gpt_batches()))
    assert (got["micro"].captured, got["micro"].mutated_inputs) == (False, 30)
    assert (got["close"].captured, got["close"].mutated_inputs) == (False, 86)


def test_gpt_accumulate_captured():
    step = fasttorch.grad_accumulate(fasttorch.step(gpt_loss), 4)
    reports = check_cudagraphs(step, gpt_state(), gpt_batches(3))
    _all_ok(reports, ["micro", "close"])
    assert _by_name(reports)["micro"].calls == 12


# --------------------------------------------------------------------------- every donated step


def _amp16(step):
    return fasttorch.with_amp(step, "fp16")


# Several transforms per case: each compile costs seconds, and every transform, every
# optimizer and both accumulation forms are still covered.
CASES = {
    "across_calls_ema_skip_nonfinite": (
        lambda s: fasttorch.ema(
            fasttorch.skip_nonfinite(fasttorch.grad_accumulate(s, 2, across_calls=True)), 0.9
        ),
        None,
    ),
    "with_amp_fp16_clip_accumulate": (
        lambda s: fasttorch.clip_scaled(fasttorch.grad_accumulate(_amp16(s), 2), 1.0),
        None,
    ),
    "sgd": (lambda s: s, fasttorch.optim.sgd(0.1, momentum=0.9, nesterov=True)),
    "adam_schedule": (lambda s: s, fasttorch.optim.adam(fasttorch.schedules.cosine(1e-2, 10))),
    "from_torch_adamw": (lambda s: s, fasttorch.optim.from_torch(torch.optim.AdamW, lr=1e-2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_donated_step_captured(case):
    wrap, opt = CASES[case]
    step = wrap(fasttorch.step(mse))
    reports = check_cudagraphs(step, small_state(opt), small_batches())
    assert reports
    for r in reports:
        assert r.ok and r.mutated_inputs == 0, r


@pytest.mark.parametrize("case", ["across_calls_ema_skip_nonfinite", "from_torch_adamw"])
def test_donated_step_rejected_unmarked(case, unmarked):
    wrap, opt = CASES[case]
    reports = check_cudagraphs(wrap(fasttorch.step(mse)), small_state(opt), small_batches())
    assert any(not r.captured and r.mutated_inputs > 0 for r in reports), reports


# --------------------------------------------------------------------------- what it must reject


def test_rejects_a_custom_step_that_writes_into_its_state():
    def custom(state, batch):
        for p in state.params.values():
            p.mul_(0.5)
        return state, {"n": batch.sum()}

    (r,) = check_cudagraphs(custom, small_state(), [torch.ones(2)] * 2)
    assert not r.captured and r.mutated_inputs == len(small_state().params), r
    assert any("mutated inputs" in why for why in r.reasons)


def test_notes_symbolic_shapes():
    batches = small_batches(1, rows=8) + small_batches(1, rows=6) + small_batches(1, rows=4)
    reports = check_cudagraphs(fasttorch.step(mse), small_state(), batches)
    assert len(reports) == 2, reports  # the static graph, then one with symbolic sizes
    assert reports[0].ok
    assert not reports[1].ok and "symbolic shapes" in reports[1].notes[0], reports[1]


def test_notes_static_inputs_that_move_and_set_hyperparams_in_place():
    def new_lr(state):
        return state.replace(opt_state=set_hyperparams(state.opt_state, lr=0.5e-2))

    def same_lr(state):
        return state.replace(opt_state=set_hyperparams(state.opt_state, lr=0.5e-2, in_place=True))

    (moved,) = check_cudagraphs(fasttorch.step(mse), small_state(), small_batches(), between=new_lr)
    assert moved.captured and not moved.ok and "moved on 2 of 3 calls" in moved.notes[0], moved
    (kept,) = check_cudagraphs(fasttorch.step(mse), small_state(), small_batches(), between=same_lr)
    assert kept.ok, kept


def test_leaves_the_given_state_alone():
    state = small_state()
    before = {k: p.clone() for k, p in state.params.items()}
    check_cudagraphs(fasttorch.step(mse), state, small_batches(2))
    assert int(state.step) == 0
    for k, p in state.params.items():
        assert torch.equal(p, before[k])


# --------------------------------------------------------------------------- the pieces


def test_commit_keeps_every_leaf_and_nothing_recompiles():
    _compat.dynamo_reset()
    counters = _compat.dynamo_counters()
    counters.clear()
    step = fasttorch.compiled(
        fasttorch.ema(fasttorch.grad_accumulate(fasttorch.step(mse), 2, across_calls=True), 0.9),
        backend="aot_eager",
    )
    state = step.init(small_state())
    first = _leaf_ids(state)
    for batch in small_batches(4):
        state, _ = step(state, batch)
    assert _leaf_ids(state) == first and len(first) > 20
    assert all(_compat.is_static_address(t) for t in torch.utils._pytree.tree_leaves(state))
    assert sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])


def _leaf_ids(state) -> dict[str, int]:
    flat = torch.utils._pytree.tree_flatten_with_path(state)[0]
    return {torch.utils._pytree.keystr(path): id(t) for path, t in flat}


def test_one_graph_tree_step_per_call(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append(1))
    step = fasttorch.grad_accumulate(fasttorch.step(mse), 4)
    reports = check_cudagraphs(step, small_state(), small_batches(3, rows=8))
    assert _by_name(reports)["micro"].calls == 12
    assert len(calls) == 3  # one per call, not one per graph


def test_reduce_overhead_is_set_up_at_wrap_time():
    step = fasttorch.compiled(fasttorch.step(mse), mode="reduce-overhead")
    assert isinstance(step.runner, GraphCall)
    assert step.jit.static_state
    plain = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    assert not isinstance(plain.runner, GraphCall)


def test_reduce_overhead_refuses_a_step_without_donation():
    with pytest.raises(ValueError, match="CUDA graphs need a donating step"):
        fasttorch.compiled(fasttorch.step(mse, donate=False), mode="reduce-overhead")
    # Without CUDA graphs the copying step compiles as before.
    fasttorch.compiled(fasttorch.step(mse, donate=False), mode="max-autotune-no-cudagraphs")


def test_set_hyperparams_in_place():
    opt_state = fasttorch.optim.adamw(1e-3).init({"w": torch.zeros(3)})
    lr, wd = opt_state.hyper["lr"], opt_state.hyper["weight_decay"]
    new = set_hyperparams(opt_state, lr=2e-3, weight_decay=0.5, in_place=True)
    assert new.hyper["lr"] is lr and new.hyper["weight_decay"] is wd
    assert math.isclose(float(lr), 2e-3, rel_tol=1e-6) and float(wd) == 0.5
    with pytest.raises(ValueError):
        set_hyperparams(new, lr=3e-3, weight_decay=float("nan"), in_place=True)
    assert math.isclose(float(lr), 2e-3, rel_tol=1e-6)  # checked before anything is written
    copy = set_hyperparams(new, lr=1.0)
    assert copy.hyper["lr"] is not lr and math.isclose(float(lr), 2e-3, rel_tol=1e-6)


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone, for sync_on_last."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
def test_sync_on_last(world_of_one, marked, monkeypatch):
    if not marked:
        monkeypatch.setattr(_compat, "mark_static_addresses", lambda tensors: None)
    step = fasttorch.sync_on_last(fasttorch.grad_accumulate(fasttorch.step(mse), 2))
    got = _by_name(check_cudagraphs(step, small_state(), small_batches()))
    # The last microbatch's forward and backward run with the reducer's hooks as two
    # graphs that write nothing; the microbatch and update graphs write into the state.
    assert got["micro"].captured is marked and got["apply_update"].captured is marked, got
    assert got["micro"].ok is marked and got["apply_update"].ok is marked
    assert got["loss"].captured


def test_a_graph_cuda_graphs_skip_is_said_once_in_plain_words():
    """On a GPU, the first call compares inductor's skip counter (only CUDA has one)."""
    from fasttorch.transforms.compiled import _first_graph_call

    def skipped(*args):  # a compiled graph that inductor ran without CUDA graphs
        _compat.dynamo_counters()["inductor"]["cudagraph_skips"] += 1
        return "out"

    def captured(*args):
        return "out"

    def _probe_graph(state, batch):
        raise AssertionError("the compiled function runs, not this one")

    assert _first_graph_call(captured, _probe_graph, (), {}, False) == "out"
    with pytest.warns(UserWarning, match="CUDA graphs do not capture the step's 'probe_graph'"):
        assert _first_graph_call(skipped, _probe_graph, (), {}, False) == "out"
