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
``--log-every`` steps: that is the loop's only host sync.

Run ``python examples/train_charlm.py --help`` for the flags; the defaults finish in
about two minutes on two CPU cores, torch.compile included.
"""

from __future__ import annotations

import os

# On a shared CPU box, OpenMP threads that spin-wait between the many small kernels of a
# compiled step make it 10-40x slower as soon as another process takes a core; sleeping
# waiters cost little when the machine is idle. Read once, when torch loads OpenMP, so
# it must come before `import torch`; set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import math
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fasttorch
from fasttorch import schedules
from fasttorch.distributed import replicate, setup, sync_on_last

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

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # No attention dropout (dropout_p=0): in torch 2.13, SDPA with dropout_p > 0
        # under autocast fails inside torch.func.grad, which fasttorch.step uses.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        x = x + self.resid_drop(self.proj(y))
        return x + self.mlp(self.ln2(x))


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


def loss_fn(apply: Callable[..., Tensor], batch: Batch) -> Tensor:
    """Mean next-token cross-entropy, in float32 whatever the autocast dtype."""
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def build_step(
    precision: str, accum: int, clip: float, compile: bool, world: int = 1
) -> Callable[[fasttorch.TrainState, Batch], tuple[fasttorch.TrainState, dict[str, Any]]]:
    """The composed training step: amp, accumulation, data parallel, clipping, compile."""
    step = fasttorch.step(loss_fn)
    if precision != "fp32":
        step = fasttorch.with_amp(step, cast(Literal["bf16", "fp16", "auto"], precision))
    step = fasttorch.grad_accumulate(step, accum)
    if world > 1:  # under torchrun: average the gradients of each window across ranks
        step = sync_on_last(step)
    step = fasttorch.clip_scaled(step, clip)
    if compile:
        step = fasttorch.compiled(step)
    return step


@torch.no_grad()
def evaluate(state: fasttorch.TrainState, batches: Batches, n: int) -> float:
    """Mean loss of ``state`` on ``n`` batches, through ``state.apply`` in eval mode."""
    module = state.module
    module.eval()  # state.apply runs the module in whatever mode it is in
    try:
        total = torch.zeros((), device=state.device)
        for _ in range(n):
            x, y = batches()
            total += F.cross_entropy(state.apply(x).flatten(0, 1).float(), y.flatten())
        return float(total) / n
    finally:
        module.train()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a character-level GPT on the stdlib's source with fasttorch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step")
    p.add_argument(
        "--accum", type=int, default=1, help="microbatches per step (divides --batch-size)"
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
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps // 10)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="stdlib bytes to read")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: torch's choice)"
    )
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "accum", "block_size", "n_layer", "n_embd", "n_head"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_size % args.accum:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --accum {args.accum}")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.log_every < 1 or args.eval_batches < 1:
        p.error("--log-every and --eval-batches must be >= 1")
    if not 0.0 < args.val_fraction < 1.0:
        p.error("--val-fraction must be in (0, 1)")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, print progress, and return the summary numbers."""
    t_start = time.perf_counter()
    args = parse_args(argv)
    # Under torchrun this joins the process group (gloo on CPU, NCCL on GPU); alone, a no-op.
    rank, world, device = setup(args.device)
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {world} ranks")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")

    # Data: the stdlib's source, byte-level vocabulary, the tail held out.
    raw, n_files = stdlib_source(args.max_bytes)
    vocab = ByteVocab(raw)
    tokens = vocab.encode(raw).to(device)
    n_val = max(int(len(tokens) * args.val_fraction), args.block_size + 2)
    train_tokens, val_tokens = tokens[:-n_val], tokens[-n_val:]
    train_batches = Batches(train_tokens, args.block_size, args.batch_size, args.seed, rank, world)
    val_batches = Batches(val_tokens, args.block_size, args.batch_size, args.seed + 1)

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

    warmup = min(args.warmup, args.steps)
    schedule = schedules.warmup(  # linear from lr/warmup up to lr, then cosine down
        warmup,
        schedules.cosine(args.lr, max(1, args.steps - warmup), end=args.min_lr),
        init=args.lr / warmup,
    )
    optimizer = fasttorch.optim.adamw(schedule, weight_decay=args.weight_decay)
    state = fasttorch.TrainState.create(model, optimizer, seed=args.seed)
    if world > 1:
        state = replicate(state)  # rank 0's weights everywhere, a dropout stream per rank
    step = build_step(args.precision, args.accum, args.clip, not args.no_compile, world)
    say = print if rank == 0 else _quiet

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
        f"step: precision {args.precision}, batch {args.batch_size} = {args.accum} x "
        f"{args.batch_size // args.accum}, clip {args.clip}, "
        f"{'eager' if args.no_compile else 'compiled (inductor)'} | {args.steps} steps, "
        f"lr {args.lr:g} (warm-up {warmup}, cosine to {args.min_lr:g})"
    )
    val_initial = evaluate(state, val_batches, args.eval_batches)
    say(f"held-out loss before training {val_initial:.4f} (uniform: {math.log(len(vocab)):.4f})")

    t_train = time.perf_counter()
    compile_s = 0.0
    initial_loss = math.nan
    loss = math.nan
    skipped = 0
    window_loss = torch.zeros((), device=device)  # summed on device: no sync per step
    window_skipped = torch.zeros((), dtype=torch.int64, device=device)
    t_log = t_train
    last_log = 0
    for it in range(args.steps):
        state, metrics = step(state, train_batches())
        window_loss += metrics["loss"].detach().float()
        if "skipped" in metrics:
            window_skipped += metrics["skipped"]
        last = it == args.steps - 1
        if it == 0 or (it + 1) % args.log_every == 0 or last:
            # The only host sync of the loop: read this window's metrics back.
            n_window = it + 1 - last_log
            loss = float(metrics["loss"])
            mean_loss = float(window_loss) / n_window
            skipped += int(window_skipped)
            now = time.perf_counter()
            if it == 0:
                initial_loss = loss
                compile_s = now - t_train
                speed = f"first step {compile_s:.1f} s" + (
                    " (compiles)" if not args.no_compile else ""
                )
            else:
                speed = f"{n_window / (now - t_log):.2f} steps/s"
            extra = f" | scale {float(metrics['loss_scale']):g}" if "loss_scale" in metrics else ""
            say(
                f"step {it + 1:5d} | loss {loss:.4f} (mean {mean_loss:.4f}) | "
                f"lr {float(metrics['lr']):.2e} | grad norm {float(metrics['grad_norm']):.3f} | "
                f"{speed}{extra}"
            )
            window_loss.zero_()
            window_skipped.zero_()
            t_log, last_log = now, it + 1
    t_end = time.perf_counter()
    steady_steps = args.steps - 1
    train_after_first = t_end - t_train - compile_s
    steps_per_s = steady_steps / train_after_first if steady_steps else math.nan

    val_final = evaluate(state, val_batches, args.eval_batches)
    wall_s = time.perf_counter() - t_start
    say(
        f"train loss {initial_loss:.4f} -> {loss:.4f} | held-out loss {val_initial:.4f} -> "
        f"{val_final:.4f} | skipped steps {skipped}"
    )
    say(
        f"wall {wall_s:.1f} s | first step {compile_s:.1f} s | "
        f"{steps_per_s:.2f} steps/s after it ({steady_steps} steps in {train_after_first:.1f} s)"
    )
    if world > 1:
        torch.distributed.destroy_process_group()
    return {
        "device": str(device),
        "world": world,
        "torch": torch.__version__,
        "params": n_params,
        "data_bytes": len(raw),
        "vocab_size": len(vocab),
        "steps": args.steps,
        "initial_loss": initial_loss,
        "final_loss": loss,
        "val_loss_initial": val_initial,
        "val_loss": val_final,
        "skipped_steps": skipped,
        "compile_s": compile_s,
        "steps_per_s": steps_per_s,
        "wall_s": wall_s,
    }


def _quiet(*args: Any, **kwargs: Any) -> None:
    """Ranks other than 0 print nothing."""


if __name__ == "__main__":
    main(sys.argv[1:])
