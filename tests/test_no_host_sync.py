"""No host sync inside a step: .item() and bool(tensor) raise while composed steps run."""

from __future__ import annotations

import contextlib

import pytest
import torch
from reference import BatchNormNet, batches, mse

import fasttorch


@contextlib.contextmanager
def forbid_host_sync():
    def refuse(name):
        def f(self, *args, **kwargs):
            raise AssertionError(f"host sync inside a step: Tensor.{name}")

        return f

    saved = {n: getattr(torch.Tensor, n) for n in ("item", "__bool__", "tolist")}
    try:
        for n in saved:
            setattr(torch.Tensor, n, refuse(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_the_guard_has_teeth():
    with forbid_host_sync(), pytest.raises(AssertionError, match="Tensor.item"):
        torch.ones(()).item()


def _steps(mode):
    base = fasttorch.step(mse)
    out = {
        "plain": base,
        "fp16+clip+within": fasttorch.clip_scaled(
            fasttorch.grad_accumulate(fasttorch.with_amp(base, "fp16"), 2), 1.0
        ),
        "bf16+across": fasttorch.grad_accumulate(
            fasttorch.with_amp(base, "bf16"), 2, across_calls=True
        ),
    }
    if mode == "compiled":
        out = {k: fasttorch.compiled(v, backend="aot_eager") for k, v in out.items()}
    return out


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_composed_steps_run_without_host_sync(mode):
    sched = fasttorch.schedules.warmup(2, fasttorch.schedules.cosine(1e-2, 10))
    for name, step in _steps(mode).items():
        torch.manual_seed(0)
        state = fasttorch.TrainState.create(BatchNormNet(), fasttorch.optim.adamw(sched))
        data = batches(6, 8)
        if mode == "compiled":  # compile first: tracing may inspect values, steps may not
            state, _ = step(state, data[0])
            state, _ = step(state, data[1])
        bad = (data[2][0] * float("inf"), data[2][1])
        with forbid_host_sync():
            for b in [*data[2:], bad]:
                state, m = step(state, b)
        assert isinstance(m["loss"], torch.Tensor) and int(state.step) >= 2, name


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_the_profiler_sees_no_scalar_reads(mode):
    """Syncs made in C++ (a 0-d tensor read as a Scalar) escape the Python patch above;
    the profiler's count of aten::_local_scalar_dense catches them.

    The only reads allowed are torch's fused CPU kernel's own (the opaque update, the
    default on a CPU: ``_fused_adamw_`` and ``_fused_sgd_`` read their lr and step counts
    in C++, as ``torch.optim.AdamW(fused=True)`` on a CPU does; host memory, nothing to
    wait for; a GPU step never runs them)."""
    sched = fasttorch.schedules.warmup(2, fasttorch.schedules.cosine(1e-2, 10))
    for name, step in _steps(mode).items():
        for opt in (
            fasttorch.optim.adamw(sched),  # opaque: torch's fused CPU kernel
            fasttorch.optim.adamw(sched, opaque=False),  # the _foreach form
            fasttorch.optim.sgd(0.1, momentum=0.9),
            fasttorch.optim.sgd(0.1, momentum=0.9, opaque=False),
        ):
            torch.manual_seed(0)
            state = fasttorch.TrainState.create(BatchNormNet(), opt)
            data = batches(4, 8)
            state, _ = step(state, data[0])
            state, _ = step(state, data[1])
            with torch.profiler.profile() as prof:
                for b in data[2:]:
                    state, _ = step(state, b)
            reads = [
                e
                for e in prof.events()
                if e.name == "aten::_local_scalar_dense" and not _in_fused_kernel(e)
            ]
            assert not reads, (name, opt, len(reads))


def _in_fused_kernel(event) -> bool:
    """Whether a profiler event ran inside one of torch's fused optimizer kernels."""
    while event is not None:
        if event.name.startswith("aten::_fused_"):
            return True
        event = event.cpu_parent
    return False


@pytest.mark.gpu
def test_no_sync_under_cuda_sync_debug_mode():
    torch.manual_seed(0)
    model = BatchNormNet().cuda()
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-2))
    step = fasttorch.clip_scaled(
        fasttorch.grad_accumulate(fasttorch.with_amp(fasttorch.step(mse), "fp16"), 2), 1.0
    )
    data = [(x.cuda(), y.cuda()) for x, y in batches(4, 8)]
    state, _ = step(state, data[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in data[1:]:
            state, m = step(state, b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert m["loss"].is_cuda
