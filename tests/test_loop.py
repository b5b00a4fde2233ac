"""Loop helpers: budgets, every-k, early stopping, a logger and a progress line that read rarely."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import torch
from reference import LayerNormNet, batches, mse
from tolerance import gamma, unit_roundoff

import fasttorch
from fasttorch.loop import (
    CSVWriter,
    EarlyStopping,
    JSONLWriter,
    Logger,
    Progress,
    TensorBoardWriter,
    every,
    memory_bytes,
    until,
)
from fasttorch.testing import forbid_host_sync


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_until_stops_at_max_steps_or_max_seconds():
    assert list(until(4)) == [0, 1, 2, 3]
    assert list(until(4, start=2)) == [2, 3]
    clock = FakeClock()
    seen = []
    for i in until(max_seconds=10, clock=clock):
        seen.append(i)
        clock.t += 3.0  # each step takes 3 s: steps start at 0, 3, 6, 9 s
    assert seen == [0, 1, 2, 3]
    clock.t = 0.0
    assert list(until(2, max_seconds=100, clock=clock)) == [0, 1]
    with pytest.raises(ValueError, match="give max_steps, max_seconds or both"):
        until()
    with pytest.raises(ValueError, match="max_seconds must be > 0"):
        until(max_seconds=0)


def test_every():
    assert [i for i in range(12) if every(5)(i)] == [4, 9]
    assert [i for i in range(5) if every(1)(i)] == [0, 1, 2, 3, 4]
    assert [i for i in range(7) if every(3, first=True)(i)] == [0, 2, 5]
    with pytest.raises(ValueError, match="k must be an integer >= 1, got 0"):
        every(0)


@pytest.mark.parametrize(
    ("mode", "values", "stops_at"),
    [
        ("min", [5.0, 4.0, 4.0, 3.99, 3.0, 3.0, 3.0], 3),  # 3.99 is within min_delta
        ("max", [0.1, 0.5, 0.45, 0.6, 0.6, 0.55], 5),
    ],
)
def test_early_stopping(mode, values, stops_at):
    stop = EarlyStopping(patience=2, min_delta=0.05, mode=mode)
    results = [stop.update(torch.tensor(v)) for v in values]
    assert results.index(True) == stops_at
    best = (min if mode == "min" else max)(values)
    assert stop.best == pytest.approx(best, rel=unit_roundoff(torch.float32))  # a float32 copy
    with pytest.raises(ValueError, match="mode must be 'min' or 'max', got 'up'"):
        EarlyStopping(1, mode="up")
    with pytest.raises(ValueError, match="patience must be an integer >= 1"):
        EarlyStopping(0)


class CountingTensor:
    """Counts host reads of metric tensors by patching Tensor.__float__."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = torch.Tensor.__float__

        def counted(t):
            self.n += 1
            return real(t)

        monkeypatch.setattr(torch.Tensor, "__float__", counted)


def test_logger_reads_only_every_k_steps_and_averages_the_loss(monkeypatch):
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    step = fasttorch.step(mse)
    logged = []
    log = Logger(3, sink=lambda i, m: logged.append((i, m)))
    reads = CountingTensor(monkeypatch)
    losses = []
    for i, b in zip(until(7), batches(7, 8)):
        state, m = step(state, b)
        losses.append(m["loss"].clone())
        before = reads.n
        log(i, m)
        assert (reads.n > before) == every(3)(i)
    # The sinks get the steps done (state.step after the update), as Progress shows.
    assert [i for i, _ in logged] == [3, 6]
    assert set(logged[0][1]) == {"loss", "grad_norm", "lr", "loss_avg"}
    # Rule 3: a mean of 3 positive losses in two orders, each within gamma(3) relative.
    expected = float(sum(losses[3:6]) / 3)
    assert logged[1][1]["loss_avg"] == pytest.approx(expected, rel=2 * gamma(3), abs=0)


def test_logger_progress_and_the_state_say_the_same_step_number():
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    step = fasttorch.step(mse)
    logged, shown, counts = [], io.StringIO(), []
    log = Logger(4, sink=lambda done, m: logged.append(done))
    bar = Progress(8, k=4, stream=shown)
    for i, b in zip(until(8), batches(8, 8)):
        state, m = step(state, b)
        log(i, m)
        bar(i, m)
        if every(4)(i):
            counts.append(int(state.step))
    assert counts == [4, 8]
    assert logged == counts
    assert [line.split(" | ")[0] for line in shown.getvalue().splitlines()] == [
        "step 4/8",
        "step 8/8",
    ]


def test_progress_writes_lines_when_not_a_tty():
    clock = FakeClock()
    out = io.StringIO()
    bar = Progress(6, k=2, stream=out, clock=clock)
    for i in range(6):
        clock.t += 0.5
        bar(
            i,
            {
                "loss": torch.tensor(1.5),
                "lr": torch.tensor(0.01),
                "loss_scale": torch.tensor(1024.0),
            },
        )
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()
    assert lines[0].startswith(
        "step 2/6 | loss 1.5 | lr 0.01 | fp16 | scale 1024 | 2 steps/s | mem "
    )
    assert lines[0].endswith(" GiB")


def test_progress_rewrites_one_line_on_a_tty():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    bar = Progress(k=1, stream=out, precision="bf16")
    for i in range(3):
        bar(i, {"loss": torch.tensor(2.0)})
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "step 3 | loss 2 | bf16 |" in text


def test_memory_is_the_process_rss_on_cpu():
    big = torch.ones(32 * 2**20 // 4)  # 32 MiB
    assert memory_bytes("cpu") > 32 * 2**20
    del big


def _train_and_log(monkeypatch, sinks, steps=7, k=3):
    """A training loop with a Logger over ``sinks``; checks the host reads happen only
    on logging steps, and returns what the Logger handed out."""
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    step = fasttorch.step(mse)
    log = Logger(k, sink=sinks)
    reads = CountingTensor(monkeypatch)
    handed = []
    for i, b in zip(until(steps), batches(steps, 8)):
        state, m = step(state, b)
        before = reads.n
        if every(k)(i):
            handed.append((i, log(i, m)))
        else:
            with forbid_host_sync():  # item / tolist / bool raise here
                assert log(i, m) is None
        assert (reads.n > before) == every(k)(i), i  # float() only on logging steps
    return handed


def test_tensorboard_writer_reads_only_at_log_steps_and_tensorboard_reads_it_back(
    monkeypatch, tmp_path
):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardWriter(tmp_path / "tb", prefix="train/") as tb:
        handed = _train_and_log(monkeypatch, tb)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    names = {"train/loss", "train/grad_norm", "train/lr", "train/loss_avg"}
    assert set(acc.Tags()["scalars"]) == names
    for name in names:
        events = acc.Scalars(name)
        assert [e.step for e in events] == [3, 6]
        for e, (_, m) in zip(events, handed):
            # Event files store float32: equal after rounding the float64 to float32.
            assert e.value == torch.tensor(m[name.removeprefix("train/")]).float().item()


def test_tensorboard_writer_says_how_to_install_it(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ImportError, match=r"pip install 'fasttorch\[tensorboard\]'"):
        TensorBoardWriter(tmp_path)


def test_csv_and_jsonl_writers_read_back_and_append_on_resume(monkeypatch, tmp_path):
    csv_path, jsonl_path = tmp_path / "m" / "metrics.csv", tmp_path / "m" / "metrics.jsonl"
    with CSVWriter(csv_path) as c, JSONLWriter(jsonl_path) as j:
        handed = _train_and_log(monkeypatch, [c, j])
    with CSVWriter(csv_path) as c, JSONLWriter(jsonl_path) as j:  # a resumed run appends
        c(9, {"loss": 0.25, "lr": math.inf})
        j(9, {"loss": 0.25, "eval": {"loss": math.nan}})
    rows = list(csv.DictReader(csv_path.open()))
    assert [r["step"] for r in rows] == ["3", "6", "9"]  # one header
    for r, (_, m) in zip(rows, handed):
        assert {k: float(v) for k, v in r.items() if k != "step"} == m  # repr: exact floats
    assert rows[2]["loss"] == "0.25" and rows[2]["lr"] == "inf" and rows[2]["grad_norm"] == ""
    lines = [json.loads(line) for line in jsonl_path.open()]
    assert [line.pop("step") for line in lines] == [3, 6, 9]
    assert lines[:2] == [m for _, m in handed]
    assert lines[2]["loss"] == 0.25 and math.isnan(lines[2]["eval/loss"])


def test_csv_writer_refuses_a_metric_outside_its_columns(tmp_path):
    with CSVWriter(tmp_path / "a.csv") as c:
        c(0, {"loss": 1.0})
        with pytest.raises(ValueError, match=r"metrics \['acc'\] are not among .*JSONLWriter"):
            c(1, {"loss": 1.0, "acc": 0.5})
    with pytest.raises(ValueError, match=r"has columns \['loss'\], not the columns= given"):
        CSVWriter(tmp_path / "a.csv", columns=["acc"])
    with CSVWriter(tmp_path / "b.csv", columns=["loss", "acc"]) as c:
        c(0, {"acc": 0.5})
    assert (tmp_path / "b.csv").read_text().splitlines() == ["step,loss,acc", "0,,0.5"]


def test_logger_checks_its_sinks():
    with pytest.raises(TypeError, match="each sink must be callable .* got int"):
        Logger(1, sink=[print, 3])
