"""A training run that tests/test_data.py kills mid-way and resumes in a new process.

    python tests/data_worker.py JSON_ARGS

Trains a small model on a shuffled loader (torchdata's ``StatefulDataLoader`` when
``args["loader"] == "torchdata"``, else a ``Shuffled`` iterable of this file) read
through ``fasttorch.prefetch``; checkpoints every ``args["every"]`` steps with the
loader's position in ``data`` (JSON-serializable); resumes from the newest checkpoint
when there is one. After each step it appends ``step, the batch's sample ids, the
loss's bits`` to ``args["log"]``; with ``args["kill_after"]`` it kills itself
(SIGKILL: no cleanup, no flush beyond what was written) after that step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch

import fasttorch
from fasttorch import checkpoint

N, DIM = 48, 6


class Shuffled:
    """Epochs of a reshuffled range of sample ids, in batches; resumable mid-epoch."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch, self.seed = n, batch, seed
        self.epoch, self.offset = 0, 0

    def __iter__(self) -> Shuffled:
        return self

    def __next__(self) -> torch.Tensor:
        if self.offset >= self.n:
            self.epoch, self.offset = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g)
        ids = order[self.offset : self.offset + self.batch]
        self.offset += self.batch
        return ids

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.epoch, self.offset = d["epoch"], d["offset"]


def batches(kind: str) -> Any:
    if kind == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler

        g = torch.Generator().manual_seed(3)
        ds = torch.utils.data.TensorDataset(torch.arange(N))
        # 48 samples, 8 per batch: 6 batches an epoch, so the run stops mid-epoch and the
        # resumed run crosses an epoch boundary. The generator goes to the sampler: given
        # to the loader (shuffle=True, generator=g), torchdata 0.11 also draws the workers'
        # base seed from it, and the epoch after a resumed one is shuffled differently.
        loader = StatefulDataLoader(ds, batch_size=8, sampler=RandomSampler(ds, generator=g))
        return loader, lambda b: b[0]
    return Shuffled(N, 8, seed=3), lambda b: b


def main(args: dict[str, Any]) -> None:
    torch.manual_seed(0)
    table = torch.randn(N, DIM + 1, generator=torch.Generator().manual_seed(1))
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-2))
    step = fasttorch.step(
        lambda apply, b: torch.nn.functional.mse_loss(apply(b[:, :DIM]), b[:, DIM:])
    )
    state = step.init(state)
    loader, ids_of = batches(args["loader"])
    it = fasttorch.prefetch(loader, "cpu")
    path = checkpoint.latest(args["ckpt"])
    if path is not None:
        state, data = checkpoint.load(path, state, inplace=True)
        it.load_state_dict(data["loader"])
    with open(args["log"], "a") as log:
        for i in range(int(state.step), args["steps"]):
            try:
                batch = next(it)
            except StopIteration:  # a DataLoader's epoch ended: the next one reshuffles
                it = fasttorch.prefetch(loader, "cpu")
                batch = next(it)
            ids = ids_of(batch)
            state, metrics = step(state, table[ids])
            log.write(f"{i} {ids.tolist()} {float(metrics['loss']).hex()}\n")
            log.flush()
            if (i + 1) % args["every"] == 0:
                position = it.state_dict()
                json.dumps(position)  # the checkpoint's data must be JSON
                checkpoint.save(args["ckpt"], state, data={"loader": position})
            if i + 1 == args.get("kill_after"):
                os.kill(os.getpid(), signal.SIGKILL)
    final = {k: v.tolist() for k, v in state.params.items()}
    with open(args["log"] + ".params.json", "w") as f:
        json.dump(final, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
