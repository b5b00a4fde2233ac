"""States sharded with FSDP2 (``fully_shard``) on gloo with 2 processes: one spawned
group runs every check of tests/fsdp_worker.py (a group costs seconds to start), with a
deadline so that a hang fails instead of stalling."""

from __future__ import annotations

import pytest
import torch
from dist_kit import spawn_group
from fsdp_worker import CHECKS, run, run_cuda


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_group(run, 2, tmp_path_factory.mktemp("fsdp"))


def _get(results, name):
    for r, res in enumerate(results):
        assert "exception" not in res[name], f"rank {r}:\n{res[name].get('exception')}"
    return [res[name] for res in results]


EQUALS = [n for n in CHECKS if n.endswith(("_eager", "_compiled", "_compiled_blocks"))]


# Known defect until the opaque update: with the _foreach form of torch's capturable
# AdamW, one case (fp32, shards of 16 and 14 rows, blocks compiled) landed 2.98e-7 from
# the one process on one element of hidden.lin.weight (|w| = 0.128), above rule 2's
# 2.24e-7. With torch's fused kernel on both sides (a donated CPU step's default) it is
# within rule 2, as every other case; strict: the mark fails the suite once it passes.
_OVER_RULE_2: set[str] = set()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=pytest.mark.xfail(strict=True, reason="2.98e-7 against rule 2's 2.24e-7"),
        )
        if n in _OVER_RULE_2
        else n
        for n in EQUALS
    ],
)
def test_a_sharded_run_equals_one_process_on_the_whole_batch(results, name):
    """Each composition (with_amp bf16/fp16, grad_accumulate, clip_scaled,
    skip_nonfinite, ema, the optimizers), eager and compiled; bounds from
    tests/tolerance.py's rules (see fsdp_worker.check_equals_single_process)."""
    mine, theirs = _get(results, name)
    assert mine == theirs  # every rank holds the same full parameters and loss
    assert mine["steps"] == 4
    assert mine["diff"] <= mine["bound"], mine
    assert mine["loss_diff"] <= mine["loss_bound"], mine
    assert mine["norm_rel_diff"] <= mine["norm_bound"], mine  # AdamW and clip hide a scale
    if "ema_diff" in mine:
        assert mine["ema_diff"] <= mine["bound"], mine
    if "scale" in mine:
        assert mine["scale"] == mine["ref_scale"], mine


def test_fsdp2_mixed_precision_policy_equals_the_plain_fsdp2_loop(results):
    for r in _get(results, "mixed_precision_policy"):
        assert r["diff"] <= r["bound"], r


def test_per_rank_state_memory_is_half_of_the_replicated_one(results, capsys):
    for rank, r in enumerate(_get(results, "memory")):
        with capsys.disabled():
            print(
                f"\nrank {rank}: parameters + AdamW state {r['sharded_bytes']} bytes sharded, "
                f"{r['replicated_bytes']} replicated: {r['ratio']:.4f} of it"
            )
        # Exactly FSDP2's rows of each parameter (ceil(d0 / 2) on rank 0), for the
        # parameter and both AdamW moments; the replicated scalars (step, lr, betas)
        # are all that is left.
        assert r["shard_bytes"] == r["expected_shard_bytes"], r
        assert r["ratio"] < 0.51, r
        assert r["sharded_leaves"] == 3 * r["n_params"], r  # params, exp_avg, exp_avg_sq


@pytest.mark.parametrize("kind", ["amp_fp16", "nonfinite"])
def test_an_overflow_on_one_rank_skips_on_every_rank(results, kind):
    for r in _get(results, "overflow"):
        assert r[kind]["skipped"] and r[kind]["unchanged"], r
        if kind == "amp_fp16":
            assert r[kind]["scales"] == [32768.0, 32768.0], r  # backed off alike


def test_the_gradients_are_reduced_once_per_window(results):
    """3 microbatches, 3 FSDP units: one reduce-scatter per unit, on the last
    microbatch only, and fasttorch's two small all-reduces."""
    for r in _get(results, "collectives"):
        units, n = r["units"], r["n"]
        # From the second window (FSDP2 marks the root as kept at its first forward):
        # reshard_after_forward=True units gather for each forward and each backward,
        # the root once; with False every unit gathers once per window.
        for window in r["default"][1:]:
            assert window == {
                "all_reduce": 2,
                "reduce_scatter": units,
                "all_gather": 2 * n * (units - 1) + 1,
            }, r
        for window in r["kept"][1:]:
            assert window == {"all_reduce": 2, "reduce_scatter": units, "all_gather": units}, r
        assert r["same_params"], r


def test_compiled_sharded_step_compiles_the_update_once_and_says_what_stays_eager(results):
    for r in _get(results, "no_recompiles"):
        assert r["recompiles"] == 0 and r["graph_breaks"] == 0, r
        assert r["graphs"] == 1 and r["fused_graphs"] == 0 and r["fused_count"] == 3, r
        assert (
            len(r["warnings"]) == 1
            and "the forward and backward run as the module runs them: eagerly" in r["warnings"][0]
        )


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("no_sync_on_last", "sync_on_last"),
        ("donate_false", "donate=False"),
        ("across_calls", "across_calls=True"),
        ("root_not_sharded", "fully_shard(model) on the root"),
        ("not_module_storage", "inplace=True"),
    ],
)
def test_misuse_is_a_clear_error_on_every_rank(results, case, words):
    for r in _get(results, "errors"):
        assert r[case] is not None and words in r[case], r


def test_eval_step_and_apply_run_the_module_over_its_shards(results):
    for r in _get(results, "eval"):
        assert r["eval_diff"] <= r["bound"] and r["apply_diff"] <= r["bound"], r
        # compiled(eval_step): FSDP2's hooks cannot be in a graph, so it runs eagerly, said
        assert r["compiled_eval_equal"] and r["compiled_eval_warned"], r


def test_a_forward_without_backward_leaves_the_module_on_its_shards(results):
    # eval_step, state.apply and the user's own no-grad forward: FSDP2 keeps the root
    # unsharded after them; the module holds the state's shards again and training
    # goes on as if they had not run.
    for r in _get(results, "eval"):
        assert r["resharded"] == [True, True, True], r
        assert r["leaves"][0] == r["leaves"][1] > 0, r
        assert r["then_trains_the_same"], r


@pytest.mark.gpu
def test_sharded_steps_on_gpus_with_nccl(tmp_path):
    """A GPU per rank (2 where there are 2, else one rank): the sharded path's CUDA
    side (NCCL collectives, no host-side agreement check, inductor's update graph)."""
    world = min(2, torch.cuda.device_count())
    for rank, r in enumerate(spawn_group(run_cuda, world, tmp_path)):
        assert "exception" not in r, f"rank {rank}:\n{r['exception']}"
        for kind in ("accum", "amp_bf16"):
            assert r[kind]["diff"] <= r[kind]["bound"], r
        assert r["overflow_skipped"] and r["scale"] == 32768.0, r


@pytest.mark.parametrize("case", ["sgd_eager", "sgd_compiled", "adamw_eager", "adamw_compiled"])
def test_a_parameter_no_rank_uses_is_left_as_fsdp2_and_torch_optim_leave_it(results, case):
    for r in _get(results, "unused"):
        c = r[case]
        assert c["never_kept"] and c["fsdp2_never_kept"], c
        assert c["diff"] <= c["bound"], c


def test_a_module_fsdp2_did_not_shard_reads_as_unknown():
    # Unknown (None), not "kept": a window then reshards every unit, FSDP2's default.
    from fasttorch import _compat

    assert _compat.fsdp_keeps_params_after_forward(torch.nn.Linear(2, 2)) is None
