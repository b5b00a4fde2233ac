"""prefetch and loader_defaults: batches arrive in order, on the device, lazily."""

from __future__ import annotations

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
