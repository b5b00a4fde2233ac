"""Kill-safety by injection: a save (and a prune) is stopped before each of its
filesystem changes in turn (every rename, unlink, rmdir and fsync, DCP's own
included), and after each stop the newest checkpoint that was complete is still found
by ``latest``, loads, and equals what was saved; a later prune leaves no leftovers."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fasttorch import checkpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ckpt_worker as w  # noqa: E402
from test_checkpoint import assert_same, ok, worker  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    # A warning here would mean a half-written or half-deleted checkpoint was visible.
    pytest.mark.filterwarnings("error::UserWarning"),
]


def versions(n: int) -> list:
    """n states, one step apart, and what each holds."""
    out = []
    for i in range(n):
        step, state = w.build("crash")
        state, _ = w.run(step, state, 0, i + 1)
        out.append((state, w.leaves(state)))
    return out


def found(d: Path, saved: list[dict]) -> int:
    """The version that latest(d) holds; it must load and equal what was saved."""
    p = checkpoint.latest(d)
    assert p is not None, sorted(x.name for x in d.iterdir())
    _, template = w.build("crash")
    loaded, data = checkpoint.load(p, template)
    assert_same(saved[data["v"]], w.leaves(loaded))
    return data["v"]


def visible_ones_are_whole(d: Path) -> None:
    """Every directory under a plain name is a complete, intact checkpoint."""
    for p in d.iterdir():
        if not p.name.startswith("."):
            checkpoint.verify(p)


def sweep(base: Path, root: Path, action: Callable[[Path], None], check) -> list:
    """Run ``action`` on a copy of ``base``, killed at the k-th call, k = 1, 2, ...
    until it completes; ``check(d, calls, killed)`` after each. Returns the calls of
    the complete run."""
    k = 1
    while True:
        d = root / f"k{k:03d}"
        shutil.copytree(base, d)
        killed = True
        with w.kill_at(k) as calls:
            try:
                action(d)
                killed = False
            except (w.SimulatedKill, checkpoint.CheckpointError):
                # DCP reports any exception in its write, a kill included, as its own
                if len(calls) != k:
                    raise
        check(d, calls, killed)
        if not killed:
            assert len(calls) == k - 1
            return calls
        k += 1


def renamed(calls: list, killed: bool, prefix: str) -> bool:
    """Whether a rename of a directory whose name starts with prefix was completed."""
    done = calls[:-1] if killed else calls
    return any(n == "rename" and Path(src).name.startswith(prefix) for n, src in done)


def test_replacing_a_name_survives_a_kill_at_every_step(tmp_path):
    (a, sa), (b, sb) = versions(2)
    saved = [sa, sb]
    base = tmp_path / "base"
    checkpoint.save(base, a, name="ck", data={"v": 0})

    def check(d, calls, killed):
        published = renamed(calls, killed, ".tmp.ck")
        assert found(d, saved) == (1 if published else 0)
        visible_ones_are_whole(d)
        checkpoint.prune(d, keep_last=1)  # the next save would do this
        assert sorted(p.name for p in d.iterdir()) == ["ck"]
        assert found(d, saved) == (1 if published else 0)

    calls = sweep(base, tmp_path, lambda d: checkpoint.save(d, b, name="ck", data={"v": 1}), check)
    # The sequence has the boundary that lost both copies before: between the rename
    # that sets the old copy aside and the one that publishes the new.
    i = [(n, Path(p).name) for n, p in calls].index(("rename", "ck"))
    assert calls[i + 1][0] == "rename" and Path(calls[i + 1][1]).name.startswith(".tmp.ck")
    assert sum(n == "fsync" for n, _ in calls) >= 3  # DCP's data file, the manifest, dirs


def test_step_named_saves_with_keep_last_survive_a_kill_at_every_step(tmp_path):
    (a, sa), (b, sb), (c, sc) = versions(3)
    saved = [sa, sb, sc]
    base = tmp_path / "base"
    for v, s in enumerate((a, b)):
        checkpoint.save(base, s, data={"v": v}, keep_last=2)
    names = sorted(p.name for p in base.iterdir())
    third = f"step_{int(c.step):09d}"

    def check(d, calls, killed):
        published = renamed(calls, killed, f".tmp.{third}")
        assert found(d, saved) == (2 if published else 1)
        visible_ones_are_whole(d)
        checkpoint.prune(d, keep_last=2)
        want = [names[1], third] if published else names
        assert sorted(p.name for p in d.iterdir()) == want

    def save(d):
        checkpoint.save(d, c, data={"v": 2}, keep_last=2)

    calls = sweep(base, tmp_path, save, check)
    # The complete run ends with the prune: the oldest is renamed away, then deleted.
    assert any(n == "rename" and Path(p).name == names[0] for n, p in calls)
    assert calls[-1][0] == "rmdir"


def test_prune_survives_a_kill_at_every_step(tmp_path):
    saved_versions = versions(3)
    saved = [s for _, s in saved_versions]
    base = tmp_path / "base"
    for v, (s, _) in enumerate(saved_versions):
        checkpoint.save(base, s, data={"v": v})
    newest = sorted(p.name for p in base.iterdir())[-1]

    def check(d, calls, killed):
        assert found(d, saved) == 2
        visible_ones_are_whole(d)
        checkpoint.prune(d, keep_last=1)
        assert sorted(p.name for p in d.iterdir()) == [newest]

    calls = sweep(base, tmp_path, lambda d: checkpoint.prune(d, keep_last=1), check)
    assert [n for n, _ in calls].count("rename") == 2


def test_two_ranks_survive_a_kill_of_rank_0_at_every_publish_step(tmp_path):
    """One 2-rank group: rank 0 is stopped before each filesystem change of publishing
    a same-name replacement; both ranks then find, load and check the checkpoint. Then
    a write error on rank 1, and rank 1 dying mid-save, raise CheckpointError."""
    out = tmp_path / "out"
    ok(worker("dist_kill", ranks=2, dir=str(tmp_path / "ck"), out=str(out)), timeout=300)
    got = [torch.load(f"{out}.rank{r}") for r in range(2)]
    for r in range(2):
        assert got[r]["errors"] == [], got[r]["errors"]
        assert got[r]["steps"] == got[0]["steps"] >= 8  # publish steps of a replacement
        assert got[r]["write_error"].startswith("CheckpointError"), got[r]["write_error"]
    assert got[0]["peer_died"].startswith("CheckpointError"), got[0]["peer_died"]
