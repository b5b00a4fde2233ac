"""Tensor parallelism with FSDP2 on a 2-D mesh (``fasttorch.distributed.parallelize``):
one spawned 4-rank gloo group (2 data-parallel x 2 tensor-parallel) runs every check of
tests/tp_worker.py, with a deadline so that a hang fails; this process writes nothing
first and loads the group's 2 x 2 checkpoint afterwards."""

from __future__ import annotations

import pytest
import torch
from dist_kit import spawn_group
from fsdp_ckpt_worker import leaves
from tp_worker import LR, compose, plain, run

from fasttorch import TrainState, checkpoint, optim

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


@pytest.mark.parametrize(
    "name", ["fp32_eager", "fp32_compiled", "sequence_fp32_eager", "bf16_eager"]
)
def test_a_2d_parallel_run_equals_one_process_on_the_whole_batch(group, name):
    """with_amp (bf16), grad_accumulate, sync_on_last, clip_scaled, ema, AdamW, eager and
    compiled, on 2 x 2 ranks against one process on the whole batch, with Megatron's plan
    and with torchtitan's (sequence parallel norms, row-wise embedding, column-wise head);
    bounds from tests/tolerance.py's rules (see tp_worker.check_equals_single_process)."""
    results = _get(group, name)
    for r in results:
        assert r == results[0]  # every rank holds the same whole parameters and metrics
        assert r["steps"] == 3
        assert r["diff"] <= r["bound"], r
        assert r["ema_diff"] <= r["bound"], r
        assert r["loss_diff"] <= r["loss_bound"], r
        # the global norm over pieces sharded on 2 dims and pieces the TP peers both
        # hold: clipping binds (clip 0.5), so a norm off by a replica shows here
        assert r["norm_rel_diff"] <= r["norm_bound"], r
        assert r["ref_norm"] > 0.5, r
        assert r["peers_equal"], r  # what the plan leaves whole stays equal on TP peers


def test_compiled_says_the_forward_and_backward_run_eagerly(group):
    (r, *_) = _get(group, "fp32_compiled")
    assert any("FSDP2, whose hooks run" in w for w in r["warnings"]), r


def test_tensor_parallel_peers_draw_the_same_dropout_masks(group):
    """replicate seeds one stream per data-parallel rank: dropout (p = 0.5) on the
    activations the peers share keeps their copies equal; a stream per rank, as data
    parallelism seeds it, does not (the check sees the difference)."""
    for r in _get(group, "dropout"):
        assert r == {"data_parallel": True, "per_rank": False}, r


def test_a_2x2_checkpoint_resumes_bit_exactly_and_loads_on_other_meshes(group):
    """Saved on 2 x 2: a fresh 2 x 2 template resumes the same steps bit for bit; 1 x 4
    (tensor parallel only) and 4 x 1 (FSDP2 only) templates read every leaf (shards,
    AdamW moments, EMA, scalars) equal, bitwise, to the 2 x 2 state gathered whole."""
    for res in _get(group, "checkpoint"):
        assert res["data"] == {"next": 2}
        assert res["leaves_equal"] and res["metrics_equal"], res
        for shape in ("1x4", "4x1"):
            assert res[shape] == [], res
            assert res[f"{shape}_compared"] > 100, res
        # then replicate(state): one dropout stream per data-parallel rank, shared by
        # the tensor-parallel peers (all 4 on 1 x 4; none on 4 x 1)
        assert res["1x4_streams"] == 1 and res["4x1_streams"] == 4, res


def test_a_2x2_checkpoint_loads_in_one_plain_process(group):
    """2 x 2 -> 1: a plain template (no process group) of the same model and step reads
    every leaf equal, bitwise, to the 2 x 2 state gathered whole at the save."""
    out, _ = group
    whole = torch.load(out / "at_save.pt", weights_only=True)
    step = compose("fp32", False)
    template = step.init(TrainState.create(plain(), optim.adamw(LR)))
    state, data = checkpoint.load(out / "ck" / "tp", template)
    assert data == {"next": 2}
    got = leaves(state)
    assert got.keys() == whole.keys()
    for k in whole:
        assert torch.equal(got[k], whole[k]), k


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("mesh_names", "without ['dp_shard', 'tp']"),
        ("no_module", "plan key 'blocks.*.qkv' names no module of TinyLM"),
        ("heads", "n_head=2 heads, which tp=4 ranks do not split evenly"),
        ("width", "(Linear with out_features=18) over tp=4 ranks, which does not divide"),
        ("blocks", "blocks='layers' names no submodule"),
        ("not_a_style", "str is not a ParallelStyle"),
        ("compile_no_blocks", "compile= compiles each block, but blocks=None names none"),
        ("twice", "already a DTensor"),
        ("across_calls", "across_calls=True"),
        ("no_sync_on_last", "sync_on_last"),
    ],
)
def test_misuse_is_a_clear_error_on_every_rank_before_anything_is_sharded(group, case, words):
    for r in _get(group, "errors"):
        assert r[case] is not None and words in r[case], r
