"""The eager optimizer step launches what the hand loop launches on a GPU, proven on CPU.

``ForeachLint`` (benchmarks/foreach_rule.py) applies CUDA's rule for a ``_foreach_*`` call's
multi-tensor path to every call: a built-in optimizer's eager step has no call that
CUDA would run one tensor at a time. Where the fused kernels apply (a donated eager
step on a GPU; here the tests add "cpu" to ``FUSED_DEVICES``) the update is torch's
fused kernel, bit for bit ``torch.optim``'s ``fused=True`` with the same values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from reference import LayerNormNet, batches, mse
from torch.utils._python_dispatch import TorchDispatchMode

import fasttorch
from benchmarks.foreach_rule import ForeachLint
from fasttorch import optim, schedules
from fasttorch.optim import _base

OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "sgd": lambda lr: optim.sgd(lr, weight_decay=0.01),
    "sgd_momentum": lambda lr: optim.sgd(lr, momentum=0.9, dampening=0.1),
    "sgd_nesterov": lambda lr: optim.sgd(lr, momentum=0.9, nesterov=True),
    "adam": lambda lr: optim.adam(lr, weight_decay=0.1),
    "adamw": lambda lr: optim.adamw(lr),
    "groups": lambda lr: optim.groups(
        optim.adamw(lr), [(lambda name, p: p.dim() < 2, {"weight_decay": 0.0})]
    ),
}


@pytest.fixture
def fused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the fused path on CPU tensors, as a GPU step would."""
    monkeypatch.setattr(_base, "FUSED_DEVICES", frozenset({"cuda", "cpu"}))


class _Ops(TorchDispatchMode):
    """Counts non-view ATen ops by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            name = str(func.overloadpacket)
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _lint_steps(name: str, schedule: bool, precision: str, donate: bool) -> ForeachLint:
    lr: Any = schedules.one_cycle(0.01, 10) if schedule else 0.01
    torch.manual_seed(0)
    step = fasttorch.with_amp(fasttorch.step(mse, donate=donate), precision)
    state = step.init(fasttorch.TrainState.create(LayerNormNet(), OPTIMIZERS[name](lr)))
    lint = ForeachLint()
    with lint:
        for batch in batches(2, 8):
            state, _ = step(state, batch)
    return lint


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("schedule", [False, True], ids=["fixed_lr", "schedule"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_no_foreach_call_takes_cudas_per_tensor_path(name: str, schedule: bool, precision: str):
    for donate in (True, False):
        lint = _lint_steps(name, schedule, precision, donate)
        assert lint.calls, "the lint saw no _foreach_ call: it would prove nothing"
        assert lint.slow == [], (donate, lint.slow)


@pytest.mark.usefixtures("fused_on_cpu")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("schedule", [False, True], ids=["fixed_lr", "schedule"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_donated_eager_step_runs_the_fused_kernel(name: str, schedule: bool, precision: str):
    lint = _lint_steps(name, schedule, precision, donate=True)
    assert lint.slow == [], lint.slow
    fused = sum(n for op, n in lint.calls.items() if op.startswith("aten._fused_"))
    if name == "sgd_momentum":  # dampening 0.1: torch's kernel computes another start
        assert fused == 0
    else:
        # one per step and dtype (one here), per group as torch.optim's param_groups
        assert fused == 2 * (2 if name == "groups" else 1), lint.calls


def _old_adamw_calls(p: list[torch.Tensor], g: list[torch.Tensor], lr: torch.Tensor) -> None:
    """The calls of AdamW's eager update before the fix, on its own tensors."""
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    beta1, beta2, eps, wd = (torch.tensor(x) for x in (0.9, 0.999, 1e-8, 0.01))
    torch._foreach_mul_(p, 1 - lr * wd)
    torch._foreach_lerp_(m, g, [(1 - beta1).to(t.dtype) for t in m])
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, 1 - float(beta2))
    t = torch.ones((), dtype=torch.float64)
    step_size = lr / (1 - beta1**t)
    denom = list(torch._foreach_sqrt(v))
    torch._foreach_div_(denom, (1 - beta2**t).sqrt())
    torch._foreach_add_(denom, [eps] * len(denom))
    torch._foreach_mul_(g, step_size)


def test_the_lint_flags_the_old_update_and_passes_torchs_own():
    """It cannot pass by saying nothing: the former update's four slow calls (five
    with a float64 scheduled lr) are found; torch.optim's foreach AdamW has none."""
    p = [torch.randn(4, 3), torch.randn(3)]
    g = [torch.randn(4, 3), torch.randn(3)]
    lint = ForeachLint()
    with lint:
        _old_adamw_calls([t.clone() for t in p], [t.clone() for t in g], torch.tensor(0.01))
    assert [op for op, _, _ in lint.slow] == [
        "aten._foreach_lerp_.List",
        "aten._foreach_div_.Tensor",
        "aten._foreach_add_.List",
        "aten._foreach_mul_.Tensor",
    ], lint.slow
    assert "shapes differ across lists" in lint.slow[0][1]
    assert "torch.float64" in lint.slow[1][1]
    with lint:
        _old_adamw_calls(p, g, torch.tensor(0.01, dtype=torch.float64))
    assert len(lint.slow) == 4 + 5
    model = LayerNormNet()
    ref = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    for q in model.parameters():
        q.grad = torch.randn_like(q)
    lint = ForeachLint()
    with lint:
        ref.step()
    assert lint.calls and lint.slow == []


def _hyper32(x: float) -> float:
    """A hyperparameter as fasttorch's state holds it (a float32 tensor)."""
    return float(torch.tensor(x, dtype=torch.float32))


@pytest.mark.usefixtures("fused_on_cpu")
@pytest.mark.parametrize(
    "name, dtype",
    [
        *((n, d) for n in ("adamw", "adam", "sgd") for d in (torch.float32, torch.bfloat16)),
        ("sgd_nesterov", torch.float32),  # half-precision momentum: see sgd._fused_lists
    ],
)
def test_fused_update_is_torchs_fused_step_bit_for_bit(name: str, dtype: torch.dtype):
    """Rule 1 (tests/tolerance.py): the same kernel on the same values."""
    torch.manual_seed(0)
    model = LayerNormNet().to(dtype)
    ref = copy.deepcopy(model)
    lr = torch.tensor(0.01)
    if name.startswith("adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        wd = 0.01 if name == "adamw" else 0.1
        opt = optim.adamw(0.01) if name == "adamw" else optim.adam(0.01, weight_decay=0.1)
        kw: dict[str, Any] = {
            "betas": (_hyper32(0.9), _hyper32(0.999)),
            "eps": _hyper32(1e-8),
            "weight_decay": _hyper32(wd),
        }
        torch_opt = cls(ref.parameters(), lr=lr, fused=True, **kw)
    else:
        nesterov = name == "sgd_nesterov"
        opt = optim.sgd(0.01, momentum=0.9 if nesterov else 0.0, nesterov=nesterov)
        mom = _hyper32(0.9) if nesterov else 0.0
        torch_opt = torch.optim.SGD(
            ref.parameters(), lr=lr, momentum=mom, nesterov=nesterov, fused=True
        )
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = opt.init(params)
    gen = torch.Generator().manual_seed(1)
    for k in range(4):
        grads = {n: torch.randn(p.shape, generator=gen).to(dtype) for n, p in params.items()}
        for n, q in ref.named_parameters():
            q.grad = grads[n].clone()
        torch_opt.step()
        lint = ForeachLint()
        with lint:
            params, state = opt.update(params, grads, state, torch.tensor(k), inplace=True)
        assert any(op.startswith("aten._fused_") for op in lint.calls), lint.calls
        for n, q in ref.named_parameters():
            assert torch.equal(params[n], q.detach()), (k, n)
        for slot, by_name in state.slots.items():
            for n, q in ref.named_parameters():
                assert torch.equal(by_name[n], torch_opt.state[q][slot]), (k, slot, n)


@pytest.mark.usefixtures("fused_on_cpu")
@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov"])
def test_fused_update_unscales_and_skips_as_gradscaler_does(name: str):
    """fused_update divides the loss scale out and skips on found_inf inside the kernel:
    the same bits as an unscaled update, and no change at all when skipped."""
    torch.manual_seed(0)
    opt = OPTIMIZERS[name](0.01)
    params = {n: p.detach().clone() for n, p in LayerNormNet().named_parameters()}
    state = opt.init(params)
    grads = {n: torch.randn_like(p) for n, p in params.items()}
    scale = torch.tensor(2.0**10)
    ref_p, ref_s = opt.update(
        {n: t.clone() for n, t in params.items()},
        {n: t.clone() for n, t in grads.items()},
        copy.deepcopy(state),
        torch.tensor(0),
        inplace=True,
    )
    before = [t.clone() for t in torch.utils._pytree.tree_leaves((params, state))]
    skipped = opt.fused_update(
        params,
        {n: t * scale for n, t in grads.items()},
        state,
        torch.tensor(0),
        grad_scale=scale,
        found_inf=torch.tensor(True),
    )
    assert skipped is not None
    for old, new in zip(before, torch.utils._pytree.tree_leaves(skipped)):
        assert torch.equal(old, new)
    params, state = skipped
    new_p, new_s = opt.fused_update(
        params,
        {n: t * scale for n, t in grads.items()},
        state,
        torch.tensor(0),
        grad_scale=scale,
        found_inf=torch.tensor(False),
    )
    assert int(new_s.count) == 1
    for a, b in zip(
        torch.utils._pytree.tree_leaves((new_p, new_s)),
        torch.utils._pytree.tree_leaves((ref_p, ref_s)),
    ):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("fused_on_cpu")
def test_fp16_step_takes_no_copy_and_no_select_of_the_state():
    """with_amp fp16, donated, eager: the fused kernel takes the scale and the skip flag
    (as GradScaler with a fused optimizer); the old path cloned the state and selected
    every tensor with torch.where."""
    torch.manual_seed(0)
    step = fasttorch.with_amp(fasttorch.step(mse), "fp16")
    state = step.init(fasttorch.TrainState.create(LayerNormNet(), optim.adamw(0.01)))
    n = len(state.params)
    batch = batches(1, 8)[0]
    state, _ = step(state, batch)
    ops = _Ops()
    with ops:
        state, m = step(state, batch)
    assert not bool(m["skipped"])
    assert ops.ops.get("aten._fused_adamw_", 0) == 1
    assert ops.ops.get("aten.where", 0) < n and ops.ops.get("aten.clone", 0) < n, ops.ops


@pytest.mark.usefixtures("fused_on_cpu")
@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov"])
def test_fp16_step_is_the_gradscaler_fused_loop_bit_for_bit(name: str):
    """with_amp fp16 on the fused path, with an overflow, against the hand loop:
    autocast, GradScaler and torch.optim's fused=True optimizer with the same values.
    Rule 1: the same forward, backward and kernel, so the same bits and decisions."""
    torch.manual_seed(0)
    model = LayerNormNet()
    ref = copy.deepcopy(model)
    step = fasttorch.with_amp(fasttorch.step(mse), "fp16")
    state = step.init(fasttorch.TrainState.create(model, OPTIMIZERS[name](0.01)))
    lr = torch.tensor(0.01)
    if name == "adamw":
        betas, eps, wd = (_hyper32(0.9), _hyper32(0.999)), _hyper32(1e-8), _hyper32(0.01)
        opt: Any = torch.optim.AdamW(
            ref.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True
        )
    else:
        opt = torch.optim.SGD(
            ref.parameters(), lr=lr, momentum=_hyper32(0.9), nesterov=True, fused=True
        )
    scaler = torch.amp.GradScaler("cpu")
    data = batches(4, 8)
    bad = data[2][0].clone()
    bad[0, 0] = float("inf")
    data[2] = (bad, data[2][1])
    for x, y in data:
        state, m = step(state, (x, y))
        with torch.autocast("cpu", torch.float16):
            loss = mse(ref, (x, y))
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert float(m["loss_scale"]) == scale
        assert bool(m["skipped"]) == (not torch.isfinite(loss).item())
    assert int(state.opt_state.count) == 3
    for n, q in ref.named_parameters():
        assert torch.equal(state.params[n], q.detach()), n
