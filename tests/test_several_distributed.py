"""several on 2 gloo ranks: sync_on_last on each member equals two no_sync DDP models."""

from __future__ import annotations

import pytest
from dist_kit import spawn_group
from several_worker import run


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_group(run, 2, tmp_path_factory.mktemp("several"))


@pytest.mark.parametrize("name", ["fp32_eager", "fp32_compiled", "fp16_eager", "bf16_eager"])
def test_gan_with_sync_on_last_equals_no_sync_ddp(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert "exception" not in r, f"rank {rank}:\n{r.get('exception')}"
        assert r["diff"] <= r["atol"], r
        assert r["steps"] == 2
        # One all-reduce per model per window (its gradient bucket, and the window's
        # sample counts), on the window's last call only.
        assert r["per_call"] == [0, 4, 0, 4], r
