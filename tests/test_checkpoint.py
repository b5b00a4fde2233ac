"""Checkpoints: complete, atomic, verified, bit-exact on resume, reshardable, crash-safe."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import fasttorch
from fasttorch import checkpoint
from fasttorch.checkpoint import CheckpointError, CheckpointMismatchError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import ckpt_worker as w  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def worker(mode: str, ranks: int = 0, restarts: int = 0, **args) -> subprocess.Popen:
    """Start tests/ckpt_worker.py MODE in a fresh process (under torchrun if ranks)."""
    args.setdefault("threads", torch.get_num_threads())
    cmd = [sys.executable]
    if ranks:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        cmd += [f"--max-restarts={restarts}", "--monitor-interval=0.1"]
    cmd += [str(HERE / "ckpt_worker.py"), mode, json.dumps(args)]
    return subprocess.Popen(
        cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"worker hung for {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def ok(proc: subprocess.Popen, timeout: float = 120) -> str:
    rc, out = finish(proc, timeout)
    assert rc == 0, out[-4000:]
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_same_metrics(xs: list, ys: list) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        fx, _ = torch.utils._pytree.tree_flatten(x)
        fy, _ = torch.utils._pytree.tree_flatten(y)
        assert len(fx) == len(fy) and all(torch.equal(p, q) for p, q in zip(fx, fy)), (x, y)


# --------------------------------------------------------------------------- points 1, 4


def test_bit_exact_resume_in_a_fresh_process(tmp_path):
    """fp16 + accumulation across calls + skip_nonfinite + EMA + clip, compiled: N calls
    (ending mid-window), save, a new process loads and runs M more; every leaf and
    every metric equals N+M uninterrupted calls, bit for bit."""
    step, state = w.build("full")
    state, _ = w.run(step, state, 0, 5)
    sub = state.substates
    assert sub["grad_accumulate"].micro == 1  # saved in the middle of a window
    assert int(sub["nonfinite"].skipped_total) > 0  # fp16 overflow skips were counted
    assert int(sub["amp"].skipped_total) == int(sub["nonfinite"].skipped_total)
    path = checkpoint.save(tmp_path, state, data={"next": 5})
    proc = worker("resume", kind="full", ckpt=str(path), steps=6, out=str(tmp_path / "r.pt"))
    state, metrics = w.run(step, state, 5, 6)  # uninterrupted, meanwhile
    ok(proc)
    got = torch.load(tmp_path / "r.pt")
    assert got["micro"] == 1
    assert_same(w.leaves(state), got["leaves"])
    assert_same_metrics(metrics, got["metrics"])


def test_everything_is_saved_under_clean_keys(tmp_path):
    model = torch.compile(w.Net(), backend="eager")  # names carry "_orig_mod."
    step = fasttorch.grad_accumulate(
        fasttorch.ema(fasttorch.with_amp(fasttorch.step(w.mse), "fp16"), 0.9), 2, across_calls=True
    )
    step = fasttorch.skip_nonfinite(step)
    state = step.init(fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-3)))
    assert "_orig_mod.inp.weight" in state.params
    state, _ = step(state, w.batch(0))
    path = checkpoint.save(tmp_path, state, data=[1, {"epoch": 2}])
    keys = set(checkpoint.verify(path)["entries"])
    for key in (
        "params/inp.weight",
        "opt_state/slots/exp_avg/out.bias",
        "opt_state/hyper/lr",
        "step",
        "rng",
        "substates/amp/scale",
        "substates/amp/growth_tracker",
        "substates/grad_accumulate/grads/inp.weight",
        "substates/nonfinite/skipped_in_a_row",
    ):
        assert key in keys, sorted(keys)
    assert any(k.startswith("substates/ema/") for k in keys)
    assert not any("_orig_mod" in k or k.startswith("module.") for k in keys)

    template = step.init(fasttorch.TrainState.create(w.Net(), fasttorch.optim.adamw(1e-3)))
    before = w.leaves(template)
    loaded, data = checkpoint.load(path, template)
    assert data == [1, {"epoch": 2}]
    assert loaded.substates["grad_accumulate"].micro == 1
    saved = w.leaves(state)
    got = w.leaves(loaded)
    assert_same({k.replace("_orig_mod.", ""): v for k, v in saved.items()}, got)
    assert_same(before, w.leaves(template))  # the template is untouched

    plain = w.Net()
    plain.load_state_dict(checkpoint.model_state_dict(path))
    assert torch.equal(plain.inp.weight, state.params["_orig_mod.inp.weight"])


def test_inplace_load_fills_the_template_and_the_module(tmp_path):
    step, state = w.build("crash")
    state, _ = w.run(step, state, 0, 3)
    path = checkpoint.save(tmp_path, state)
    model = w.Net()
    template = step.init(fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-2)))
    loaded, _ = checkpoint.load(path, template, inplace=True)
    assert torch.equal(model.inp.weight, state.params["inp.weight"])
    assert loaded.params["inp.weight"] is model.inp.weight.detach() or (
        loaded.params["inp.weight"].data_ptr() == model.inp.weight.data_ptr()
    )
    with pytest.raises(fasttorch.DonatedStateError):
        template.params  # noqa: B018


# --------------------------------------------------------------------------- point 2


def test_latest_skips_incomplete_and_keep_last_prunes(tmp_path):
    step, state = w.build("crash")
    paths = []
    for i in range(4):
        state, _ = step(state, w.batch(i))
        paths.append(checkpoint.save(tmp_path, state, data={"next": i + 1}, keep_last=2))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [paths[2].name, paths[3].name]
    assert checkpoint.latest(tmp_path) == paths[3]
    # A newer checkpoint whose save never finished (no manifest) is not "latest".
    (tmp_path / "step_000000099").mkdir()
    (tmp_path / "step_000000099" / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path) == paths[3]
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.load(tmp_path / "step_000000099", state)
    # Saving the same name again replaces it atomically.
    again = checkpoint.save(tmp_path, state, name=paths[3].name)
    assert again == paths[3] and checkpoint.latest(tmp_path) == paths[3]


def test_kill_9_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    dirs = {where: tmp_path / where for where in ("write", "rename")}
    procs = {where: worker("kill", dir=str(d), where=where) for where, d in dirs.items()}
    for where, proc in procs.items():
        rc, out = finish(proc)
        assert rc == -9, f"{where}: not killed (rc={rc}):\n{out[-3000:]}"
        d = dirs[where]
        assert [p.name for p in d.glob(".tmp.*")], f"{where}: no partial save left"
        assert not (d / "big").exists()
        assert checkpoint.latest(d) == d / "good"
        template = fasttorch.TrainState.create(torch.nn.Linear(8, 4), fasttorch.optim.sgd(0.1))
        _, data = checkpoint.load(d / "good", template)
        assert data == {"next": 1}
        checkpoint.prune(d, keep_last=1)  # cleans up the interrupted save
        assert sorted(p.name for p in d.iterdir()) == ["good"]


# --------------------------------------------------------------------------- point 3


def test_truncated_or_corrupted_checkpoints_are_refused(tmp_path):
    step, state = w.build("crash")
    path = checkpoint.save(tmp_path, state)
    data = path / "__0_0.distcp"
    blob = data.read_bytes()

    data.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match=r"corrupted: '__0_0.distcp' has \d+ bytes"):
        checkpoint.load(path, state)
    assert checkpoint.latest(tmp_path) is None  # truncated: not a candidate either

    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="SHA-256 of '__0_0.distcp'"):
        checkpoint.load(path, state)

    data.write_bytes(blob)
    checkpoint.load(path, state)  # intact again
    manifest = json.loads((path / "fasttorch.json").read_text())
    del manifest["files"][".metadata"]
    (path / "fasttorch.json").write_text(json.dumps(manifest))
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="unreadable DCP .metadata: FileNotFoundError"):
        checkpoint.load(path, state)
    (path / "fasttorch.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete: it has no fasttorch.json"):
        checkpoint.load(path, state)


def test_a_checkpoint_of_another_model_or_optimizer_is_refused(tmp_path):
    step, state = w.build("crash")
    path = checkpoint.save(tmp_path, state)

    class Wider(w.Net):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(8, 64)
            self.norm = torch.nn.LayerNorm(64)
            self.out = torch.nn.Linear(64, 4)

    other = step.init(fasttorch.TrainState.create(Wider(), fasttorch.optim.adamw(1e-2)))
    with pytest.raises(CheckpointMismatchError) as e:
        checkpoint.load(path, other)
    msg = str(e.value)
    assert "entry 'params/inp.bias'" in msg or "entry 'params/inp.weight'" in msg, msg
    assert "(32, 8) float32 in the checkpoint but (64, 8) float32 in the template" in msg, msg

    sgd = step.init(fasttorch.TrainState.create(w.Net(), fasttorch.optim.sgd(0.1, momentum=0.9)))
    with pytest.raises(CheckpointMismatchError, match=r"trained by AdamW|trained by Adam"):
        checkpoint.load(path, sgd)
    bare = fasttorch.TrainState.create(w.Net(), fasttorch.optim.adamw(1e-2))  # no substates
    with pytest.raises(CheckpointMismatchError, match="'substates/amp/scale'"):
        checkpoint.load(path, bare)


# --------------------------------------------------------------------------- point 8


def test_async_save_returns_before_the_write_and_keeps_the_staged_values(tmp_path, monkeypatch):
    step, state = w.build("crash")
    state, _ = w.run(step, state, 0, 2)
    expected = w.leaves(state)
    gate, reached = threading.Event(), threading.Event()
    publish = checkpoint._save._publish

    def slow_publish(plan):  # the files are written; the rename waits for the gate
        reached.set()
        assert gate.wait(30)
        publish(plan)

    monkeypatch.setattr(checkpoint._save, "_publish", slow_publish)
    handle = checkpoint.async_save(tmp_path, state, data={"next": 2})
    assert not handle.done()
    assert checkpoint.latest(tmp_path) is None  # not visible before it is complete
    state, _ = w.run(step, state, 2, 3)  # steps run (in place) while the save waits
    assert reached.wait(30)  # the background write has made its .tmp. directory
    assert not handle.done() and checkpoint.latest(tmp_path) is None
    assert checkpoint.prune(tmp_path, keep_last=1) == []  # a save in flight is no leftover
    assert [p.name[:5] for p in tmp_path.iterdir()] == [".tmp."]
    gate.set()
    path = handle.wait(timeout=60)
    assert handle.done() and checkpoint.latest(tmp_path) == path
    _, template = w.build("crash")
    loaded, data = checkpoint.load(path, template)
    assert data == {"next": 2}
    assert_same(expected, w.leaves(loaded))


# --------------------------------------------------------------------------- points 4, 5: ranks


def test_two_ranks_resume_bit_exact_and_reshard(tmp_path):
    """2 ranks save (sync and async), 2 fresh ranks resume with their own RNG; a 2-rank
    checkpoint loads on 1 process and a 1-process one on 2 ranks."""
    n, m = 3, 4
    first = worker(
        "dist_save", ranks=2, dir=str(tmp_path / "ck"), n=n, m=m, out=str(tmp_path / "a")
    )
    step, single = w.build("ranks", seed=100)  # meanwhile: a 1-process checkpoint
    single, _ = w.run(step, single, 0, n + 1)  # at a window boundary
    single_path = checkpoint.save(tmp_path / "one", single, data={"next": n + 1})
    ok(first)
    ref = [torch.load(f"{tmp_path / 'a'}.rank{r}") for r in range(2)]
    assert not torch.equal(ref[0]["leaves"][".rng"], ref[1]["leaves"][".rng"])
    assert torch.equal(
        ref[0]["leaves"][".params['inp.weight']"], ref[1]["leaves"][".params['inp.weight']"]
    )

    dp = (ROOT / "fasttorch" / "distributed" / "__init__.py").exists()
    second = worker(
        "dist_resume",
        ranks=2,
        dir=str(tmp_path / "ck"),
        m=m,
        single=str(single_path),
        dp=dp,
        out=str(tmp_path / "b"),
    )
    # 2 -> 1: rank 0's values, rank 0's RNG.
    _, template = w.build("ranks", seed=7)
    loaded, data = checkpoint.load(tmp_path / "ck" / "sync", template)
    assert data == {"next": n}
    assert_same(ref[0]["at_n"], w.leaves(loaded))
    ok(second)
    for r in range(2):
        got = torch.load(f"{tmp_path / 'b'}.rank{r}")
        for name in ("sync", "async"):
            assert_same(ref[r]["leaves"], got[name]["leaves"])
            assert_same_metrics(ref[r]["metrics"], got[name]["metrics"])
        # 1 -> 2: everything from the single process; rank 1 keeps its own RNG.
        one = got["single"]
        assert one["data"] == ({"next": n + 1} if r == 0 else None)
        for k, v in w.leaves(single).items():
            if r == 1 and k == ".rng":
                assert not torch.equal(v, one["leaves"][k])
                assert any("keeps the template's value" in s for s in one["warnings"])
            else:
                assert torch.equal(v, one["leaves"][k]), k
        if dp:
            assert got["dp"], "fasttorch.distributed: resumed run differs"


# --------------------------------------------------------------------------- point 7


def test_torchrun_restart_resumes_to_the_same_parameters(tmp_path):
    args = dict(
        dir=str(tmp_path / "ck"), total=10, every=3, die_at=7, marker=str(tmp_path / "died")
    )
    args.update(log=str(tmp_path / "log"), out=str(tmp_path / "final.pt"))
    proc = worker("crash", ranks=1, restarts=1, **args)
    step, state = w.build("crash")
    state, _ = w.run(step, state, 0, 10)  # uninterrupted, meanwhile
    out = ok(proc, timeout=150)
    assert (tmp_path / "died").exists(), out[-3000:]
    log = (tmp_path / "log").read_text().splitlines()
    assert log[0] == "start 0 from None" and log[1].startswith("start 6 from "), log
    assert_same(w.leaves(state), torch.load(tmp_path / "final.pt"))


# --------------------------------------------------------------------------- untrusted files


class Payload:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def rehash(path: Path, **changes) -> None:
    """What an attacker can do: the manifest lives beside the files it vouches for."""
    manifest = json.loads((path / "fasttorch.json").read_text())
    manifest["files"] = {
        f.name: {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
        for f in path.iterdir()
        if f.name != "fasttorch.json"
    }
    manifest.update(changes)
    (path / "fasttorch.json").write_text(json.dumps(manifest))


def rewrite_dcp(path: Path, state, data_value) -> None:
    """Rewrite ``path``'s DCP files with ``data_value`` as DCP stores any object: pickled."""
    import torch.distributed.checkpoint as dcp

    keys, leaves, _ = checkpoint._flatten(state)
    entries = {(f"rank0/{k}" if checkpoint._is_per_rank(k) else k): t for k, t in zip(keys, leaves)}
    entries["rank0/data"] = data_value
    for f in path.iterdir():
        if f.name != "fasttorch.json":
            f.unlink()
    dcp.save(entries, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def test_loading_a_crafted_checkpoint_never_runs_its_code(tmp_path):
    step, state = w.build("crash")
    marker = tmp_path / "marker"
    _, template = w.build("crash")

    # 1. A payload inside DCP's pickled .metadata, the manifest re-hashed to match.
    path = checkpoint.save(tmp_path / "meta", state, data={"next": 1})
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # the file this test just wrote
    md.planner_data = Payload(marker)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    rehash(path)
    checkpoint.verify(path)  # the manifest vouches for it: hashes prove nothing here
    with open(path / ".metadata", "rb") as f:
        pickle.load(f)  # proof that the payload is live: plain unpickling runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match=r"refused: \.metadata it names builtins\.exec"):
        checkpoint.load(path, template)
    with pytest.raises(CheckpointError, match=r"trust_pickled=True"):
        checkpoint.model_state_dict(path)
    assert not marker.exists()

    # 2. A pickled payload as the data entry, in format 2 and in format 1.
    path = checkpoint.save(tmp_path / "data", state, data={"next": 1})
    rewrite_dcp(path, state, Payload(marker))
    rehash(path)
    with pytest.raises(CheckpointError, match="entry 'rank0/data' is a pickled object"):
        checkpoint.load(path, template)
    rehash(path, format=1)
    with pytest.raises(CheckpointError, match="format-1 checkpoint, whose data= is pickled"):
        checkpoint.load(path, template)
    assert not marker.exists()
    assert not template.params["inp.weight"].isnan().any()  # and the template is alive

    # 3. Even a tensor entry whose metadata says "bytes" is refused before any read.
    path = checkpoint.save(tmp_path / "swap", state, data={"next": 1})
    keys, leaves, _ = checkpoint._flatten(state)
    import torch.distributed.checkpoint as dcp

    entries = dict(zip(keys, leaves))
    entries["params/inp.weight"] = Payload(marker)
    entries["rank0/data"] = torch.frombuffer(bytearray(b"{}"), dtype=torch.uint8)
    for k in list(entries):
        if checkpoint._is_per_rank(k):
            entries[f"rank0/{k}"] = entries.pop(k)
    for f in path.iterdir():
        if f.name != "fasttorch.json":
            f.unlink()
    dcp.save(entries, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    rehash(path)
    with pytest.raises(CheckpointError, match="'params/inp.weight' is a pickled object"):
        checkpoint.load(path, template)
    with pytest.raises(CheckpointError, match="'params/inp.weight' is a pickled object"):
        checkpoint.model_state_dict(path)
    assert not marker.exists()


def test_a_trusted_format_1_checkpoint_loads_with_the_opt_in(tmp_path):
    step, state = w.build("crash")
    state, _ = w.run(step, state, 0, 2)
    path = checkpoint.save(tmp_path, state, data={"next": 2})
    rewrite_dcp(path, state, checkpoint._Box({"next": 2}))  # how format 1 stored data
    rehash(path, format=1)
    _, template = w.build("crash")
    with pytest.raises(CheckpointError, match="format-1"):
        checkpoint.load(path, template)
    with pytest.warns(UserWarning, match="trust_pickled=True: .* can run any code"):
        loaded, data = checkpoint.load(path, template, trust_pickled=True)
    assert data == {"next": 2}
    assert_same(w.leaves(state), w.leaves(loaded))
    plain = w.Net()
    plain.load_state_dict(checkpoint.model_state_dict(path))  # weights only: no opt-in
    assert torch.equal(plain.inp.weight, state.params["inp.weight"])


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ((1, 2), r"data is a tuple: use a list"),
        ({"epoch": 1, 2: "x"}, r"data has the key 2 \(int\)"),
        ({"pos": [1, object()]}, r"data\['pos'\]\[1\] is a object"),
        ({"loss": float("nan")}, r"data\['loss'\] is nan"),
        (torch.zeros(2), r"data is a Tensor"),
    ],
)
def test_data_must_be_json(tmp_path, data, match):
    _, state = w.build("crash")
    with pytest.raises(TypeError, match=match):
        checkpoint.save(tmp_path, state, data=data)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_json_data_comes_back_equal(tmp_path):
    _, state = w.build("crash")
    data = {"epoch": 3, "seen": [1, 2.5, None, True, "x"], "nested": {"a": {"b": []}}}
    path = checkpoint.save(tmp_path, state, data=data)
    _, template = w.build("crash")
    assert checkpoint.load(path, template)[1] == data


# --------------------------------------------------------------------------- corrupted newest


def test_a_corrupted_newest_checkpoint_never_costs_the_intact_one(tmp_path):
    step, state = w.build("crash")
    saved = {}
    for i in range(2):
        state, _ = step(state, w.batch(i))
        p = checkpoint.save(tmp_path, state, data={"next": i + 1})
        saved[p.name] = w.leaves(state)
    older, newest = sorted(saved)
    blob = bytearray((tmp_path / newest / "__0_0.distcp").read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # same size: only the hash can tell
    (tmp_path / newest / "__0_0.distcp").write_bytes(bytes(blob))
    with pytest.warns(UserWarning, match="latest skips .* SHA-256"):
        assert checkpoint.latest(tmp_path) == tmp_path / older
    with pytest.warns(UserWarning, match="prune keeps .* corrupted"):
        assert checkpoint.prune(tmp_path, keep_last=1) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [older, newest]
    _, template = w.build("crash")
    loaded, _ = checkpoint.load(tmp_path / older, template)
    assert_same(saved[older], w.leaves(loaded))
    # Once a newer intact one exists, both older ones go.
    state, _ = step(state, w.batch(2))
    third = checkpoint.save(tmp_path, state, data={"next": 3}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [third.name]


# --------------------------------------------------------------------------- failed inplace load


def test_a_failed_inplace_load_leaves_the_template_as_it_was(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    step, state = w.build("crash")
    state, _ = w.run(step, state, 0, 2)
    path = checkpoint.save(tmp_path, state)
    model = w.Net()
    template = step.init(fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-2)))
    before = w.leaves(template)
    weight = model.inp.weight.detach().clone()
    commit = DefaultLoadPlanner.commit_tensor
    seen = []
    fail_at = [0]

    def failing_commit(self, read_item, tensor):
        seen.append(read_item)
        if len(seen) == fail_at[0]:  # every entry but this one is already read
            raise OSError("simulated read error")
        return commit(self, read_item, tensor)

    monkeypatch.setattr(DefaultLoadPlanner, "commit_tensor", failing_commit)
    _, other = w.build("crash")
    checkpoint.load(path, other)  # counts the reads
    fail_at[0], seen[:] = len(seen), []
    with pytest.raises(CheckpointError, match="simulated read error"):
        checkpoint.load(path, template, inplace=True, verify_hashes=False)
    assert len(seen) == fail_at[0] > 10
    assert_same(before, w.leaves(template))  # alive and unchanged
    assert torch.equal(model.inp.weight, weight)
    monkeypatch.setattr(DefaultLoadPlanner, "commit_tensor", commit)
    loaded, _ = checkpoint.load(path, template, inplace=True)
    assert_same(w.leaves(state), w.leaves(loaded))


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced_or_pruned(tmp_path):
    _, state = w.build("crash")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="notes': it exists and is not a fasttorch"):
        checkpoint.save(tmp_path, state, name="notes")
    checkpoint.save(tmp_path, state, name="a")
    checkpoint.save(tmp_path, state, name="b", keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "notes"]
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
