"""Checkpoints of states sharded with FSDP2 (``fully_shard``): saved on N ranks, loaded on
M (2 -> 2 bit-exact, 2 -> 1 plain process, 1 -> 2). One spawned 2-rank gloo group runs
tests/fsdp_ckpt_worker.py's checks (a group costs seconds to start); this process
writes the 1-process checkpoint beforehand and loads the 2-rank one afterwards."""

from __future__ import annotations

import pytest
import torch
from dist_kit import spawn_group
from fsdp_ckpt_worker import WIDTH, K, compose, eval_batch, leaves, new_state, run
from fsdp_worker import global_batches

from fasttorch import checkpoint
from fasttorch.evaluation import eval_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# The parameter names of fsdp_ckpt_worker.GatedNet, and the entries kept per parameter
# (the parameter, AdamW's two moments, the EMA): every one is sharded.
NAMES = [
    *(f"{m}.{p}" for m in ("inp", "norm", "hidden", "out") for p in ("weight", "bias")),
    "gate",
]
PER_PARAMETER = ("params/{}", "opt_state/slots/exp_avg/{}", "opt_state/slots/exp_avg_sq/{}")
SHARDED = sorted(k.format(n) for k in (*PER_PARAMETER, "substates/ema/params/{}") for n in NAMES)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A 1-process checkpoint (trained 2 steps), then the 2-rank group's results."""
    one = tmp_path_factory.mktemp("one")
    step = compose("ema", False)
    state = new_state(step, False)
    for b in global_batches(2, seed=5):
        state, _ = step(state, b)
    single = checkpoint.save(one, state, data={"from": "one"}, name="single")
    torch.save(leaves(state), one / "whole.pt")
    out = tmp_path_factory.mktemp("fsdp_ckpt")
    results = spawn_group(run, 2, out, str(single), deadline_s=300)
    return out, results


def _get(group, name):
    _, results = group
    for r, res in enumerate(results):
        assert "exception" not in res[name], f"rank {r}:\n{res[name].get('exception')}"
    return [res[name] for res in results]


def test_two_ranks_resume_bit_exact_from_a_sharded_checkpoint(group):
    """2 -> 2: K steps, save (and async_save), M more steps; a fresh sharded template
    loaded with inplace=True trains the same M steps to the same shards, AdamW
    moments, EMA, RNG and metrics, bitwise, and its params are the module's storage."""
    for r, res in enumerate(_get(group, "resume")):
        for name in ("sync", "async"):
            got = res[name]
            assert got["leaves_equal"] and got["metrics_equal"], (r, name, got)
            assert got["module_storage"], (r, name)
        assert res["sync"]["data"] == {"next": K, "rank": r}


def test_a_sharded_checkpoint_verifies_and_records_whole_shapes(group):
    out, _ = group
    for name in ("sync", "async"):  # the async one was written while training went on
        manifest = checkpoint.verify(out / "ck" / name)
        assert manifest["world_size"] == 2
        assert sorted(manifest["sharded"]) == SHARDED
        assert manifest["entries"]["params/inp.weight"]["shape"] == [WIDTH, 8]
        assert manifest["entries"]["opt_state/slots/exp_avg/gate"]["shape"] == [1]


def test_a_two_rank_sharded_checkpoint_loads_in_one_plain_process(group):
    """2 -> 1: an unsharded state of the same model, optimizer and transforms, no
    process group; every leaf equals the ranks' shards gathered whole (rank 0's RNG
    and data), bitwise, and model_state_dict exports the whole parameters."""
    out, _ = group
    whole = torch.load(out / "at_save.pt", weights_only=True)
    step = compose("ema", False)
    state, data = checkpoint.load(out / "ck" / "sync", new_state(step, False))
    assert data == {"next": K, "rank": 0}
    mine = leaves(state)
    assert mine.keys() == whole.keys()
    for k in whole:
        assert torch.equal(mine[k], whole[k]), k
    exported = checkpoint.model_state_dict(out / "ck" / "sync")
    for k, t in state.params.items():
        assert torch.equal(exported[k], t), k


def test_a_one_process_checkpoint_loads_into_two_sharded_ranks(group):
    """1 -> 2: each rank's shard of every per-parameter entry is its rows of the saved
    whole tensor (rank 1's share of the one-row gate: none), bitwise."""
    n_leaves = len(leaves(new_state(compose("ema", False), False)))
    for r, res in enumerate(_get(group, "one_to_two")):
        assert res["mismatched"] == [], (r, res)
        assert res["compared"] == n_leaves - 1, res  # all but the RNG
        assert res["sharded"] == len(SHARDED), res
        # Rank 1 did not exist at save time: no data, and it keeps its own RNG.
        assert res["data"] == ({"from": "one"} if r == 0 else None)
        assert res["rng_warned"] == (r == 1)


def test_ema_evaluation_on_two_ranks_equals_one_process(group):
    """eval_step(use_ema=True) on the sharded state equals the one-process evaluation of
    the same averages (loaded 2 -> 1, bitwise equal above): the same forward over
    all-gathered weights, so within a few roundings of the loss (the rule of
    fsdp_worker.check_eval_and_apply). The averages really were used (they differ
    from the parameters by far more), and put back (the state and forward after it
    are the parameters', bitwise)."""
    out, _ = group
    step = compose("ema", False)
    state, _ = checkpoint.load(out / "ck" / "sync", new_state(step, False))
    x = eval_batch()
    ema_loss = float(eval_step(step, use_ema=True)(state, x)["loss"])
    loss = float(eval_step(step)(state, x)["loss"])
    for res in _get(group, "resume"):
        assert res["eval_restored"], res
        bound = 4 * torch.finfo(torch.float32).eps * ema_loss
        assert abs(res["ema_loss"] - ema_loss) <= bound, (res, ema_loss)
        assert abs(res["loss"] - loss) <= 4 * torch.finfo(torch.float32).eps * loss
        assert abs(res["ema_loss"] - res["loss"]) > 100 * bound, res


def test_a_template_of_another_shape_names_the_whole_shapes(group):
    """Width 16 against 15: on rank 0 the shards of inp.weight are (8, 8) either way,
    so only whole shapes can tell; the error names them, on every rank."""
    for res in _get(group, "errors"):
        msg = res["mismatch"]
        assert msg is not None and "'params/inp.weight'" in msg, res
        assert "(15, 8) float32 in the checkpoint but (16, 8) float32" in msg, msg
        assert "whole-tensor shapes" in msg and "holds a GatedNet" in msg
    # 2 -> 1 with a plain template of the other width: the same entry, whole shapes.
    out, _ = group
    step = compose("ema", False)
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"\(15, 8\) float32 in the"):
        checkpoint.load(out / "ck" / "sync", new_state(step, False, width=16))


def test_loading_into_a_sharded_template_needs_inplace(group):
    for res in _get(group, "errors"):
        msg = res["not_inplace"]
        assert msg is not None and "inplace=True" in msg and "FSDP2" in msg, res
        assert res["template_alive"]
