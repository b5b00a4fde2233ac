"""prefetch and loader_defaults: batches arrive in order, on the device, lazily."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerance import EXACT

import fasttorch
from fasttorch.data import loader_defaults, prefetch


def _batches(n=5):
    return [(torch.full((4, 3), float(i)), {"y": torch.arange(4) + i, "tag": i}) for i in range(n)]


def test_on_cpu_it_just_yields_the_batches_in_order():
    data = _batches()
    out = list(prefetch(data, "cpu", depth=3))
    assert len(out) == len(data)
    for (x, d), (x0, d0) in zip(out, data):
        assert x is x0 and d["y"] is d0["y"] and d["tag"] == d0["tag"]  # no copy on CPU


def test_it_is_lazy_and_reads_one_batch_at_a_time_on_cpu():
    pulled = []

    def loader():
        for i, b in enumerate(_batches(3)):
            pulled.append(i)
            yield b

    it = prefetch(loader(), torch.device("cpu"))
    assert pulled == []
    next(it)
    assert pulled == [0]


def test_feeds_a_step_with_a_dataloader():
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, **loader_defaults("cpu", max_workers=0))
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(torch.nn.Linear(4, 1), fasttorch.optim.sgd(0.1))
    step = fasttorch.step(lambda apply, b: torch.nn.functional.mse_loss(apply(b[0]), b[1]))
    for batch in prefetch(loader, state.device):
        state, _ = step(state, batch)
    assert int(state.step) == 4


def test_arguments_are_checked_when_called():
    with pytest.raises(ValueError, match="depth must be an integer >= 1, got 0"):
        prefetch([], "cpu", depth=0)
    with pytest.raises(TypeError, match="loader must be iterable, got int"):
        prefetch(3, "cpu")
    with pytest.raises(ValueError, match="max_workers must be an integer >= 0"):
        loader_defaults("cpu", max_workers=-1)


def test_loader_defaults():
    cpu = loader_defaults("cpu", max_workers=0)
    assert cpu == {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
    cuda = loader_defaults("cuda", max_workers=64)
    assert cuda["pin_memory"] is True
    assert cuda["num_workers"] >= 0
    assert cuda["persistent_workers"] == (cuda["num_workers"] > 0)
    assert ("prefetch_factor" in cuda) == (cuda["num_workers"] > 0)
    torch.utils.data.DataLoader(range(4), **loader_defaults("cpu"))  # accepted as is


@pytest.mark.gpu
def test_cuda_copies_on_a_side_stream_and_the_values_arrive():
    data = [(torch.randn(256, 256), torch.randint(0, 9, (256,))) for _ in range(6)]
    side_copies = []
    out = []
    for x, y in prefetch(data, "cuda", depth=2):
        side_copies.append(x.is_cuda and y.is_cuda)
        out.append((x @ x).sum())  # a step on the main stream
    torch.cuda.synchronize()
    assert all(side_copies) and len(out) == 6
    for (x, _), got in zip(data, out):
        xc = x.to("cuda")  # rule 1: the same kernels on a plainly copied input, same bits
        torch.testing.assert_close(got, (xc @ xc).sum(), **EXACT)


HERE = Path(__file__).resolve().parent


class Counter:
    """An iterable with a position: yields 0, 1, 2, ..."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return torch.tensor(self.i - 1)

    def state_dict(self):
        return {"i": self.i, "gen": torch.Generator().manual_seed(self.i).get_state()}

    def load_state_dict(self, d):
        assert torch.equal(d["gen"], torch.Generator().manual_seed(d["i"]).get_state())
        self.i = d["i"]


def test_a_stateful_loader_resumes_from_the_saved_position_through_json():
    it = prefetch(Counter(), "cpu")
    assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
    saved = json.dumps(it.state_dict())  # a tensor in the state is encoded, not pickled
    resumed = prefetch(Counter(), "cpu")
    resumed.load_state_dict(json.loads(saved))
    assert [int(next(resumed)) for _ in range(2)] == [3, 4]
    with pytest.raises(RuntimeError, match="already taken .* before the first next"):
        resumed.load_state_dict(json.loads(saved))


def test_position_errors_say_what_to_do():
    it = prefetch([torch.zeros(1)], "cpu")
    with pytest.raises(TypeError, match="has no state_dict.*StatefulDataLoader"):
        it.state_dict()
    with pytest.raises(ValueError, match="with a 'loader' key; got list"):
        prefetch(Counter(), "cpu").load_state_dict([1])
    with pytest.raises(TypeError, match=r"\['x'\]: a object cannot be stored as JSON"):
        fasttorch.data.to_json({"x": object()})
    with pytest.raises(ValueError, match="unknown tensor dtype 'load'"):
        fasttorch.data.from_json({"__tensor__": "load", "shape": [], "data": 0})


def test_torchdata_stateful_dataloader_position_round_trips_through_json():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = torch.utils.data.TensorDataset(torch.arange(20))

    def make():
        g = torch.Generator().manual_seed(0)
        return sdl.StatefulDataLoader(ds, batch_size=4, shuffle=True, generator=g)

    whole = [b[0].tolist() for b in prefetch(make(), "cpu")]
    it = prefetch(make(), "cpu")
    seen = [next(it)[0].tolist() for _ in range(2)]
    saved = json.dumps(it.state_dict())  # the sampler's generator state is a tensor
    resumed = prefetch(make(), "cpu")
    resumed.load_state_dict(json.loads(saved))
    assert seen + [b[0].tolist() for b in resumed] == whole


def _run_worker(args):
    # This checkout's fasttorch, whatever the environment has installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), *sys.path])}
    return subprocess.run(
        [sys.executable, str(HERE / "data_worker.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize("loader", ["own", "torchdata"])
def test_killed_run_resumes_with_the_same_batches_bit_for_bit(loader, tmp_path):
    """Run 15 steps in one go; run again, SIGKILL after step 11 (checkpoints at 5 and
    10), resume in a new process: the same batches and the same losses, bit for bit."""
    if loader == "torchdata":
        pytest.importorskip("torchdata.stateful_dataloader")
    common = {"loader": loader, "steps": 15, "every": 5}
    whole = {**common, "ckpt": str(tmp_path / "a"), "log": str(tmp_path / "a.log")}
    assert _run_worker(whole).returncode == 0
    cut = {**common, "ckpt": str(tmp_path / "b"), "log": str(tmp_path / "b.log")}
    killed = _run_worker({**cut, "kill_after": 12})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not Path(cut["log"] + ".params.json").exists()
    resumed = _run_worker(cut)
    assert resumed.returncode == 0, resumed.stderr
    a = Path(whole["log"]).read_text().splitlines()
    b = Path(cut["log"]).read_text().splitlines()
    # Steps 0-11 ran before the kill; the resumed run redid 10 and 11 from step 10's
    # checkpoint, then went on: every line equals the uninterrupted run's.
    assert [line.split()[0] for line in b] == [str(i) for i in [*range(12), *range(10, 15)]]
    assert b[:12] + b[14:] == a[:12] + a[12:] and b[12:14] == a[10:12]
    assert len({line.split(" ", 1)[1].rsplit(" ", 1)[0] for line in a}) > 6  # reshuffled
    params_a = json.loads(Path(whole["log"] + ".params.json").read_text())
    params_b = json.loads(Path(cut["log"] + ".params.json").read_text())
    assert params_a == params_b


@pytest.mark.gpu
def test_cuda_read_ahead_does_not_move_the_saved_position():
    it = prefetch(Counter(), "cuda", depth=3)
    assert [int(next(it).cpu()) for _ in range(2)] == [0, 1]
    assert it.loader.i == 5  # three batches read ahead of the two handed out
    saved = json.loads(json.dumps(it.state_dict()))
    assert saved["loader"]["i"] == 2
    resumed = prefetch(Counter(), "cuda", depth=3)
    resumed.load_state_dict(saved)
    assert [int(next(resumed).cpu()) for _ in range(2)] == [2, 3]
