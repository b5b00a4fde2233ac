"""Loop helpers: budgets, every-k, early stopping, a logger and a progress line that read rarely."""

from __future__ import annotations

import io

import pytest
import torch
from reference import LayerNormNet, batches, mse
from tolerance import gamma, unit_roundoff

import fasttorch
from fasttorch.loop import EarlyStopping, Logger, Progress, every, memory_bytes, until


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
    assert [i for i, _ in logged] == [2, 5]
    assert set(logged[0][1]) == {"loss", "grad_norm", "lr", "loss_avg"}
    # Rule 3: a mean of 3 positive losses in two orders, each within gamma(3) relative.
    expected = float(sum(losses[3:6]) / 3)
    assert logged[1][1]["loss_avg"] == pytest.approx(expected, rel=2 * gamma(3), abs=0)


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
