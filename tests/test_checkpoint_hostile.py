"""Hostile and unlucky checkpoint directories: symbolic links, malformed manifests,
failed saves, two writers; and the exports (state_dict, safetensors) that load without
fasttorch. Nothing outside the directory is ever deleted or written, and one bad
checkpoint never stops the others from loading."""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import shutil
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import fasttorch
from fasttorch import checkpoint
from fasttorch.checkpoint import CheckpointError

sys.path.insert(0, str(Path(__file__).resolve().parent))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make(seed: int = 0) -> fasttorch.TrainState:
    torch.manual_seed(seed)
    return fasttorch.TrainState.create(torch.nn.Linear(3, 2), fasttorch.optim.sgd(0.1))


def at(step: int) -> fasttorch.TrainState:
    """A state whose step counter reads ``step`` (set by hand: no training needed)."""
    return make(step).replace(step=torch.tensor(step))


def saved(root: Path, n: int) -> list[Path]:
    """n checkpoints in root, steps 0..n-1."""
    return [checkpoint.save(root, at(i), data={"i": i}) for i in range(n)]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under path (links not followed), with its bytes."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = Path(dirpath, f)
            out[str(p.relative_to(path))] = p.read_bytes()
    return out


def outside(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A directory outside the checkpoint directory, with files in a subdirectory."""
    ext = tmp_path / "precious"
    (ext / "sub").mkdir(parents=True)
    (ext / "a.txt").write_text("keep me")
    (ext / "sub" / "b.bin").write_bytes(b"\0" * 100)
    return ext, snapshot(ext)


# --------------------------------------------------------------------------- symlinks


@pytest.mark.parametrize("prefix", [".tmp.", ".del.", ".old."])
@pytest.mark.parametrize("how", ["prune", "save"])
def test_hidden_symlinks_to_a_directory_elsewhere_are_left_alone(tmp_path, prefix, how):
    root = tmp_path / "ck"
    saved(root, 2)
    ext, before = outside(tmp_path)
    if prefix == ".old.":  # a copy of a checkpoint, elsewhere, as an ".old." leftover
        shutil.copytree(root / "step_000000000", ext / "ck")
        before = snapshot(ext)
        link = root / ".old.step_000000001.abcdef123456"
        os.symlink(ext / "ck", link)
    else:
        link = root / f"{prefix}step_000000005.abcdef123456"
        os.symlink(ext, link)
    if how == "prune":
        removed = checkpoint.prune(root, keep_last=1)
    else:
        checkpoint.save(root, at(9), keep_last=1)
        removed = []
    assert snapshot(ext) == before
    assert link.is_symlink()
    assert link not in removed


def test_a_best_symlink_to_an_exported_copy_is_never_deleted(tmp_path):
    root = tmp_path / "ck"
    paths = saved(root, 3)
    export = tmp_path / "export"
    shutil.copytree(paths[0], export)  # the user keeps the first one elsewhere
    before = snapshot(export)
    os.symlink(export, root / "best")
    checkpoint.save(root, at(7), keep_last=1)
    checkpoint.prune(root, keep_last=1)
    assert snapshot(export) == before
    assert (root / "best").is_symlink()
    assert checkpoint.latest(root).name == "step_000000007"


def test_a_latest_symlink_never_empties_the_checkpoint_it_names(tmp_path):
    root = tmp_path / "ck"
    paths = saved(root, 3)
    os.symlink(paths[-1].name, root / "latest")  # relative link to the newest
    before = snapshot(paths[-1])
    assert checkpoint.latest(root) == paths[-1]  # the real one, not the link
    checkpoint.prune(root, keep_last=1)
    assert snapshot(paths[-1]) == before
    checkpoint.verify(paths[-1])
    assert (root / "latest").is_symlink() and os.readlink(root / "latest") == paths[-1].name
    assert sorted(p.name for p in root.iterdir()) == ["latest", paths[-1].name]


def test_saving_under_the_name_of_a_symlink_is_refused(tmp_path):
    root = tmp_path / "ck"
    saved(root, 1)
    export = tmp_path / "export"
    shutil.copytree(root / "step_000000000", export)
    before = snapshot(export)
    os.symlink(export, root / "best")
    with pytest.raises(CheckpointError, match="best'.*symbolic link.*another name"):
        checkpoint.save(root, make(), name="best")
    assert snapshot(export) == before and (root / "best").is_symlink()
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp.")]  # cleaned up


def test_a_symlink_inside_a_pruned_checkpoint_is_removed_as_a_link(tmp_path):
    root = tmp_path / "ck"
    paths = saved(root, 2)
    ext, before = outside(tmp_path)
    os.symlink(ext, paths[0] / "notes")  # the user's link inside an old checkpoint
    os.symlink(ext / "a.txt", paths[0] / "a.txt")
    assert paths[0] in checkpoint.prune(root, keep_last=1)
    assert not paths[0].exists()
    assert snapshot(ext) == before


def test_a_checkpoint_file_that_is_a_symlink_is_refused(tmp_path):
    root = tmp_path / "ck"
    (path,) = saved(root, 1)
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    moved = tmp_path / "elsewhere.distcp"
    shutil.move(data, moved)
    os.symlink(moved, data)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        checkpoint.verify(path)


@pytest.mark.parametrize("directory", ["", " ", None, 3])
def test_an_empty_or_missing_directory_name_is_refused(tmp_path, monkeypatch, directory):
    monkeypatch.chdir(tmp_path)
    err = ValueError if isinstance(directory, str) else TypeError
    with pytest.raises(err, match="checkpoint.save: directory"):
        checkpoint.save(directory, make())
    with pytest.raises(err, match="checkpoint.prune: directory"):
        checkpoint.prune(directory, keep_last=1)
    with pytest.raises(err, match="checkpoint.latest: directory"):
        checkpoint.latest(directory)
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory


# --------------------------------------------------------------------------- manifests


def _set(key, value):
    def edit(m):
        m[key] = value
        return m

    return edit


def _drop(key):
    def edit(m):
        del m[key]
        return m

    return edit


def _entry(field, value):
    def edit(m):
        m["entries"]["params/weight"][field] = value
        return m

    return edit


def _files(value):
    def edit(m):
        name = next(iter(m["files"]))
        m["files"][name] = value
        return m

    return edit


MALFORMED = {
    "step is a string": (_set("step", "3"), "'step' must be an integer"),
    "step is a float": (_set("step", 1.5), "'step' must be an integer"),
    "step is true": (_set("step", True), "'step' must be an integer"),
    "step is negative": (_set("step", -1), "'step' must be an integer"),
    "step is huge": (_set("step", 10**400), "'step' must be an integer"),
    "no step": (_drop("step"), "'step' must be an integer"),
    "micro is a string": (_set("micro", "a"), "'micro' must be null or an integer"),
    "world_size 0": (_set("world_size", 0), "'world_size' must be an integer >= 1"),
    "saved_at NaN": (_set("saved_at", math.nan), "'saved_at' must be a finite number"),
    "saved_at huge": (_set("saved_at", 10**400), "'saved_at' must be a finite number"),
    "module not a string": (_set("module", 5), "'module' must be a string"),
    "files entry a list": (_files([1, 2]), "integer 'size'"),
    "files entry a string": (_files("x"), "integer 'size'"),
    "files entry bad hash": (_files({"size": 1, "sha256": "zz"}), "64 hex digits"),
    "files a list": (_set("files", ["a"]), "'files' must be an object"),
    "entries a list": (_set("entries", []), "'entries' must be an object"),
    "dtype nonexistent": (_entry("dtype", "nonexistent"), "not a torch dtype"),
    "dtype an attribute": (_entry("dtype", "load"), "not a torch dtype"),
    "dtype a number": (_entry("dtype", 5), "not a torch dtype"),
    "shape negative": (_entry("shape", [-1, 3]), "a shape is a list of integers"),
    "shape a string": (_entry("shape", "abc"), "a shape is a list of integers"),
    "shape huge": (_entry("shape", [2**40]), "entries come to"),
    "statics not plain": (_set("statics", {"a": [1]}), "'statics' must be"),
    "sharded not a list": (_set("sharded", "x"), "'sharded' must be a list"),
    "not JSON": ("{not json", "unreadable fasttorch.json"),
    "a JSON list": ("[1, 2]", "has format"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_one_malformed_manifest_marks_only_that_checkpoint_unusable(tmp_path, case):
    edit, match = MALFORMED[case]
    root = tmp_path / "ck"
    paths = saved(root, 3)
    bad = paths[-1]  # the newest: latest() must fall back to the one before
    mf = bad / checkpoint.MANIFEST
    if isinstance(edit, str):
        mf.write_text(edit)
    else:
        mf.write_text(json.dumps(edit(json.loads(mf.read_text()))))
    with pytest.warns(UserWarning, match=f"skips '{bad}'.*{match}"):
        assert checkpoint.latest(root) == paths[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once, not on every call
        assert checkpoint.latest(root) == paths[1]
        removed = checkpoint.prune(root, keep_last=1)
    assert removed == [paths[0]]
    assert bad.is_dir() and (bad / checkpoint.MANIFEST).is_file()  # kept, never deleted
    state, data = checkpoint.load(paths[1], make())
    assert data == {"i": 1}
    for read in (checkpoint.verify, checkpoint.model_state_dict):
        with pytest.raises(CheckpointError, match=match):
            read(bad)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(bad, make())


# --------------------------------------------------------------------------- exports


class Rotary(torch.nn.Module):
    """A layer with a non-persistent buffer (as a rotary embedding's ``inv_freq``), a
    persistent one, and a weight tied to another name."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 4)
        self.out.weight = self.inp.weight  # tied
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(x) * self.inv_freq) + self.count


def test_exports_hold_exactly_what_module_state_dict_holds(tmp_path):
    model = Rotary()
    step = fasttorch.step(lambda apply, b: apply(b).square().mean())
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
    state, _ = step(state, torch.randn(2, 4))  # the state's tensors are no longer the module's
    keys = set(Rotary().state_dict())
    assert "inv_freq" not in keys and "out.weight" in keys
    exported = state.state_dict()
    assert set(exported) == keys
    plain = Rotary()
    plain.load_state_dict(exported)  # strict
    assert torch.equal(plain.inp.weight, state.params["inp.weight"])
    assert torch.equal(plain.out.weight, state.params["inp.weight"])  # the trained one
    path = checkpoint.save(tmp_path, state)
    from_disk = checkpoint.model_state_dict(path)
    assert set(from_disk) == keys
    plain = Rotary()
    plain.load_state_dict(from_disk)
    assert torch.equal(plain.out.weight, state.params["inp.weight"])
    loaded, _ = checkpoint.load(path, fasttorch.TrainState.create(Rotary(), state.optimizer))
    assert torch.equal(loaded.buffers["inv_freq"], torch.arange(4.0))  # still in the state


def test_a_hugging_face_llama_exports_and_loads_back_strictly(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert any("inv_freq" in n for n, _ in model.named_buffers())
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-3))
    fresh = transformers.LlamaForCausalLM(config)
    fresh.load_state_dict(state.state_dict())  # strict
    path = checkpoint.save(tmp_path, state)
    fresh = transformers.LlamaForCausalLM(config)
    fresh.load_state_dict(checkpoint.model_state_dict(path))
    for name, p in model.named_parameters():
        assert torch.equal(fresh.get_parameter(name), p), name
    # One file that transformers reads by itself, and the save_pretrained recipe.
    out = checkpoint.export_safetensors(path, tmp_path / "model.safetensors")
    again = transformers.LlamaForCausalLM(config)
    again.load_state_dict(pytest.importorskip("safetensors.torch").load_file(out))
    fresh.save_pretrained(tmp_path / "hf")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for name, p in model.named_parameters():
        assert torch.equal(back.get_parameter(name), p), name
        assert torch.equal(again.get_parameter(name), p), name


# --------------------------------------------------------------------------- no checkpoint yet


def test_loading_latest_of_an_empty_directory_says_what_to_do(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    with pytest.raises(CheckpointError, match=r"path=None.*no checkpoint.*checkpoint.resume"):
        checkpoint.load(checkpoint.latest(tmp_path), make())
    with pytest.raises(CheckpointError, match=r"path=None"):
        checkpoint.model_state_dict(None)
    saved(tmp_path / "ck", 1)
    with pytest.raises(CheckpointError, match="a directory of checkpoints.*latest"):
        checkpoint.load(tmp_path / "ck", make())


def test_resume_starts_fresh_then_loads_the_newest(tmp_path):
    root = tmp_path / "not_yet"
    fresh = make()
    state, data = checkpoint.resume(root, fresh, data={"next": 0})
    assert state is fresh and data == {"next": 0}
    assert not root.exists()  # reading never creates it
    paths = saved(root, 2)
    state, data = checkpoint.resume(root, make(), data={"next": 0})
    assert data == {"i": 1} and int(state.step) == 1
    assert torch.equal(
        state.params["weight"], checkpoint.load(paths[1], make())[0].params["weight"]
    )
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        checkpoint.resume(tmp_path / "file", make())


# --------------------------------------------------------------------------- failed saves


def _failing_fsync(monkeypatch, code: int, *, dirs: bool, nth: int = 1) -> list[int]:
    """os.fsync raises OSError(code) on the nth call for a directory (dirs) or a file."""
    real = os.fsync
    seen: list[int] = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode) == dirs:
            seen.append(fd)
            if len(seen) == nth:
                raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_failed_saves_remove_their_own_partial_directory_only(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    (first,) = saved(root, 1)
    other = root / ".tmp.step_000000001.0123456789ab"  # another save's, in progress
    other.mkdir()
    (other / "part").write_text("x")
    for i in range(5):  # a full disk: every data file's fsync fails
        _failing_fsync(monkeypatch, errno.ENOSPC, dirs=False)
        with pytest.raises(CheckpointError, match="No space left on device"):
            checkpoint.save(root, at(2 + i))
        monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == sorted([first.name, other.name])
    assert (other / "part").read_text() == "x"
    checkpoint.verify(first)


@pytest.mark.parametrize("nth", [1, 2])
def test_a_failed_directory_fsync_fails_the_save(tmp_path, monkeypatch, nth):
    root = tmp_path / "ck"
    saved(root, 1)
    seen = _failing_fsync(monkeypatch, errno.EIO, dirs=True, nth=nth)
    with pytest.raises(CheckpointError, match="Input/output error") as e:
        checkpoint.save(root, at(1))
    monkeypatch.undo()
    assert len(seen) == nth
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp.")]
    if nth == 1:  # the new checkpoint's own directory: nothing was published
        assert checkpoint.latest(root).name == "step_000000000"
    else:  # the rename that published it: visible, but the save says it is not durable
        assert "visible and complete, but may not survive a power loss" in str(e.value)
        assert checkpoint.latest(root).name == "step_000000001"


def test_a_filesystem_that_cannot_sync_directories_warns_once(tmp_path, monkeypatch):
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(checkpoint._directory, "_no_dir_sync_warned", set())
    with pytest.warns(UserWarning, match="cannot fsync a directory") as record:
        checkpoint.save(tmp_path, at(0))
    assert len([r for r in record if "cannot fsync" in str(r.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.save(tmp_path, at(1))
    assert checkpoint.latest(tmp_path).name == "step_000000001"


# --------------------------------------------------------------------------- clear errors


def test_a_mismatch_names_both_optimizers_as_the_user_chose_them(tmp_path):
    state = fasttorch.TrainState.create(torch.nn.Linear(3, 2), fasttorch.optim.adamw(1e-3))
    path = checkpoint.save(tmp_path, state)
    other = fasttorch.TrainState.create(torch.nn.Linear(3, 2), fasttorch.optim.sgd(0.1))
    with pytest.raises(checkpoint.CheckpointMismatchError) as e:
        checkpoint.load(path, other)
    assert "holds a Linear trained by AdamW, the template a Linear trained by SGD" in str(e.value)


def test_a_hand_edited_static_of_another_type_is_refused(tmp_path):
    step = fasttorch.grad_accumulate(
        fasttorch.step(lambda apply, b: apply(b).square().mean()), 2, across_calls=True
    )
    state = step.init(fasttorch.TrainState.create(torch.nn.Linear(3, 2), fasttorch.optim.sgd(0.1)))
    state, _ = step(state, torch.randn(2, 3))
    path = checkpoint.save(tmp_path, state)
    mf = path / checkpoint.MANIFEST
    m = json.loads(mf.read_text())
    m["statics"]["substates/grad_accumulate/micro"] = "1; import os"
    mf.write_text(json.dumps(m))
    template = step.init(
        fasttorch.TrainState.create(torch.nn.Linear(3, 2), fasttorch.optim.sgd(0.1))
    )
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"static field .*micro.*\(str\)"):
        checkpoint.load(path, template)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"__tensor__": "uint8", "data": [1, 2]}, "needs 'shape'"),
        ({"__tensor__": "uint8", "shape": [3], "data": [1, 2]}, "a list of 3 values"),
        ({"__tensor__": "uint8", "shape": [-1], "data": []}, "integers >= 0"),
        ({"__tensor__": "uint8", "shape": [1], "data": ["a"]}, "flat list of numbers"),
    ],
)
def test_from_json_with_a_broken_tensor_entry_says_what_is_missing(entry, match):
    from fasttorch.data import from_json

    with pytest.raises(ValueError, match=match):
        from_json({"gen": entry})


HOLD = """
import sys, time, pathlib, torch, fasttorch
from fasttorch import checkpoint
root, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
real = checkpoint._manifest._sha256
def slow(path):  # stop in the middle of publishing, until the test says go
    (root.parent / "started").touch()
    while not go.exists():
        time.sleep(0.05)
    return real(path)
checkpoint._manifest._sha256 = slow
state = fasttorch.TrainState.create(torch.nn.Linear(3, 2), fasttorch.optim.sgd(0.1))
print(checkpoint.save(root, state, name="theirs", keep_last=1).name)
"""


def test_a_second_process_saving_into_the_same_directory_is_refused(tmp_path):
    root, go = tmp_path / "ck", tmp_path / "go"
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), str(go)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the other process never started saving"
            time.sleep(0.05)
        with pytest.raises(CheckpointError, match="another process is saving into or pruning"):
            checkpoint.save(root, make(), name="mine", keep_last=1)
        with pytest.raises(CheckpointError, match="one writer per directory"):
            checkpoint.prune(root, keep_last=1)
        assert checkpoint.latest(root) is None  # reading is never refused
    finally:
        go.touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert out.split() == ["theirs"]
    assert sorted(p.name for p in root.iterdir()) == ["theirs"]  # and nothing of "mine"
    checkpoint.verify(root / "theirs")
    checkpoint.save(root, make(), name="mine", keep_last=2)  # free again once it is done


# --------------------------------------------------------------------------- keep_best, export


def test_keep_best_keeps_the_best_by_metric_beside_the_newest(tmp_path):
    metrics = [5.0, 1.0, 4.0, 0.5, None, 3.0]
    for i, metric in enumerate(metrics):
        checkpoint.save(tmp_path / "min", at(i), metric=metric, keep_last=1, keep_best=2)
        value = None if metric is None else torch.tensor(metric)  # a 0-d tensor is read once
        checkpoint.save(tmp_path / "max", at(i), metric=value, keep_last=1, keep_best=2, mode="max")
    names = lambda d: sorted(p.name for p in (tmp_path / d).iterdir())  # noqa: E731
    assert names("min") == ["step_000000001", "step_000000003", "step_000000005"]
    assert names("max") == ["step_000000000", "step_000000002", "step_000000005"]
    assert checkpoint.verify(tmp_path / "min" / "step_000000003")["metric"] == 0.5
    assert checkpoint.latest(tmp_path / "min").name == "step_000000005"
    # prune on its own: the union of the newest and the best
    assert [p.name for p in checkpoint.prune(tmp_path / "min", keep_last=1, keep_best=1)] == [
        "step_000000001"
    ]


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"metric": math.nan, "keep_last": 1}, ValueError, "metric must be a finite number"),
        ({"metric": "low", "keep_last": 1}, ValueError, "metric must be a finite number"),
        ({"metric": 1.0, "keep_best": 2}, ValueError, "keep_best=2 needs keep_last"),
        ({"keep_last": 1, "keep_best": 0}, ValueError, "keep_best must be None or an integer"),
        ({"keep_last": 1, "keep_best": 1, "mode": "lowest"}, ValueError, "mode must be 'min'"),
    ],
)
def test_keep_best_arguments_are_checked_before_anything_is_written(tmp_path, kwargs, err, match):
    with pytest.raises(err, match=match):
        checkpoint.save(tmp_path / "ck", make(), **kwargs)
    assert not (tmp_path / "ck").exists() or list((tmp_path / "ck").iterdir()) == []


def test_a_safetensors_export_loads_without_fasttorch(tmp_path):
    load_file = pytest.importorskip("safetensors.torch").load_file
    model = Rotary().to(torch.bfloat16)
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
    path = checkpoint.save(tmp_path / "ck", state)
    for source in (path, state):
        out = checkpoint.export_safetensors(source, tmp_path / "model.safetensors")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "model.safetensors"]
        plain = Rotary().to(torch.bfloat16)
        plain.load_state_dict(load_file(out))  # strict; no fasttorch involved
        for k, v in Rotary().to(torch.bfloat16).state_dict().items():
            assert load_file(out)[k].dtype == v.dtype
        assert torch.equal(plain.inp.weight, state.params["inp.weight"])
        assert torch.equal(plain.count, state.buffers["count"])
    with pytest.raises(CheckpointError, match="is a directory"):
        checkpoint.export_safetensors(path, tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.export_safetensors(path, tmp_path / "no" / "model.safetensors")


def test_a_crafted_metadata_size_is_refused_before_allocating(tmp_path):
    from test_checkpoint import rehash

    (path,) = saved(tmp_path / "ck", 1)
    with open(path / ".metadata", "rb") as f:
        md = checkpoint._MetadataUnpickler(f).load()
    md.state_dict_metadata["rank0/data"].size = torch.Size([2**40])
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    rehash(path)
    with pytest.raises(
        CheckpointError, match=r"\.metadata gives data= a size of \[1099511627776\]"
    ):
        checkpoint.load(path, make())
