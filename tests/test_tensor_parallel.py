"""Tensor parallelism with FSDP2 on a 2-D mesh (``fasttorch.distributed.parallelize``):
one spawned 4-rank gloo group (2 data-parallel x 2 tensor-parallel) runs every check of
tests/tp_worker.py, with a deadline so that a hang fails; this process writes nothing
first and loads the group's 2 x 2 checkpoint afterwards."""

from __future__ import annotations

import pytest
import torch
from dist_kit import spawn_group
from fsdp_ckpt_worker import leaves
from tp_worker import run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    return out, spawn_group(run, 4, out, deadline_s=300)


def _get(group, name):
    _, results = group
    for r, res in enumerate(results):
        assert "exception" not in res[name], f"rank {r}:\n{res[name].get('exception')}"
    return [res[name] for res in results]
