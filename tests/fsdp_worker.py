"""Checks run inside each rank of a 2-process gloo group over states sharded with FSDP2
(tests/test_fsdp.py). Every composition is compared with the same composition run by
one process on the whole global batch, from the same weights, on a plain module.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from dist_kit import join, leave
from reference import LayerNormNet, adam_twin, mse
from tolerance import (
    fp32_reference_error,
    grad_norm_rtol,
    loss_atol,
    params_atol,
    reference_error,
)

import fasttorch
from fasttorch import _compat
from fasttorch.distributed import replicate, sync_on_last
from fasttorch.distributed.fsdp import as_dtensor, sharded_leaves

STEPS = 4
LR = 1e-2
ROWS = (16, 13)  # rank 0 and rank 1 shards of a 29-row batch: 8+8 and 7+6 microbatch rows
EQUAL = (16, 16)  # under autocast (see check_equals_single_process)


def global_batches(steps, rows=ROWS, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(rows)
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)) for _ in range(steps)]


def shard(batch, rank, rows=ROWS):
    lo = sum(rows[:rank])
    return tuple(t[lo : lo + rows[rank]] for t in batch)


def plain_model(width=32):
    torch.manual_seed(0)
    return LayerNormNet(width=width)


class Block(torch.nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = torch.nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class BlockNet(torch.nn.Module):
    """Two blocks of the user's own code (what torchtitan compiles one by one)."""

    def __init__(self, width=32):
        super().__init__()
        self.inp, self.hidden, self.out = Block(8, width), Block(width, width), Block(width, 4)

    def forward(self, x):
        return self.out(self.hidden(self.inp(x)))


def block_model(width=32):
    torch.manual_seed(0)
    return BlockNet(width)


def sharded_model(width=32, compile_blocks=False, **kwargs):
    m = block_model(width) if compile_blocks else plain_model(width)
    if compile_blocks:  # as torchtitan does: each block compiled, then sharded
        m.inp.compile(backend="aot_eager", fullgraph=True)
        m.hidden.compile(backend="aot_eager", fullgraph=True)
    fully_shard(m.inp, **kwargs)
    fully_shard(m.hidden, **kwargs)
    fully_shard(m, **kwargs)  # the root: norm and out
    return m


def full(state, tree):
    """``tree``'s shards of ``state`` gathered whole (a dict of full tensors)."""
    like = {k: p for k, p in state.module.named_parameters()}
    return {k: as_dtensor(t, like[k]).full_tensor() for k, t in tree.items()}


OPTS = {
    "adamw": (
        lambda: fasttorch.optim.adamw(LR),
        # its torch twin (capturable foreach, float32 bias corrections), whose own error
        # is rule 2's measure for it
        adam_twin(torch.optim.AdamW, LR, weight_decay=1e-2),
    ),
    "sgd": (
        lambda: fasttorch.optim.sgd(LR, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True),
    ),
    "torch_adamw": (
        lambda: fasttorch.optim.from_torch(torch.optim.AdamW, lr=LR),
        lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=1e-2),
    ),
}


def compose(kind, distributed, n=2):
    """The composition ``kind``; with ``sync_on_last`` when ``distributed``."""
    step = fasttorch.step(mse)
    if kind in PRECISION:
        step = fasttorch.with_amp(step, PRECISION[kind])
    if kind != "plain":
        step = fasttorch.grad_accumulate(step, n)
    if distributed:
        step = sync_on_last(step, timeout=datetime.timedelta(seconds=60))
    if kind != "plain":
        step = fasttorch.clip_scaled(step, 0.5)
    if kind == "nonfinite":
        step = fasttorch.skip_nonfinite(step)
    if kind == "ema":
        step = fasttorch.ema(step, 0.8)
    return step


PRECISION = {"amp_bf16": "bf16", "amp_fp16": "fp16"}


_ONE_PROCESS: dict = {}


def _one_process(kind, opt, make_model, compiled):
    """The one process's run of ``kind`` on the whole global batch (its state and last
    metrics) and the fp32 loop's own error against float64 (rule 2, and 4 under
    autocast), for the model ``make_model`` builds. Made once per rank, eagerly, and
    shared by the eager and the compiled sharded runs; compiled only for a compiled run
    of torch's own optimizer (``from_torch``), which then runs torch's capturable kernel,
    another kernel than the eager one (tests/test_optim_torch.py)."""
    compiled = compiled and opt == "torch_adamw"
    key = (kind, opt, make_model, compiled)
    if key not in _ONE_PROCESS:
        make_opt, torch_opt = OPTS[opt]
        half = kind in PRECISION
        data = global_batches(STEPS, EQUAL if half else ROWS)
        ref_step = compose(kind, False, n=4 if half else 2)
        if compiled:
            ref_step = fasttorch.compiled(ref_step, backend="aot_eager", dynamic=False)
        ref = fasttorch.TrainState.create(make_model(), make_opt())
        for b in data:
            ref, ref_m = ref_step(ref, b)
        error = reference_error(
            make_model(),
            [list(zip(*(t.tensor_split(2) for t in b))) for b in data],
            make_opt=torch_opt,
            clip=0.5,
        )
        _ONE_PROCESS[key] = (ref, ref_m, error)
    return _ONE_PROCESS[key]


def check_equals_single_process(rank, kind, mode, opt="adamw"):
    """A sharded run, eager or compiled (``mode``), == one process on the whole global
    batch (:func:`_one_process`: eagerly, but for torch's own optimizer compiled; that
    one process, eager and compiled, equals the hand-written loop in
    tests/test_equivalence.py).

    In fp32 the ranks' shards differ in size (16 and 14 rows of 30), and the one
    process splits its batch in 2 microbatches: the same mathematics in another order
    (rule 2). Under autocast a different grouping of rows, or backward seeds that are
    not powers of two apart, round differently in bf16/fp16 everywhere, not only where
    rule 4 lets a rounding flip. So there the shards are equal (16 and 16) and the one
    process splits its 32 rows into 4 microbatches, the ranks' own: the same autocast
    kernels on the same rows with seeds a power of two apart.
    """
    make_opt, _ = OPTS[opt]
    rows = EQUAL if kind in PRECISION else ROWS
    data = global_batches(STEPS, rows)
    step = compose(kind, True)
    if mode.startswith("compiled"):
        step = fasttorch.compiled(step, backend="aot_eager", dynamic=False)
    make_model = block_model if mode == "compiled_blocks" else plain_model
    ref, ref_m, error = _one_process(kind, opt, make_model, mode.startswith("compiled"))
    model = sharded_model(compile_blocks=mode == "compiled_blocks")
    state = replicate(fasttorch.TrainState.create(model, make_opt()))
    for b in data:
        state, m = step(state, shard(b, rank, rows))
    precision = PRECISION.get(kind, "fp32")
    bound = params_atol(error.params, ref.params, precision=precision, steps=STEPS, lr=LR)
    mine = full(state, state.params)
    out = {
        "diff": max(float((mine[k] - ref.params[k]).abs().max()) for k in ref.params),
        "bound": bound,
        "loss_diff": abs(float(m["loss"]) - float(ref_m["loss"])),
        "loss_bound": loss_atol(error, ref_m["loss"], precision),
        "norm_rel_diff": abs(float(m["grad_norm"]) / float(ref_m["grad_norm"]) - 1),
        "norm_bound": grad_norm_rtol(error, precision),
        "steps": int(state.step),
    }
    if kind == "ema":
        ema_full = full(state, state.substates["ema"].params)
        ref_ema = ref.substates["ema"].params
        out["ema_diff"] = max(float((ema_full[k] - ref_ema[k]).abs().max()) for k in ref_ema)
    if kind == "amp_fp16":
        out["scale"] = float(state.substates["amp"].scale)
        out["ref_scale"] = float(ref.substates["amp"].scale)
    return out


def check_mixed_precision_policy(rank):
    """FSDP2's own bf16 MixedPrecisionPolicy against the plain FSDP2 loop with the same
    policy (equal shards, so both average the same way)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    data = global_batches(STEPS, EQUAL)

    def half(b):
        return shard(b, rank, EQUAL)

    hand = sharded_model(mp_policy=policy)
    opt = torch.optim.AdamW(hand.parameters(), lr=LR, weight_decay=1e-2, foreach=True)
    for b in data:
        x, y = half(b)
        for i, (xm, ym) in enumerate(zip(x.tensor_split(2), y.tensor_split(2))):
            hand.set_requires_gradient_sync(i == 1)
            (torch.nn.functional.mse_loss(hand(xm).float(), ym) / 2).backward()
        torch.nn.utils.clip_grad_norm_(hand.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step = fasttorch.clip_scaled(
        sync_on_last(fasttorch.grad_accumulate(fasttorch.step(mse), 2)), 0.5
    )
    state = replicate(
        fasttorch.TrainState.create(sharded_model(mp_policy=policy), OPTS["adamw"][0]())
    )
    for b in data:
        state, _ = step(state, half(b))
    mine = full(state, state.params)
    theirs = {k: p.full_tensor() for k, p in hand.named_parameters()}
    errors = fp32_reference_error(
        plain_model(),
        [list(zip(*(t.tensor_split(2) for t in b))) for b in data],
        make_opt=OPTS["adamw"][1],
        clip=0.5,
    )
    return {
        "diff": max(float((mine[k] - theirs[k]).abs().max()) for k in theirs),
        "bound": params_atol(errors, theirs, precision="bf16", steps=STEPS, lr=LR),
    }


def state_bytes(state):
    leaves = pytree.tree_leaves((state.params, state.opt_state))
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def check_memory(rank):
    """Per-rank parameter + optimizer-state bytes: sharded against replicated."""
    width = 256
    replicated = replicate(
        fasttorch.TrainState.create(plain_model(width), fasttorch.optim.adamw(LR))
    )
    sharded = fasttorch.TrainState.create(sharded_model(width), fasttorch.optim.adamw(LR))
    mine, whole = state_bytes(sharded), state_bytes(replicated)
    # FSDP2 gives rank r rows [r * ceil(d0 / R), ...) of each parameter's dim 0.
    world = dist.get_world_size()
    expected = 0
    for p in replicated.params.values():
        rows = -(-p.shape[0] // world)
        mine_rows = max(0, min(rows, p.shape[0] - rank * rows))
        expected += mine_rows * (p.numel() // p.shape[0]) * p.element_size()
    scalars = state_bytes(sharded) - 3 * sum(  # adamw: the shard, exp_avg, exp_avg_sq
        t.numel() * t.element_size() for t in sharded.params.values()
    )
    return {
        "sharded_bytes": mine,
        "replicated_bytes": whole,
        "ratio": mine / whole,
        "expected_shard_bytes": 3 * expected,
        "shard_bytes": mine - scalars,
        "sharded_leaves": len(sharded_leaves(sharded)),
        "n_params": len(sharded.params),
    }


def check_overflow_on_one_rank(rank):
    """An inf on rank 1 only: both ranks skip, keep their shards, agree on the scale."""
    out = {}
    for kind in ("amp_fp16", "nonfinite"):
        step = compose(kind, True)
        state = replicate(fasttorch.TrainState.create(sharded_model(), fasttorch.optim.adamw(LR)))
        state = step.init(state)
        b = shard(global_batches(1)[0], rank)
        if rank == 1:
            b = (b[0] * float("inf"), b[1])
        before = [t.clone() for t in pytree.tree_leaves((state.params, state.opt_state))]
        state, m = step(state, b)
        after = pytree.tree_leaves((state.params, state.opt_state))
        res = {
            "skipped": bool(m["skipped"]),
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
        }
        if kind == "amp_fp16":
            scales = [torch.zeros(()) for _ in range(2)]
            dist.all_gather(scales, state.substates["amp"].scale)
            res["scales"] = [float(s) for s in scales]
        out[kind] = res
    return out


def check_collectives(rank):
    """Per window of 3 microbatches: one reduce-scatter per FSDP unit (on the last
    microbatch), fasttorch's own two all-reduces (first weight, counts), and the
    all-gathers: once per window for the units FSDP2 keeps gathered from forward to
    backward (``reshard_after_forward=False``, and the root), twice per microbatch
    (forward, backward) for the others. Both layouts train bit for bit alike."""
    # FSDP2 reduce-scatters and all-gathers through dist.*_single (torch 2.13) or
    # dist.*_tensor (earlier releases): count whichever exist.
    kinds = {"all_reduce": ("all_reduce",), "reduce_scatter": RS_NAMES, "all_gather": AG_NAMES}
    names = [n for ns in kinds.values() for n in ns if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    calls = dict.fromkeys(names, 0)

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    step = sync_on_last(fasttorch.grad_accumulate(fasttorch.step(mse), 3))
    out = {"units": 3, "n": 3}
    states = {}
    for layout, kwargs in (("default", {}), ("kept", {"reshard_after_forward": False})):
        model = sharded_model(**kwargs)  # FSDP2's default: the root is not resharded
        state = replicate(fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR)))
        per_window = []
        for n in names:
            setattr(dist, n, counting(n))
        try:
            for b in global_batches(3):
                for k in calls:
                    calls[k] = 0
                state, _ = step(state, shard(b, rank))
                per_window.append({k: sum(calls.get(n, 0) for n in ns) for k, ns in kinds.items()})
        finally:
            for n in names:
                setattr(dist, n, originals[n])
        out[layout] = per_window
        states[layout] = state
    out["same_params"] = all(
        torch.equal(states["default"].params[k], states["kept"].params[k])
        for k in states["default"].params
    )
    return out


AG_NAMES = ("all_gather_single", "all_gather_into_tensor")
RS_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")


def check_no_recompiles(rank):
    """Compiled: one graph (the update traced, ``opaque=False``), no recompile as lr,
    scale and step change; the eager forward and backward said once. With the default
    (torch's fused kernel on a CPU) no graph: the update runs outside too."""
    _compat.dynamo_reset()
    counters = _compat.dynamo_counters()
    counters.clear()
    step = fasttorch.compiled(
        fasttorch.clip_scaled(
            sync_on_last(
                fasttorch.grad_accumulate(fasttorch.with_amp(fasttorch.step(mse), "fp16"), 2)
            ),
            1.0,
        ),
        backend="aot_eager",
    )
    schedule = fasttorch.schedules.cosine(LR, 10)
    traced = fasttorch.optim.adamw(schedule, opaque=False)  # the update in a graph
    state = replicate(fasttorch.TrainState.create(sharded_model(), traced))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in global_batches(5):
            state, _ = step(state, shard(b, rank))
    graphs = counters["stats"]["unique_graphs"]
    # The default AdamW on a CPU: torch's fused kernel, outside any graph.
    fused = replicate(fasttorch.TrainState.create(sharded_model(), fasttorch.optim.adamw(schedule)))
    for b in global_batches(3):
        fused, _ = step(fused, shard(b, rank))
    return {
        "warnings": [str(w.message) for w in caught if "FSDP2" in str(w.message)],
        "recompiles": sum(counters["recompiles"].values()),
        "graph_breaks": len(counters["graph_break"]),
        "graphs": graphs,
        "fused_graphs": counters["stats"]["unique_graphs"] - graphs,
        "fused_count": int(fused.opt_state.count),
    }


def check_errors(rank):
    """Mistakes that are errors on every rank before any collective (no hang)."""
    b = shard(global_batches(1)[0], rank)

    def error(step, state):
        try:
            step(state, b)
        except (ValueError, TypeError) as e:
            return str(e)
        return None

    def new():
        return fasttorch.TrainState.create(sharded_model(), fasttorch.optim.adamw(LR))

    out = {
        "no_sync_on_last": error(fasttorch.step(mse), new()),
        "donate_false": error(sync_on_last(fasttorch.step(mse, donate=False)), new()),
        "across_calls": error(
            sync_on_last(fasttorch.grad_accumulate(fasttorch.step(mse), 2, across_calls=True)),
            new(),
        ),
    }
    m = plain_model()
    fully_shard(m.inp)
    fully_shard(m.hidden)
    out["root_not_sharded"] = error(
        sync_on_last(fasttorch.step(mse)), fasttorch.TrainState.create(m, fasttorch.optim.adamw(LR))
    )
    s = new()  # new tensors, not the module's shards (a load without inplace=True)
    out["not_module_storage"] = error(
        sync_on_last(fasttorch.step(mse)),
        s.replace(params={k: v.clone() for k, v in s.params.items()}),
    )
    return out


def check_eval_and_apply(rank):
    """eval_step and state.apply on a sharded state run the module over its shards."""
    state = replicate(fasttorch.TrainState.create(sharded_model(), fasttorch.optim.adamw(LR)))
    step = sync_on_last(fasttorch.step(mse))
    data = global_batches(3)
    for b in data[:2]:
        state, _ = step(state, shard(b, rank))
    plain = plain_model()
    plain.load_state_dict(full(state, state.params))
    x, y = data[2]
    leaves = len(sharded_leaves(state))
    got = fasttorch.eval_step(fasttorch.step(mse))(state, (x, y))["loss"]
    # A forward with no backward leaves FSDP2's root unsharded; the module must hold
    # the state's shards again after each of these (no full copy kept, nothing missed).
    resharded = [all(isinstance(p, DTensor) for p in state.module.parameters())]
    fn = fasttorch.compiled(fasttorch.eval_step(fasttorch.step(mse)), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_got = fn(state, (x, y))["loss"]
    resharded.append(all(isinstance(p, DTensor) for p in state.module.parameters()))
    apply_diff = float((state.apply(x) - plain(x)).abs().max())
    resharded.append(all(isinstance(p, DTensor) for p in state.module.parameters()))
    with torch.no_grad():  # the user's own forward (sampling): the next step reshards
        state.module(x)
    leaves_after = len(sharded_leaves(state))
    # Training goes on after all this exactly as it would have without it.
    state, _ = step(state, shard(data[2], rank))
    other = replicate(fasttorch.TrainState.create(sharded_model(), fasttorch.optim.adamw(LR)))
    for b in data:
        other, _ = step(other, shard(b, rank))
    return {
        "compiled_eval_equal": bool(torch.equal(compiled_got, got)),
        "compiled_eval_warned": any("runs eagerly" in str(w.message) for w in caught),
        "eval_diff": abs(float(got) - float(mse(plain, (x, y)))),
        "apply_diff": apply_diff,
        "bound": 4 * torch.finfo(torch.float32).eps * float(mse(plain, (x, y))),
        "resharded": resharded,
        "leaves": [leaves, leaves_after],
        "then_trains_the_same": all(
            torch.equal(state.params[k], other.params[k]) for k in state.params
        ),
    }


class TwoHeads(torch.nn.Module):
    """A body and two heads, of which the loss uses ``used`` only (on every rank)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.used = torch.nn.Linear(8, 4)
        self.never = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.used(torch.tanh(self.body(x)))


def _fsdp2_loop(model, windows, make_opt):
    """The plain FSDP2 loop: ``fully_shard`` + torch.optim, accumulating without sync."""
    fully_shard(model)
    opt = make_opt(model.parameters())
    for window in windows:
        for i, (x, y) in enumerate(window):
            model.set_requires_gradient_sync(i == len(window) - 1)
            (torch.nn.functional.mse_loss(model(x), y) / len(window)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: p.full_tensor().detach() for k, p in model.named_parameters()}


def check_unused_parameters(rank):
    """A parameter no rank uses keeps its value, momentum and decay: FSDP2 leaves its
    .grad None and torch.optim skips it; so does a sharded sync_on_last step."""
    opts = {
        "sgd": (
            lambda: fasttorch.optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
        ),
        "adamw": (
            lambda: fasttorch.optim.adamw(LR, weight_decay=0.1),
            lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.1),
        ),
    }
    data = global_batches(3, EQUAL)
    mine = [shard(b, rank, EQUAL) for b in data]
    windows = [list(zip(*(t.tensor_split(2) for t in b))) for b in mine]
    out = {}
    for opt_name, (make_opt, torch_opt) in opts.items():
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            model = TwoHeads()
            init = {k: p.detach().clone() for k, p in model.named_parameters()}
            ref = _fsdp2_loop(copy.deepcopy(model), windows, torch_opt)
            windows64 = [[tuple(t.double() for t in m) for m in w] for w in windows]
            ref64 = _fsdp2_loop(copy.deepcopy(model).double(), windows64, torch_opt)
            errors = {k: float((ref[k].double() - ref64[k]).abs().max()) for k in ref}
            step = sync_on_last(fasttorch.grad_accumulate(fasttorch.step(mse), 2))
            if mode == "compiled":
                step = fasttorch.compiled(step, backend="aot_eager", dynamic=False)
            mine_model = copy.deepcopy(model)
            fully_shard(mine_model)
            state = fasttorch.TrainState.create(mine_model, make_opt())
            for b in mine:
                state, _ = step(state, b)
            got = full(state, state.params)
            never = ("never.weight", "never.bias")
            out[f"{opt_name}_{mode}"] = {
                "diff": max(float((got[k] - ref[k]).abs().max()) for k in ref),
                "bound": params_atol(errors, ref),
                "never_kept": all(torch.equal(got[k], init[k]) for k in never),
                "fsdp2_never_kept": all(torch.equal(ref[k], init[k]) for k in never),
            }
    return out


CHECKS = {
    "no_recompiles": check_no_recompiles,  # first: the once-only warning is still to come
    **{
        f"{kind}_{mode}": (lambda r, k=kind, md=mode: check_equals_single_process(r, k, md))
        for kind in ("plain", "accum", "amp_bf16", "amp_fp16", "nonfinite", "ema")
        for mode in ("eager", "compiled")
    },
    **{
        f"{opt}_{mode}": (lambda r, o=opt, md=mode: check_equals_single_process(r, "accum", md, o))
        for opt in ("sgd", "torch_adamw")
        for mode in ("eager", "compiled")
    },
    "accum_compiled_blocks": lambda r: check_equals_single_process(r, "accum", "compiled_blocks"),
    "mixed_precision_policy": check_mixed_precision_policy,
    "memory": check_memory,
    "overflow": check_overflow_on_one_rank,
    "collectives": check_collectives,
    "errors": check_errors,
    "eval": check_eval_and_apply,
    "unused": check_unused_parameters,
}


def check_cuda(rank, world, device_type="cuda"):
    """On GPUs with NCCL (a GPU per rank): fp32 and bf16 compositions against one
    process on the whole batch on the same device, and an fp16 overflow on the last
    rank skipped by all."""
    device = torch.device(device_type, rank if device_type == "cuda" else None)
    rows = (16,) * world
    out = {}
    # bf16 eagerly: a compiled one process would run inductor's forward and backward
    # kernels, which round differently from the sharded step's eager ones everywhere.
    for kind, mode in (("accum", "compiled"), ("amp_bf16", "eager")):
        data = [tuple(t.to(device) for t in b) for b in global_batches(STEPS, rows)]
        ref_step, step = compose(kind, False, n=2 * world), compose(kind, True)
        if mode == "compiled":
            ref_step = fasttorch.compiled(ref_step)
            step = fasttorch.compiled(step)
        ref = fasttorch.TrainState.create(plain_model().to(device), OPTS["adamw"][0]())
        for b in data:
            ref, _ = ref_step(ref, b)
        m = plain_model().to(device)
        fully_shard(m.inp)
        fully_shard(m.hidden)
        fully_shard(m)
        state = replicate(fasttorch.TrainState.create(m, OPTS["adamw"][0]()))
        for b in data:
            state, _ = step(state, shard(b, rank, rows))
        error = reference_error(
            plain_model(),
            [list(zip(*(t.cpu().tensor_split(2 * world) for t in b))) for b in data],
            make_opt=OPTS["adamw"][1],
            clip=0.5,
        )
        mine = full(state, state.params)
        out[kind] = {
            "diff": max(float((mine[k] - ref.params[k]).abs().max()) for k in ref.params),
            "bound": params_atol(
                error.params, ref.params, precision=PRECISION.get(kind, "fp32"), steps=STEPS, lr=LR
            ),
        }
    step = compose("amp_fp16", True)
    m = plain_model().to(device)
    fully_shard(m)
    state = step.init(replicate(fasttorch.TrainState.create(m, OPTS["adamw"][0]())))
    x, y = (t.to(device) for t in shard(global_batches(1, rows)[0], rank, rows))
    if rank == world - 1:
        x = x * float("inf")
    state, metrics = step(state, (x, y))
    out["overflow_skipped"] = bool(metrics["skipped"])
    out["scale"] = float(state.substates["amp"].scale)
    return out


def run_cuda(rank, world, port, out_dir):
    """The CUDA checks in a NCCL group of ``world`` ranks (tests/test_fsdp.py)."""
    join(rank, world, port, "cuda")
    try:
        result = check_cuda(rank, world)
    except Exception:
        result = {"exception": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    leave()


def run(rank, world, port, out_dir):
    join(rank, world, port, "cpu")
    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(rank)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    leave()
