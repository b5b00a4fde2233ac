"""Checks run inside each rank of a 4-process gloo group over a small transformer
parallelized on a 2-D mesh, 2 data-parallel (FSDP2) x 2 tensor-parallel ranks
(tests/test_tensor_parallel.py). Every composition is compared with the same
composition run by one process on the whole global batch, from the same weights.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

sys.path.insert(0, os.path.dirname(__file__))
from dist_kit import join, leave
from fsdp_ckpt_worker import gathered, leaves
from reference import DTYPES
from tolerance import FACTOR, params_atol, reference_error, unit_roundoff

import fasttorch
from fasttorch import checkpoint
from fasttorch._core.state import initial_rng_state
from fasttorch.distributed import parallelize, replicate, sync_on_last

STEPS, LR, CLIP = 3, 1e-2, 0.5
VOCAB, WIDTH, HEADS, LAYERS = 16, 16, 4, 2
ROWS, T = 8, 6  # global batch: 8 sequences of 6 tokens; 4 per data-parallel rank
K, M = 2, 2  # steps before a checkpoint, steps after it


class Block(nn.Module):
    """Pre-norm block with separate q, k, v (column-wise: each rank takes whole heads)."""

    def __init__(self, width: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_head = n_head
        # on the row-wise layers' outputs: whole on each tensor-parallel peer
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # No key bias: its true gradient is zero (softmax ignores a shift of all
        # scores), and Adam turns rounding noise in it into lr-sized steps of any sign.
        self.q, self.v = nn.Linear(width, width), nn.Linear(width, width)
        self.k = nn.Linear(width, width, bias=False)
        self.proj = nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = (f(h) for f in (self.q, self.k, self.v))
        # From q, not x: under sequence parallelism x holds this rank's positions only.
        # -1 heads: this rank's share of them under tensor parallelism, all of them alone.
        b, t, head = q.shape[0], q.shape[1], x.shape[-1] // self.n_head
        q, k, v = (z.view(b, t, -1, head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyLM(nn.Module):
    def __init__(
        self, width: int = WIDTH, n_head: int = HEADS, layers: int = LAYERS, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width, n_head, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# Megatron's split of a block: q, k, v and the MLP's first layer column-wise, the
# attention's output projection and the MLP's second layer row-wise. Norms, embedding
# and head stay whole on every tensor-parallel rank (FSDP2 shards them over dp only).
PLAN = {
    "blocks.*.q": ColwiseParallel(),
    "blocks.*.k": ColwiseParallel(),
    "blocks.*.v": ColwiseParallel(),
    "blocks.*.proj": RowwiseParallel(),
    "blocks.*.fc": ColwiseParallel(),
    "blocks.*.out": RowwiseParallel(),
}


# torchtitan's plan for Llama (parallelize.py, apply_tp), on these names: sequence
# parallel between the blocks' split layers (the residual stream and the norms hold this
# rank's positions; the norms' weights are replicated DTensors), the embedding row-wise
# into it, the head column-wise out of it to whole logits (no loss parallelism).
SEQUENCE_PLAN = {
    "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "blocks.*.ln1": SequenceParallel(),
    "blocks.*.q": ColwiseParallel(input_layouts=Shard(1)),
    "blocks.*.k": ColwiseParallel(input_layouts=Shard(1)),
    "blocks.*.v": ColwiseParallel(input_layouts=Shard(1)),
    "blocks.*.proj": RowwiseParallel(output_layouts=Shard(1)),
    "blocks.*.ln2": SequenceParallel(),
    "blocks.*.fc": ColwiseParallel(input_layouts=Shard(1)),
    "blocks.*.out": RowwiseParallel(output_layouts=Shard(1)),
    "ln": SequenceParallel(),
    "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}
PLANS = {"megatron": PLAN, "sequence": SEQUENCE_PLAN}


def loss_fn(apply: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = apply(x)
    # float32 under autocast, float64 in tests/tolerance.py's float64 run
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def plain(width: int = WIDTH, n_head: int = HEADS, dropout: float = 0.0) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(width, n_head, dropout=dropout)


def mesh_of(dp: int, tp: int) -> Any:
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))


def parallel(mesh: Any, plan: str = "megatron", compile: Any = None, **kwargs: Any) -> TinyLM:
    return parallelize(plain(**kwargs), mesh, PLANS[plan], blocks="blocks", compile=compile)


def global_batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(VOCAB, (ROWS, T + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def mine(batch: Any, mesh: Any) -> tuple[torch.Tensor, ...]:
    """This rank's rows: its data-parallel rank's half (tensor-parallel peers alike)."""
    dp = mesh["dp_shard"]
    return tuple(t.tensor_split(dp.size())[dp.get_local_rank()] for t in batch)


def compose(precision: str, distributed: bool, n: int = 2) -> fasttorch.Step:
    """with_amp (unless fp32), grad_accumulate, sync_on_last, clip_scaled, ema."""
    step = fasttorch.step(loss_fn)
    if precision != "fp32":
        step = fasttorch.with_amp(step, precision)  # type: ignore[arg-type]
    step = fasttorch.grad_accumulate(step, n)
    if distributed:
        step = sync_on_last(step, timeout=datetime.timedelta(seconds=120))
    return fasttorch.ema(fasttorch.clip_scaled(step, CLIP), 0.8)


def full(state: fasttorch.TrainState, tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from fasttorch.distributed.fsdp import as_dtensor

    like = dict(state.module.named_parameters())
    return {k: as_dtensor(t, like[k]).full_tensor() for k, t in tree.items()}


def _windows(data: list[Any], n: int) -> list[list[Any]]:
    return [list(zip(*(t.tensor_split(n) for t in b))) for b in data]


def half_roundings(tp: int) -> int:
    """Rule 4's count where the kernels round differently: each reduction tensor
    parallelism splits over ``tp`` ranks (a row-wise layer's output, a column-wise
    layer's input gradient: 2 + 2 per block) rounds ``tp`` partial sums to bf16 and
    then their sum, where one process rounds once: ``tp + 1`` roundings each."""
    return LAYERS * 4 * (tp + 1)


# AdamW in fp32. Under bf16 autocast plain SGD: tensor parallelism rounds its split sums
# otherwise than one process (half_roundings), and Adam's first step, lr * sign(g), flips
# by 2 lr wherever such a rounding moves a near-zero gradient across zero (measured: 2e-2
# on 30 of 33 tensors); SGD's update is linear in the gradient, at most lr * clip in size.
OPTS = {
    "fp32": (
        lambda: fasttorch.optim.adamw(LR),
        lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=1e-2),
    ),
    "bf16": (lambda: fasttorch.optim.sgd(LR), lambda p: torch.optim.SGD(p, lr=LR)),
}


def check_equals_single_process(
    rank: int, precision: str, mode: str, plan: str = "megatron"
) -> dict[str, Any]:
    """2 x 2 mesh, :data:`OPTS`, the composition of :func:`compose`, eager or compiled, against
    one process on the whole batch. fp32: rule 2 (the sums split across ranks, the
    microbatches grouped otherwise: 2 of 4 rows against 2 of 2 per rank). bf16: the
    same rows per microbatch (one process splits its 8 rows in 4, the ranks' own), and
    rule 4 with :func:`half_roundings` roundings that differ."""
    mesh = mesh_of(2, 2)
    half = precision != "fp32"
    data = global_batches(STEPS)
    n_ref = 4 if half else 2
    ref_step = compose(precision, False, n_ref)
    make_opt, torch_opt = OPTS[precision]
    ref = fasttorch.TrainState.create(plain(), make_opt())
    for b in data:
        ref, ref_m = ref_step(ref, b)
    step = compose(precision, True)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager", dynamic=False)
    # compiled: the blocks too, after the plan and before fully_shard (torchtitan's order)
    blocks = {"backend": "aot_eager", "fullgraph": True} if mode == "compiled" else None
    state = replicate(fasttorch.TrainState.create(parallel(mesh, plan, blocks), make_opt()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in data:
            state, m = step(state, mine(b, mesh))
    error = reference_error(
        plain(),
        _windows(data, n_ref),
        make_opt=torch_opt,
        loss_fn=loss_fn,
        clip=CLIP,
    )
    k = half_roundings(2) if half else 0
    u = unit_roundoff(DTYPES[precision]) if half else 0.0
    got, got_ema = full(state, state.params), full(state, state.substates["ema"].params)
    ref_ema = ref.substates["ema"].params
    loss = float(ref_m["loss"])
    return {
        "diff": max(float((got[n] - ref.params[n]).abs().max()) for n in got),
        "ema_diff": max(float((got_ema[n] - ref_ema[n]).abs().max()) for n in got),
        # rule 2 (+ rule 4 with k roundings): params_atol's half term is steps * lr * k * u
        # for an update at most lr in size (AdamW); SGD's is at most lr * CLIP (clipped)
        "bound": params_atol(
            error.params,
            ref.params,
            precision=precision,
            steps=STEPS,
            lr=LR * CLIP if half else LR,
            half_roundings=max(k, 1),
        ),
        "loss_diff": abs(float(m["loss"]) - loss),
        # loss_atol's rule with k roundings: FACTOR x the fp32 error, + 2u per rounding
        "loss_bound": FACTOR * max(error.loss, unit_roundoff(torch.float32) * loss)
        + 2 * k * u * loss,
        "norm": float(m["grad_norm"]),
        "ref_norm": float(ref_m["grad_norm"]),
        "norm_rel_diff": abs(float(m["grad_norm"]) / float(ref_m["grad_norm"]) - 1),
        "norm_bound": FACTOR * max(error.grad_norm, unit_roundoff(torch.float32)) + k * u,
        "steps": int(state.step),
        "warnings": sorted(
            {
                str(w.message)[:60]
                for w in caught
                if "fasttorch" in str(w.message) or "compiled" in str(w.message)
            }
        ),
        "peers_equal": _peers_equal(state, mesh),
    }


def _peers_equal(state: fasttorch.TrainState, mesh: Any) -> bool:
    """What the plan leaves whole (norms, embedding, head, row-wise biases; their
    moments and EMA) is equal, bitwise, on the two tensor-parallel peers holding it."""
    from fasttorch.distributed.fsdp import sharded_leaves

    shards, same = sharded_leaves(state), True
    for i, t in enumerate(pytree.tree_leaves(state)):
        like = shards.get(i)
        if like is None or (like.device_mesh.ndim == 2 and not like.placements[1].is_replicate()):
            continue
        got = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(got, t.contiguous(), group=mesh["tp"].get_group())
        same &= torch.equal(got[0], got[1])
    return same


def check_checkpoint(rank: int, out: Path) -> dict[str, Any]:
    """Save on 2 x 2 after K steps; resume on a fresh 2 x 2 (the same M steps, bitwise),
    and load on 1 x 4 and 4 x 1 (every leaf gathered whole equal to the saved one)."""
    step = compose("fp32", True)
    data = global_batches(K + M, seed=1)
    mesh = mesh_of(2, 2)
    state = step.init(
        replicate(fasttorch.TrainState.create(parallel(mesh), fasttorch.optim.adamw(LR)))
    )
    for b in data[:K]:
        state, _ = step(state, mine(b, mesh))
    checkpoint.save(out / "ck", state, data={"next": K}, name="tp")
    whole = gathered(state)
    if rank == 0:
        torch.save(whole, out / "at_save.pt")
    metrics = []
    for b in data[K:]:
        state, m = step(state, mine(b, mesh))
        metrics.append(pytree.tree_map(lambda t: t.detach().clone(), m))
    final = leaves(state)
    template = step.init(
        replicate(fasttorch.TrainState.create(parallel(mesh), fasttorch.optim.adamw(LR)))
    )
    resumed, got = checkpoint.load(out / "ck" / "tp", template, inplace=True)
    again = []
    for b in data[K:]:
        resumed, m = step(resumed, mine(b, mesh))
        again.append(m)
    after = leaves(resumed)
    res: dict[str, Any] = {
        "data": got,
        "leaves_equal": final.keys() == after.keys()
        and all(torch.equal(final[k], after[k]) for k in final),
        "metrics_equal": all(
            torch.equal(a, b)
            for ma, mb in zip(metrics, again, strict=True)
            for a, b in zip(pytree.tree_leaves(ma), pytree.tree_leaves(mb), strict=True)
        ),
    }
    for dp, tp in ((1, 4), (4, 1)):
        other = mesh_of(dp, tp)
        template = step.init(
            replicate(fasttorch.TrainState.create(parallel(other), fasttorch.optim.adamw(LR)))
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ranks that were not there keep their RNG
            loaded, _ = checkpoint.load(out / "ck" / "tp", template, inplace=True)
        now = gathered(loaded)
        # The RNGs are the saved ranks', whose tensor-parallel groups were others:
        # replicate gives one stream per data-parallel rank of this mesh again.
        res[f"{dp}x{tp}_streams"] = _streams(replicate(loaded).rng)
        res[f"{dp}x{tp}"] = sorted(
            k for k in whole if k != ".rng" and not torch.equal(now[k], whole[k])
        )
        res[f"{dp}x{tp}_compared"] = len([k for k in whole if k != ".rng"])
    return res


def check_dropout(rank: int) -> dict[str, bool]:
    """Dropout on the activations the tensor-parallel peers share: with replicate's
    streams (one per data-parallel rank) the peers' copies of what the plan leaves whole
    stay bitwise equal; with a stream per rank (data parallelism's) they drift apart."""
    mesh, step = mesh_of(2, 2), compose("fp32", True)
    out = {}
    for streams in ("data_parallel", "per_rank"):
        model = parallel(mesh, dropout=0.5)
        state = replicate(fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR)))
        if streams == "per_rank":
            state = state.replace(rng=initial_rng_state(state.device, 1_000 + rank))
        for b in global_batches(2, seed=2):
            state, _ = step(state, mine(b, mesh))
        out[streams] = _peers_equal(state, mesh)
    return out


def _streams(rng: torch.Tensor) -> int:
    """How many different RNG states the ranks hold."""
    got = [torch.empty_like(rng) for _ in range(dist.get_world_size())]
    dist.all_gather(got, rng)
    return len({bytes(t.tolist()) for t in got})


def check_errors(rank: int) -> dict[str, Any]:
    """Mistakes that raise on every rank before anything is sharded."""

    def error(fn: Any) -> str | None:
        try:
            fn()
        except (ValueError, TypeError) as e:
            return str(e)
        return None

    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    wide = mesh_of(1, 4)
    done = parallel(wide)
    state = fasttorch.TrainState.create(done, fasttorch.optim.adamw(LR))
    batch = mine(global_batches(1)[0], wide)
    return {
        "mesh_names": error(lambda: parallelize(plain(), flat, PLAN, blocks="blocks")),
        "no_module": error(
            lambda: parallelize(plain(), wide, {**PLAN, "blocks.*.qkv": ColwiseParallel()})
        ),
        "heads": error(lambda: parallel(wide, n_head=2)),
        "width": error(lambda: parallel(wide, width=18, n_head=2)),
        "blocks": error(lambda: parallelize(plain(), wide, PLAN, blocks="layers")),
        "not_a_style": error(lambda: parallelize(plain(), wide, {"blocks.*.q": "colwise"})),
        "compile_no_blocks": error(lambda: parallelize(plain(), wide, PLAN, compile={})),
        "twice": error(lambda: parallelize(done, wide, PLAN)),
        # the refusals of sharded states hold on a 2-D mesh too
        "across_calls": error(
            lambda: sync_on_last(
                fasttorch.grad_accumulate(fasttorch.step(loss_fn), 2, across_calls=True)
            )(state, batch)
        ),
        "no_sync_on_last": error(lambda: fasttorch.step(loss_fn)(state, batch)),
    }


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    join(rank, world, port, "cpu")
    out = Path(out_dir)
    checks = {
        "fp32_eager": lambda: check_equals_single_process(rank, "fp32", "eager"),
        "fp32_compiled": lambda: check_equals_single_process(rank, "fp32", "compiled"),
        "sequence_fp32_eager": lambda: check_equals_single_process(
            rank, "fp32", "eager", "sequence"
        ),
        "bf16_eager": lambda: check_equals_single_process(rank, "bf16", "eager"),
        "checkpoint": lambda: check_checkpoint(rank, out),
        "dropout": lambda: check_dropout(rank),
        "errors": lambda: check_errors(rank),
    }
    results = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    with open(out / f"rank{rank}.json", "w") as f:
        json.dump(results, f)
    leave()
