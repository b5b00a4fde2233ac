"""fasttorch._compile.fingerprint: what a warm start's key sees, and what it ignores."""

from __future__ import annotations

import torch

import fasttorch
from fasttorch._compile.fingerprint import TooDeep, fingerprint

SCALE = 2.0


def _mse(apply, batch):
    return torch.nn.functional.mse_loss(apply(batch[0]), batch[1])


def _scaled(apply, batch):
    return SCALE * torch.nn.functional.mse_loss(apply(batch[0]), batch[1])


def _build(lr=1e-2, eps=1e-5, loss=_mse, cache_dir=None, seed=0, rows=8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8, eps=eps))
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(lr))
    kwargs = {"cache_dir": cache_dir} if cache_dir else {}
    step = fasttorch.compiled(fasttorch.step(loss), **kwargs)
    batch = (torch.randn(rows, 4), torch.randn(rows, 8))
    return fingerprint(step, state, batch)


def test_equal_for_a_step_built_again_and_other_tensor_values():
    assert _build() == _build()
    assert _build(seed=1) == _build(seed=2)  # values are not part of it, metadata is


def test_changes_with_what_a_trace_bakes_in():
    base = _build()
    assert _build(lr=3e-2) != base  # a hyperparameter
    assert _build(eps=1e-6) != base  # a module's attribute
    assert _build(rows=6) != base  # a shape
    assert _build(loss=_scaled) != base  # other code


def test_changes_with_a_global_the_loss_reads(monkeypatch):
    base = _build(loss=_scaled)
    monkeypatch.setattr(__import__(__name__), "SCALE", 3.0)
    assert _build(loss=_scaled) != base


def test_changes_with_a_closure_value():
    def make(k):
        def loss(apply, batch):
            return k * torch.nn.functional.mse_loss(apply(batch[0]), batch[1])

        return loss

    assert _build(loss=make(1.0)) == _build(loss=make(1.0))
    assert _build(loss=make(1.0)) != _build(loss=make(2.0))


def test_ignores_where_the_cache_is(tmp_path):
    assert _build(cache_dir=str(tmp_path / "a")) == _build(cache_dir=str(tmp_path / "b"))


def test_aliasing_and_set_order():
    t = torch.zeros(3)
    assert fingerprint([t, t]) != fingerprint([t, torch.zeros(3)])
    assert fingerprint({"b", "a", "c"}) == fingerprint({"c", "a", "b"})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_a_module_by_its_training_mode_and_parameters():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    base = fingerprint(m)
    m.eval()
    assert fingerprint(m) != base
    m.train()
    assert fingerprint(m) == base
    m[0].weight.requires_grad_(False)
    assert fingerprint(m) != base


def test_values_without_fields_by_what_they_print():
    np = __import__("pytest").importorskip("numpy")
    assert fingerprint(np.float32(1e-3)) != fingerprint(np.float32(2e-3))
    assert fingerprint(np.arange(3)) != fingerprint(np.arange(3) + 1)
    assert fingerprint(np.arange(3)) == fingerprint(np.arange(3))
    # No printed value (an address): the type alone, equal across instances.
    assert fingerprint(object()) == fingerprint(object())


def test_too_deep_gives_no_digest():
    nested: list = []
    for _ in range(100):
        nested = [nested]
    with __import__("pytest").raises(TooDeep, match="deeper than"):
        fingerprint(nested)
