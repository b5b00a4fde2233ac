"""Train a small character-level GPT on the standard library's own source code.

The main example job of fasttorch: a user's loop around one composed, compiled step::

    step = fasttorch.step(loss_fn)
    step = fasttorch.with_amp(step, "bf16")
    step = fasttorch.grad_accumulate(step, accum)
    step = fasttorch.clip_scaled(step, 1.0)
    step = fasttorch.compiled(step)
    for it in range(steps):
        state, metrics = step(state, next_batch())

The data is text every Python installation ships: the ``.py`` files of the standard
library (``sysconfig.get_paths()["stdlib"]``), read in sorted order up to
``--max-bytes``, with a byte-level vocabulary of the bytes that occur and the last
``--val-fraction`` held out. Metrics are read back (``float(...)``) only every
``--log-every`` steps, by a ``fasttorch.loop.Progress`` line: that is the loop's only
host sync besides evaluation.

Around the loop: the held-out loss on a fixed set of batches every ``--eval-every``
steps (``fasttorch.eval_step``, compiled when the step is; with ``--ema DECAY`` also on
the weights' moving average from ``fasttorch.ema``), background checkpoints every
``--ckpt-every`` steps (``fasttorch.checkpoint.async_save``, with the batch sampler's
generator state as ``data``, so ``--resume`` continues bit for bit), a few steps traced
by ``fasttorch.profiled`` with ``--profile DIR``, and at the end ``loss.svg`` and
``summary.json`` in ``--out``. Under torchrun only rank 0 prints and writes those files;
checkpoints are written by all ranks together. With ``--fsdp`` the model is sharded
across the ranks by FSDP2 (``fully_shard`` per block, then the root; each block compiled
before it is sharded), and the state holds each rank's shards. With ``--tp N`` the ranks
form a 2-D mesh, N-way tensor parallel inside each block (``parallelize_module``'s
column- and row-wise split of attention and MLP, by heads) times FSDP2 over the rest
(``fasttorch.distributed.parallelize``); the N ranks of a tensor-parallel group share
one batch shard.

Run ``python examples/train_charlm.py --help`` for the flags; the defaults finish in
about two minutes on two CPU cores, torch.compile included.
"""

from __future__ import annotations

import os
import warnings

# On a shared CPU box, OpenMP threads that spin-wait between the many small kernels of a
# compiled step make it 10-40x slower as soon as another process takes a core; sleeping
# waiters cost little when the machine is idle. Read once, when torch loads OpenMP, so
# it must come before `import torch`; set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch (2.10 at least) warns "Failed to initialize NumPy" while `import torch` runs
# where numpy is not installed (torch/_subclasses/functional_tensor.py converts a tensor
# as it loads), as the first line of this job's output. Nothing here uses numpy. Read
# before `import torch`.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import argparse
import gc
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from example_utils import Bar, loss_svg, peak_memory_bytes  # examples/example_utils.py
from torch import Tensor, nn

import fasttorch
from fasttorch import checkpoint, schedules
from fasttorch.data import from_json, to_json
from fasttorch.distributed import backend_for, parallelize, replicate, setup, sync_on_last
from fasttorch.evaluation import evaluate
from fasttorch.loop import TensorBoardWriter, every
from fasttorch.transforms.profiled import Profiled

Batch = tuple[Tensor, Tensor]

# --------------------------------------------------------------------------- data


def stdlib_source(max_bytes: int) -> tuple[bytes, int]:
    """The standard library's ``.py`` files in sorted path order, up to ``max_bytes``.

    Returns the concatenated bytes (each file preceded by a ``# file: <path>`` line) and
    the number of files read. ``site-packages`` and ``dist-packages`` are skipped, so the
    result depends only on the Python version, never on what is installed.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        paths.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    if not paths:
        raise RuntimeError(f"no .py files found under the standard library at {root}")
    chunks: list[bytes] = []
    total = 0
    for path in paths:
        if total >= max_bytes:
            break
        try:
            text = path.read_bytes()
        except OSError:
            continue
        chunk = b"# file: " + path.relative_to(root).as_posix().encode() + b"\n" + text
        chunk = chunk[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks), len(chunks)


class ByteVocab:
    """A byte-level vocabulary of the byte values that occur in a text."""

    def __init__(self, data: bytes) -> None:
        self.symbols: list[int] = sorted(set(data))
        lut = torch.zeros(256, dtype=torch.long)
        lut[torch.tensor(self.symbols)] = torch.arange(len(self.symbols))
        self._lut = lut

    def __len__(self) -> int:
        return len(self.symbols)

    def encode(self, data: bytes) -> Tensor:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        return self._lut[raw]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(self.symbols[i] for i in ids).decode("utf-8", errors="replace")


class Batches:
    """Random windows of ``block_size + 1`` tokens, sampled with a seeded generator.

    Offsets are drawn on the CPU from the loader's own generator (so the model's RNG
    and the data order are independent) and the windows are gathered on the device.
    """

    def __init__(
        self,
        tokens: Tensor,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        if tokens.numel() <= block_size + 1:
            raise ValueError(
                f"{tokens.numel()} tokens are too few for --block-size {block_size}; "
                "raise --max-bytes or lower --block-size"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.window = torch.arange(block_size + 1, device=tokens.device)
        self.high = tokens.numel() - block_size - 1
        self.rank, self.world = rank, world

    def __call__(self) -> Batch:
        # Every rank draws the same global batch and keeps its own rows of it, so a
        # data-parallel run sees exactly the batches of a single-process run.
        starts = torch.randint(self.high, (self.batch_size, 1), generator=self.gen)
        starts = starts.tensor_split(self.world)[self.rank]
        rows = self.tokens[starts.to(self.tokens.device, non_blocking=True) + self.window]
        return rows[:, :-1], rows[:, 1:]


def split_tokens(tokens: Tensor, block_size: int, val_fraction: float) -> tuple[Tensor, Tensor]:
    """The training tokens and the held-out tail (``val_fraction``, at least one window)."""
    n_val = max(int(len(tokens) * val_fraction), block_size + 2)
    return tokens[:-n_val], tokens[-n_val:]


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )
        self.resid_drop = nn.Dropout(dropout)

    def split_qkv(self) -> None:
        """Replace the fused ``qkv`` layer by ``q``, ``k`` and ``v`` layers holding its
        rows: the same function, in three layers that tensor parallelism can each split
        by heads (a column-wise split of the fused one would give a rank the queries of
        every head and half the keys)."""
        c = self.qkv.in_features
        device = self.qkv.weight.device
        for name, w, bias in zip("qkv", self.qkv.weight.split(c), self.qkv.bias.split(c)):
            layer = nn.utils.skip_init(nn.Linear, c, c, device=device)  # no RNG drawn
            with torch.no_grad():
                layer.weight.copy_(w)
                layer.bias.copy_(bias)
            setattr(self, name, layer)
        del self.qkv

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        h = self.ln1(x)
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(h).split(c, dim=2)
        else:  # split_qkv: under tensor parallelism each holds this rank's heads
            q, k, v = self.q(h), self.k(h), self.v(h)
        # -1: the heads this rank holds (all of them without tensor parallelism)
        q, k, v = (z.view(b, t, -1, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # No attention dropout (dropout_p=0): in torch 2.13, SDPA with dropout_p > 0
        # under autocast fails inside torch.func.grad, which fasttorch.step uses.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)
        x = x + self.resid_drop(self.proj(y))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class CharGPT(nn.Module):
    """A GPT: token and position embeddings, pre-LN blocks, final LayerNorm, linear head."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_embd: int,
        n_head: int,
        dropout: float,
        tie_weights: bool,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"--n-embd {n_embd} must be divisible by --n-head {n_head}")
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual outputs
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits


# --------------------------------------------------------------------------- training

StepFn = Callable[[fasttorch.TrainState, Batch], tuple[fasttorch.TrainState, dict[str, Any]]]
EvalFn = Callable[[fasttorch.TrainState, Batch], dict[str, Tensor]]


def lr_schedule(lr: float, min_lr: float, warmup: int, steps: int) -> schedules.Warmup:
    """Linear warm-up from ``lr / warmup`` to ``lr``, then cosine down to ``min_lr``."""
    decay = schedules.cosine(lr, max(1, steps - warmup), end=min_lr)
    return schedules.warmup(warmup, decay, init=lr / warmup)


def no_decay(model: nn.Module) -> Callable[[str, Tensor], bool]:
    """Weight decay on the matrices other than the embeddings: none on biases and
    LayerNorm weights (as nanoGPT, which decays every tensor of 2 or more dimensions,
    embeddings included), nor on the embeddings (as minGPT). A predicate of ``(name,
    parameter)`` for ``fasttorch.optim.groups``."""
    embeddings = {
        f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)
    }
    return lambda name, p: p.ndim < 2 or name in embeddings


def loss_fn(apply: Callable[..., Tensor], batch: Batch) -> Tensor:
    """Mean next-token cross-entropy, in float32 whatever the autocast dtype."""
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def build_step(
    precision: str,
    accum: int,
    clip: float,
    compile: bool,
    world: int = 1,
    ema: float | None = None,
    sharded: bool = False,
) -> tuple[fasttorch.Step, StepFn]:
    """The composed training step: amp, accumulation, data parallel, clipping, EMA, compile.

    Returns the step before ``compiled`` (for ``init`` and ``eval_step``) and the step to
    call. ``sharded``: the state's module is sharded with FSDP2, whose reduce-scatter
    ``sync_on_last`` drives, even on a single rank.
    """
    step = fasttorch.step(loss_fn)
    if precision != "fp32":
        step = fasttorch.with_amp(step, cast(Literal["bf16", "fp16", "auto"], precision))
    step = fasttorch.grad_accumulate(step, accum)
    if world > 1 or sharded:  # average each window's gradients across ranks
        step = sync_on_last(step)
    step = fasttorch.clip_scaled(step, clip)
    if ema is not None:  # a moving average of the weights, updated inside the step
        step = fasttorch.ema(step, ema)
    return step, (fasttorch.compiled(step) if compile else step)


def build_eval(base: fasttorch.Step, compile: bool, use_ema: bool = False) -> EvalFn:
    """The held-out loss of one batch: the step's forward (same autocast), no autograd,
    eval mode (dropout off); compiled when the training step is."""
    fn = fasttorch.eval_step(base, use_ema=use_ema)
    return cast(EvalFn, fasttorch.compiled(fn)) if compile else fn


# --------------------------------------------------------------------------- sharding


def join_alone(device: torch.device) -> None:
    """A process group of this one process: FSDP2 shards over a device mesh, which needs
    one even for a single rank (torchrun starts one for ``setup`` to join otherwise)."""
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group(backend_for(device), store=store, rank=0, world_size=1)


def shard(model: CharGPT, device: torch.device, world: int, compile: bool) -> None:
    """Shard ``model`` over all ranks with FSDP2: each block its own unit, then the root
    (embeddings, final LayerNorm, head), as torchtitan does. With ``compile`` each block
    is compiled first (``block.compile()``): FSDP2's hooks run outside any graph, so a
    block compiled before ``fully_shard`` is the part of the forward and backward that
    compiles; the rest runs eagerly around the hooks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        if compile:
            block.compile(fullgraph=True)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


# Megatron's split of a block, torchtitan's plan for Llama's: the attention's q, k, v
# and the MLP's first layer column-wise (each rank computes its heads and its share of
# the hidden units, no communication), the attention's output projection and the MLP's
# second layer row-wise (one all-reduce each, forward; the column-wise layers' input
# gradients one each, backward). Norms, embeddings and head stay whole on each rank of
# the tensor-parallel group (FSDP2 shards them over the data-parallel ranks).
def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "blocks.*.q": ColwiseParallel(),
        "blocks.*.k": ColwiseParallel(),
        "blocks.*.v": ColwiseParallel(),
        "blocks.*.proj": RowwiseParallel(),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(),
    }


def shard_2d(
    model: CharGPT, device: torch.device, world: int, tp: int, compile: bool
) -> tuple[int, int]:
    """Tensor parallel over ``tp`` ranks inside each block, FSDP2 over ``world // tp``:
    ``fasttorch.distributed.parallelize`` on a ``("dp_shard", "tp")`` mesh (torchtitan's
    names); with ``compile`` each block compiled after the plan, before FSDP2. Returns
    this rank's data-parallel rank and their number, the rows of each global batch it
    takes (its tensor-parallel peers take the same)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    for block in model.blocks:
        cast(Block, block).split_qkv()
    blocks = {"fullgraph": True} if compile else None
    parallelize(model, mesh, tp_plan(), blocks="blocks", compile=blocks)
    return mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()


def state_bytes(state: fasttorch.TrainState) -> tuple[int, int]:
    """Parameter + optimizer-state bytes held by this rank, and in the whole state (each
    shard counted at its parameter's global size)."""
    import torch.utils._pytree as pytree

    from fasttorch.distributed.fsdp import sharded_leaves

    shards = sharded_leaves(state)
    mine = whole = 0
    for i, (path, x) in enumerate(pytree.tree_flatten_with_path(state)[0]):
        if isinstance(x, Tensor) and getattr(path[0], "name", None) in ("params", "opt_state"):
            mine += x.numel() * x.element_size()
            whole += (shards[i].numel() if i in shards else x.numel()) * x.element_size()
    return mine, whole


def held_out(fn: EvalFn, state: fasttorch.TrainState, batches: list[Batch], world: int) -> float:
    """Mean loss over the fixed held-out batches; under torchrun each rank holds its rows of
    every batch (equal shares), so the mean of the ranks' means is the global mean."""
    loss = evaluate(fn, state, batches)["loss"]
    if world > 1:
        loss = loss.clone()
        torch.distributed.all_reduce(loss)  # SUM: gloo has no AVG
        loss /= world
    return float(loss)


# --------------------------------------------------------------------------- flags


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a character-level GPT on the stdlib's source with fasttorch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step")
    p.add_argument(
        "--accum", type=int, default=2, help="microbatches per step (divides --batch-size)"
    )
    p.add_argument("--block-size", type=int, default=64, help="context length in bytes")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument(
        "--untied-head", action="store_true", help="do not tie the head to the embedding"
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp16", "auto", "fp32"),
        default="bf16",
        help="autocast dtype (fasttorch.with_amp); fp32 skips with_amp",
    )
    p.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the parameters and optimizer state across the ranks with FSDP2 "
        "(fully_shard per block, then the root); under torchrun, or alone as 1 rank",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallel over N ranks inside each block, FSDP2 over the others "
        "(a 2-D mesh; implies --fsdp; under torchrun with a multiple of N ranks)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps // 10)")
    p.add_argument(
        "--weight-decay",
        type=float,
        default=0.1,
        help="AdamW weight decay of the weight matrices (none on biases, norms, embeddings)",
    )
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument(
        "--ema",
        type=float,
        default=None,
        metavar="DECAY",
        help="keep an EMA of the weights (fasttorch.ema) and evaluate it too",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument(
        "--eval-every",
        type=int,
        default=50,
        metavar="K",
        help="held-out loss every K steps (and before and after training); 0: only then",
    )
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per eval")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="stdlib bytes to read")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--ckpt-dir", default=None, metavar="DIR", help="write checkpoints here")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=0,
        metavar="K",
        help="checkpoint every K steps (always at the end); 0: only at the end",
    )
    p.add_argument("--ckpt-keep", type=int, default=3, help="newest checkpoints kept")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --ckpt-dir (start fresh if none)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="trace steps 3-5 with torch.profiler (fasttorch.profiled) into DIR",
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also write the logged metrics as TensorBoard event files into DIR",
    )
    p.add_argument(
        "--out", default="runs/charlm", metavar="DIR", help="loss.svg and summary.json go here"
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: torch's choice)"
    )
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "accum", "block_size", "n_layer", "n_embd", "n_head", "tp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_size % args.accum:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --accum {args.accum}")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.log_every < 1 or args.eval_batches < 1 or args.ckpt_keep < 1:
        p.error("--log-every, --eval-batches and --ckpt-keep must be >= 1")
    if args.eval_every < 0 or args.ckpt_every < 0:
        p.error("--eval-every and --ckpt-every must be >= 0")
    if not 0.0 < args.val_fraction < 1.0:
        p.error("--val-fraction must be in (0, 1)")
    if args.ema is not None and not 0.0 <= args.ema < 1.0:
        p.error("--ema must be in [0, 1) (0.99 or 0.999 are common)")
    if (args.resume or args.ckpt_every) and args.ckpt_dir is None:
        p.error("--resume and --ckpt-every need --ckpt-dir")
    if args.tp > 1:
        args.fsdp = True  # the data-parallel dimension is FSDP2's
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)
    return args


# --------------------------------------------------------------------------- main


def _finite_or_none(x: Any) -> Any:
    """``x`` with NaN/inf floats as ``None``: checkpoint data is strict JSON (a diverged
    run's losses must not stop it from saving)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite_or_none(v) for v in x]
    return x


def _none_as_nan(x: Any) -> Any:
    """The inverse of :func:`_finite_or_none` for a loaded history."""
    if x is None:
        return math.nan
    if isinstance(x, dict):
        return {k: _none_as_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_none_as_nan(v) for v in x]
    return x


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, print progress, write ``loss.svg`` and ``summary.json``; return the summary."""
    args = parse_args(argv)
    summary = train(args)
    if summary["world"] > 1 or summary["fsdp"]:
        # Only once train()'s model, state and steps are gone: FSDP2's modules hold the
        # group in reference cycles, and a gloo group left for the interpreter's exit to
        # free aborted the process there ("terminate called without an active
        # exception"; torch 2.13: 3 of 45 sharded 2-rank runs of this job, none of 45
        # since this collect).
        gc.collect()
        torch.distributed.destroy_process_group()
    return summary


def train(args: argparse.Namespace) -> dict[str, Any]:
    """The job with parsed flags; the process group it joins stays up (see :func:`main`)."""
    t_start = time.perf_counter()
    if args.fsdp and not torch.distributed.is_available():
        raise SystemExit(
            f"--fsdp shards with torch.distributed, which this torch build "
            f"({torch.__version__}) does not have (torch.distributed.is_available() is "
            "False). Install a build with distributed support (the PyPI wheels for Linux, "
            "macOS and Windows have it), or run without --fsdp"
        )
    # Under torchrun this joins the process group (gloo on CPU, NCCL on GPU); alone, a no-op.
    rank, world, device = setup(args.device)
    if args.fsdp and not torch.distributed.is_initialized():
        join_alone(device)  # --fsdp without torchrun: a group of one rank
    if world % args.tp:
        raise SystemExit(
            f"--tp {args.tp} must divide the number of ranks ({world}): launch with "
            f"torchrun --nproc_per_node={args.tp * max(1, world // args.tp)} (or a multiple "
            f"of {args.tp})"
        )
    data_ranks = world // args.tp  # the ranks of a tensor-parallel group share a batch
    if args.batch_size % data_ranks:
        raise SystemExit(
            f"--batch-size {args.batch_size} must be divisible by {data_ranks} data-parallel ranks"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    say = print if rank == 0 else _quiet  # only rank 0 prints and writes files

    # Data: the stdlib's source, byte-level vocabulary, the tail held out.
    raw, n_files = stdlib_source(args.max_bytes)
    vocab = ByteVocab(raw)
    tokens = vocab.encode(raw).to(device)
    train_tokens, val_tokens = split_tokens(tokens, args.block_size, args.val_fraction)
    data_rank = rank // args.tp  # torch's row-major mesh: rank = data rank * tp + tp rank
    train_batches = Batches(
        train_tokens, args.block_size, args.batch_size, args.seed, data_rank, data_ranks
    )
    # A fixed held-out set, drawn once: every evaluation scores the same windows.
    val_draw = Batches(
        val_tokens, args.block_size, args.batch_size, args.seed + 1, data_rank, data_ranks
    )
    val_set = [val_draw() for _ in range(args.eval_batches)]

    model = CharGPT(
        len(vocab),
        args.block_size,
        args.n_layer,
        args.n_embd,
        args.n_head,
        args.dropout,
        tie_weights=not args.untied_head,
    ).to(device)
    n_params = sum(p.numel() for p in model.parameters())  # shared weights counted once
    compile = not args.no_compile
    if args.tp > 1:  # a 2-D mesh: tensor parallel inside the blocks, FSDP2 across
        if shard_2d(model, device, world, args.tp, compile) != (data_rank, data_ranks):
            raise SystemExit("the device mesh does not lay out ranks row-major")
    elif args.fsdp:  # every rank built the same model (same seed): now each keeps 1/world
        shard(model, device, world, compile)

    warmup = min(args.warmup, args.steps)
    schedule = lr_schedule(args.lr, args.min_lr, warmup, args.steps)
    optimizer = fasttorch.optim.groups(
        fasttorch.optim.adamw(schedule, weight_decay=args.weight_decay),
        [(no_decay(model), {"weight_decay": 0.0})],
    )
    # Sharded: the state holds this rank's shards (optimizer moments and EMA too).
    state = fasttorch.TrainState.create(model, optimizer, seed=args.seed)
    if world > 1:
        # Rank 0's weights everywhere (each rank keeps its own shards), and a dropout
        # stream per rank.
        state = replicate(state)
    base, step = build_step(
        args.precision, args.accum, args.clip, compile, world, args.ema, sharded=args.fsdp
    )
    state = base.init(state)  # add the transforms' sub-states now: a checkpoint's template
    # A sharded state's evaluation runs the module as it is (its blocks compiled or not):
    # FSDP2's hooks cannot be in a graph, so compiled() around it would only run eagerly.
    compile_eval = compile and not args.fsdp
    evals = {"held-out": build_eval(base, compile_eval)}
    if args.ema is not None:
        evals["held-out EMA"] = build_eval(base, compile_eval, use_ema=True)

    # Resume: the newest complete checkpoint, with the data position saved beside it.
    history: dict[str, Any] = {"train": [], **{name: [] for name in evals}}
    start, resumed_from, path = 0, None, None
    if args.resume:
        path = checkpoint.latest(args.ckpt_dir)
        if path is not None:
            state, data = checkpoint.load(path, state, inplace=True)
            train_batches.gen.set_state(from_json(data["batches"]))
            history = _none_as_nan(data["history"])
            start = resumed_from = int(state.step)
            if start != data["step"]:
                raise SystemExit(f"{path}: state step {start} != data position {data['step']}")
    prof: Profiled | None = None
    if args.profile is not None and rank == 0:
        # Skip one call (it compiles), warm up one, record three; stops by itself.
        step = prof = fasttorch.profiled(step, dir=args.profile)

    say(
        f"device {device} | torch {torch.__version__} | fasttorch {fasttorch.__version__} | "
        f"threads {torch.get_num_threads()} | ranks {world}"
    )
    say(
        f"data: {len(raw) / 1e6:.2f} MB from {n_files} stdlib files | vocab {len(vocab)} | "
        f"train {len(train_tokens):,} / held-out {len(val_tokens):,} tokens"
    )
    say(
        f"model: {n_params / 1e6:.3f}M params | {args.n_layer} layers, {args.n_embd} wide, "
        f"{args.n_head} heads, block {args.block_size}, "
        f"{'untied' if args.untied_head else 'tied'} head"
    )
    say(
        f"step: {' -> '.join(base.transforms)}{' -> compiled' if compile else ''} | "
        f"precision {args.precision}, batch {args.batch_size} = {args.accum} x "
        f"{args.batch_size // args.accum}, clip {args.clip}"
        + (f", ema {args.ema:g}" if args.ema is not None else "")
        + f" | {args.steps} steps, lr {args.lr:g} (warm-up {warmup}, cosine to {args.min_lr:g})"
    )
    mine, whole = state_bytes(state)
    if args.tp > 1:
        say(
            f"sharded: a {data_ranks} x {args.tp} mesh, tensor parallel over {args.tp} "
            f"ranks inside each block, FSDP2 over {data_ranks} (fully_shard per block "
            f"x{args.n_layer}, then the root) | parameters + optimizer state "
            f"{mine / 2**20:.2f} MiB on rank 0 of {whole / 2**20:.2f} MiB"
        )
        if compile:
            say(
                "compiled: each block's forward and backward (compiled after the plan, "
                "before fully_shard) and the update (fasttorch.compiled); embeddings, final "
                "LayerNorm, head and loss run eagerly around FSDP2's hooks"
            )
    elif args.fsdp:
        say(
            f"sharded: FSDP2 over {world} rank{'s' if world > 1 else ''} (fully_shard per "
            f"block x{args.n_layer}, then the root) | parameters + optimizer state "
            f"{mine / 2**20:.2f} MiB on rank 0 of {whole / 2**20:.2f} MiB"
        )
        if compile:
            say(
                "compiled: each block's forward and backward (block.compile() before "
                "fully_shard) and the update (fasttorch.compiled); embeddings, final "
                "LayerNorm, head and loss run eagerly around FSDP2's hooks, evaluation too "
                "(its blocks compiled)"
            )
    if resumed_from is not None:
        say(f"resumed from {path} at step {start}")
    if start == 0:
        for name, fn in evals.items():
            history[name].append([0, held_out(fn, state, val_set, world)])
        history["val_initial"] = history["held-out"][0][1]
        say(
            f"held-out loss before training {history['val_initial']:.4f} "
            f"(uniform: {math.log(len(vocab)):.4f})"
        )

    bar = tb = None
    if rank == 0:
        bar = Bar(args.steps, precision=args.precision, start=start, compiles=compile)
        if args.tensorboard is not None:
            tb = TensorBoardWriter(args.tensorboard)  # fasttorch.loop's Logger sink
            if start == 0:
                tb(0, {"eval": {n.replace(" ", "_"): history[n][0][1] for n in evals}})
    log_due, eval_due = every(args.log_every), every(args.eval_every or args.steps + 1)
    ckpt_due = every(args.ckpt_every or args.steps + 1)
    pending: checkpoint.SaveHandle | None = None
    t_train = time.perf_counter()
    compile_s = eval_s = ckpt_s = 0.0
    loss = math.nan
    window_loss = torch.zeros((), device=device)  # summed on device: no sync per step
    window_skipped = torch.zeros((), dtype=torch.int64, device=device)
    last_log = start
    history.setdefault("skipped", 0)
    for it in range(start, args.steps):
        state, metrics = step(state, train_batches())
        window_loss += metrics["loss"].detach().float()
        if "skipped" in metrics:
            window_skipped += metrics["skipped"]
        done, first, last = it + 1, it == start, it + 1 == args.steps
        if first or last or log_due(it):
            # The loop's only host sync: read this window's metrics back.
            loss = float(metrics["loss"])
            mean_loss = float(window_loss) / (done - last_log)
            history["skipped"] += int(window_skipped)
            if first:
                compile_s = time.perf_counter() - t_train
                history.setdefault("initial_loss", loss)
            history["train"].append([done, mean_loss])
            if bar is not None:
                bar.show(done, {**metrics, "mean": mean_loss}, compile_s if first else None)
            if tb is not None:  # read here, on a log step, like the line above
                tb(done, {"train": {**metrics, "loss_avg": mean_loss}})
            window_loss.zero_()
            window_skipped.zero_()
            last_log = done
        if last or eval_due(it):
            t0 = time.perf_counter()
            values = {name: held_out(fn, state, val_set, world) for name, fn in evals.items()}
            for name, value in values.items():
                history[name].append([done, value])
            if tb is not None:
                tb(done, {"eval": {n.replace(" ", "_"): v for n, v in values.items()}})
            dt = time.perf_counter() - t0
            eval_s += dt
            if bar is not None:
                bar.exclude(dt)
                bar.close()  # end a terminal's progress line before a line of its own
            say(f"eval  {done:5d} | " + " | ".join(f"{k} loss {v:.4f}" for k, v in values.items()))
        if args.ckpt_dir is not None and (last or ckpt_due(it)):
            # Collective under torchrun (every rank calls it); the state is copied to CPU
            # memory first, then written in a background thread while training goes on.
            t0 = time.perf_counter()
            # JSON values only (a checkpoint's data is never unpickled): the
            # generator's state tensor goes in as a list by fasttorch.data.to_json.
            position = {"batches": to_json(train_batches.gen.get_state()), "step": done}
            pending = checkpoint.async_save(
                args.ckpt_dir,
                state,
                data={**position, "history": _finite_or_none(history)},
                keep_last=args.ckpt_keep,
            )
            dt = time.perf_counter() - t0
            ckpt_s += dt
            if bar is not None:
                bar.exclude(dt)
    t_end = time.perf_counter()
    if bar is not None:
        bar.close()
    if tb is not None:
        tb.close()
    if prof is not None:
        prof.stop()  # writes the window being recorded if the run was shorter than it
    saved = str(pending.wait()) if pending is not None else None  # the last save completes

    ran = args.steps - start
    steady_steps = ran - 1
    steady_s = t_end - t_train - compile_s - eval_s - ckpt_s
    steps_per_s = steady_steps / steady_s if steady_steps > 0 else math.nan
    tokens_per_s = steps_per_s * args.batch_size * args.block_size
    peak = peak_memory_bytes(device)
    wall_s = time.perf_counter() - t_start
    val_final = history["held-out"][-1][1] if history["held-out"] else math.nan
    ema_final = history["held-out EMA"][-1][1] if args.ema is not None else None
    summary: dict[str, Any] = {
        "device": str(device),
        "world": world,
        "fsdp": args.fsdp,
        "tp": args.tp,
        "torch": torch.__version__,
        "params": n_params,
        "data_bytes": len(raw),
        "vocab_size": len(vocab),
        "steps": args.steps,
        "resumed_from": resumed_from,
        "initial_loss": history.get("initial_loss", math.nan),
        "final_loss": loss,
        "val_loss_initial": history.get("val_initial", math.nan),
        "val_loss": val_final,
        "val_loss_ema": ema_final,
        "skipped_steps": history["skipped"],
        "compile_s": compile_s,
        "eval_s": eval_s,
        "steps_per_s": steps_per_s,
        "tokens_per_s": tokens_per_s,
        "wall_s": wall_s,
        "peak_memory_bytes": peak,
        "state_bytes": mine,  # parameters + optimizer state on rank 0 (1/world if sharded)
        "checkpoint": saved,
        # loss.svg's points: [step, loss] per log window (train) and per evaluation.
        "curves": {name: history[name] for name in ("train", *evals)},
    }
    say(
        f"train loss {summary['initial_loss']:.4f} -> {loss:.4f} | held-out loss "
        f"{summary['val_loss_initial']:.4f} -> {val_final:.4f}"
        + (f" (EMA {ema_final:.4f})" if ema_final is not None else "")
        + f" | skipped steps {history['skipped']}"
    )
    say(
        f"wall {wall_s:.1f} s | first step {compile_s:.1f} s"
        f"{' (compile time included)' if compile else ''} | {steps_per_s:.2f} steps/s, "
        f"{tokens_per_s:,.0f} tokens/s after it ({steady_steps} steps in {steady_s:.1f} s; "
        f"eval {eval_s:.1f} s) | peak mem {peak / 2**30:.2f} GiB"
    )
    if prof is not None:
        say(f"profile: {prof.calls} steps profiled, traces in {args.profile}")
    if saved is not None:
        say(f"checkpoint: {saved}")
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        curves = {"train (mean per log window)": history["train"]}
        curves.update({name: history[name] for name in evals})
        title = f"char-level GPT on the stdlib, {n_params / 1e6:.2f}M params, {args.precision}"
        (out / "loss.svg").write_text(loss_svg(curves, args.steps, title, "loss (nats per byte)"))
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        say(f"wrote {out / 'loss.svg'} and {out / 'summary.json'}")
    return summary


def _quiet(*args: Any, **kwargs: Any) -> None:
    """Ranks other than 0 print nothing."""


if __name__ == "__main__":
    main(sys.argv[1:])
