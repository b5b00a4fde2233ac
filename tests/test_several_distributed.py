"""several on 2 gloo ranks: sync_on_last on each member equals two no_sync DDP models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_kit import spawn_group
from several_worker import N, d_loss, g_loss, gan_models
from several_worker import run as run_ranks

import fasttorch
from fasttorch.distributed import sync_on_last


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("several")


@pytest.fixture(scope="module")
def results(out_dir):
    return spawn_group(run_ranks, 2, out_dir)


@pytest.mark.parametrize(
    "name", ["fp32_eager", "fp32_compiled", "fp16_eager", "fp16_compiled", "bf16_eager"]
)
def test_gan_with_sync_on_last_equals_no_sync_ddp(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert "exception" not in r, f"rank {rank}:\n{r.get('exception')}"
        assert r["diff"] <= r["atol"], r
        assert r["steps"] == 2
        # One all-reduce per model per window (its gradient bucket, and the window's
        # sample counts), on the window's last call only.
        assert r["per_call"] == [0, 4, 0, 4], r


def test_a_checkpoint_saved_by_2_ranks_loads_in_one_process(results, out_dir):
    """DCP resharding, per member: each rank's RNG and data are its own; the
    replicated parameters load whole."""
    saved = results[0]["fp32_eager"]
    assert saved["saved"] == results[1]["fp32_eager"]["saved"]

    def member(loss_fn):
        s = fasttorch.model_step(loss_fn)
        return sync_on_last(fasttorch.grad_accumulate(s, N, across_calls=True))

    step = fasttorch.several({"d": member(d_loss), "g": member(g_loss)})
    d, g = gan_models(seed=5, batchnorm=False)  # other values, the same shapes
    template = step.init(
        fasttorch.Models.create(
            d=fasttorch.TrainState.create(d, fasttorch.optim.adam(1e-2)),
            g=fasttorch.TrainState.create(g, fasttorch.optim.adam(1e-2)),
        )
    )
    root = Path(out_dir) / "ckpt"
    state, data = fasttorch.checkpoint.load_models(
        root, fasttorch.checkpoint.latest_models(root), template
    )
    assert data == {"rank": 0}
    for key, values in saved["params"].items():
        tag, name = key.split(".", 1)
        assert torch.equal(state[tag].params[name], torch.tensor(values)), key
