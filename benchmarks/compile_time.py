"""Compile time of the whole step against ``torch.compile(model)``: cold, warm, by depth.

    python -m benchmarks.compile_time               # rewrites docs/benchmarks_compile.md
    python -m benchmarks.compile_time --smoke       # tiny, aot_eager, the options at 2 layers only

On a GPU, the GPU command (``python -m benchmarks.gpu``, its last part) runs the same
processes with ``--device cuda``: GPT-2 124M's width, heads, context and vocabulary at
12 and 24 layers, 8 sequences a microbatch.

Every measurement is the first step of a fresh process with a fresh
``TORCHINDUCTOR_CACHE_DIR`` (cold), on the same GPT, batch and training step (bf16
autocast, 4 microbatches, clip to norm 1, AdamW):

* ``model``: the hand-written loop over ``torch.compile(model)`` (the backward compiles
  at the first ``backward``);
* ``step``: ``fasttorch.compiled`` of the whole step, no options (the default);
* ``kept`` (at the smaller depth): the same with ``cache_dir=`` a directory of its own,
  which traces the step ahead (``aot_compile``) to keep it there;
* ``warm``: ``step`` again in a new process with the ``kept`` run's ``cache_dir``
  (its own ``TORCHINDUCTOR_CACHE_DIR`` fresh): a restarted job;
* ``inductor_update``: ``step`` with ``adamw(..., opaque=False)``, the update generated
  by inductor for the model's tensors (the default before the opaque update was);
* ``regional`` (at the larger depth only): ``compiled(..., regions=True)``, each of the
  GPT's blocks a call of one ``torch.compiler.nested_compile_region``, traced and
  compiled once, with inductor's Python wrapper, since its C++ wrapper cannot call a
  subgraph (``NotImplementedError`` in torch 2.13's
  ``cpp_wrapper_cpu.codegen_invoke_subgraph``; 2.15's fails to compile a region called
  twice: ``_regions.inductor_options``); ``regions="auto"`` leaves it off on the
  CPU, and this row is the measurement behind that (docs/design.md).

The ``step`` process then compiles ``compiled(eval_step(step))`` and times its first
call (``eval_first``): an evaluation compiled after the training step.

Rows of older runs may hold ``opaque`` and ``regional_opaque`` (``adamw(...,
opaque=True)`` before it was the default, with the ``_foreach`` operator); the table
shows them under their own labels.

Within a round the processes run one after the other, depths interleaved (``model`` and
``step`` at each depth, then ``warm``), so load on the machine hits them alike; the
table shows per-round ratios' medians. Dynamo's share of each first step (tracing
fasttorch's and the model's Python) comes from ``_compat.compile_phase_seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ACCUM = 4


def _sizes(smoke: bool, device: str) -> tuple[int, int, int, int, int]:
    """Vocabulary, context, width, heads and sequences per microbatch."""
    if device == "cuda" and not smoke:
        return 50304, 1024, 768, 12, 8  # GPT-2 124M's (benchmarks.models' M3)
    return 128, 16 if smoke else 32, 32 if smoke else 64, 4, 4


def _gpt(layers: int, smoke: bool, device: str = "cpu") -> Any:
    from benchmarks.models import GPT

    vocab, context, width, heads, _ = _sizes(smoke, device)
    return GPT(vocab=vocab, context=context, layers=layers, width=width, heads=heads).to(device)


def _batches(smoke: bool, n: int, device: str = "cpu") -> list[Any]:
    import torch

    vocab, context, _, _, micro = _sizes(smoke, device)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        seq = torch.randint(0, vocab, (ACCUM * micro, context + 1), generator=g).to(device)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _loss(apply: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    x, y = batch
    logits = apply(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _model_loop(model: Any, backend: str, device: str = "cpu") -> Any:
    """The hand-written loop over ``torch.compile(model)``: one call = one step."""
    import torch

    fast = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def run(batch: Any) -> None:
        for x, y in zip(batch[0].chunk(ACCUM), batch[1].chunk(ACCUM), strict=True):
            with torch.autocast(device, torch.bfloat16):
                loss = _loss(fast, (x, y)) / ACCUM
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def _fasttorch_step(
    model: Any,
    backend: str,
    cache: str | None,
    regional: bool = False,
    opaque: bool = True,
    inductor: dict[str, Any] | None = None,
) -> Any:
    import fasttorch

    opt = fasttorch.optim.adamw(1e-3, weight_decay=0.01, opaque=opaque)
    state = [fasttorch.TrainState.create(model, opt)]
    step = _train_step()
    kwargs: dict[str, Any] = {"cache_dir": cache} if backend == "inductor" else {}
    if inductor and backend == "inductor":
        kwargs["options"] = inductor
    fast = fasttorch.compiled(step, backend=backend, regions=regional, **kwargs)

    def run(batch: Any) -> None:
        state[0], _ = fast(state[0], batch)

    run.state = state  # type: ignore[attr-defined]
    return run


def _train_step() -> Any:
    """The step every option compiles: bf16 autocast, 4 microbatches, clip to norm 1."""
    import fasttorch

    inner = fasttorch.with_amp(fasttorch.step(_loss), "bf16")
    return fasttorch.clip_scaled(fasttorch.grad_accumulate(inner, ACCUM), 1.0)


def _eval_first(run: Any, backend: str, batch: Any, device: str) -> float:
    """The first call of ``compiled(eval_step(step))`` on ``run``'s state, seconds."""
    import torch

    import fasttorch
    from fasttorch.evaluation import eval_step

    evaluate = fasttorch.compiled(eval_step(_train_step()), backend=backend)
    t0 = time.perf_counter()
    metrics = evaluate(run.state[0], batch)
    float(metrics["loss"])
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def child(
    kind: str, layers: int, smoke: bool, cache: str | None, device: str = "cpu"
) -> dict[str, Any]:
    """One process's measurement: first step (compile) and median steady step, seconds."""
    import torch

    from fasttorch import _compat

    torch.manual_seed(0)
    backend = "aot_eager" if smoke else "inductor"
    model = _gpt(layers, smoke, device)
    if kind == "model":
        run = _model_loop(model, backend, device)
    else:
        regional, opaque = kind == "regional", kind != "inductor_update"
        kept = cache if kind in ("kept", "warm") else None  # the default: no cache_dir
        run = _fasttorch_step(model, backend, kept, regional=regional, opaque=opaque)
    data = _batches(smoke, 2 if smoke else 4, device)

    def timed(batch: Any) -> float:
        t0 = time.perf_counter()
        run(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with _compat.inductor_graph_seconds() as graphs:
        first = timed(data[0])
    steady = [timed(b) for b in data[1:]]
    evaluated = {}
    if kind == "step":
        evaluated["eval_first"] = _eval_first(run, backend, data[0], device)
    return {
        "first": first,
        "step": statistics.median(steady),
        **evaluated,
        "graphs": graphs,
        **_compat.compile_phase_seconds(),
        **_compat.inductor_cache_counts(),
    }


def spawn(
    kind: str,
    layers: int,
    smoke: bool,
    cache: str | None,
    own: str,
    device: str = "cpu",
    timeout: float | None = None,
) -> dict[str, Any]:
    """One measurement in a new process (:func:`child`'s numbers), its inductor caches
    in ``own``; ``cache``: the step's ``cache_dir``. Raises if the process fails."""
    # One torch thread and passive OpenMP waits: on shared cores a spinning thread
    # stalls every kernel, and compile time is single-threaded Python and C++ builds.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": own, "PYTHONPATH": str(ROOT)}
    env |= {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child", kind]
    cmd += ["--layers", str(layers), "--cache", cache or "", "--device", device]
    cmd += ["--smoke"] if smoke else []
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, check=False, cwd=ROOT, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {layers} layers failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def measure(depths: tuple[int, int], rounds: int, smoke: bool) -> list[dict[str, Any]]:
    """Every round's runs: ``{"round", "kind", "layers", ...child's numbers}``."""
    rows = []
    for r in range(rounds):
        with tempfile.TemporaryDirectory(prefix="fasttorch-compile-bench-") as tmp:
            caches = {}
            for layers in depths:
                kinds: tuple[str, ...] = ("model", "step", "inductor_update")
                if smoke and layers == depths[0]:  # the machinery, once per kind
                    kinds = ("model", "step")
                elif layers == depths[0] and not smoke:
                    kinds += ("kept",)
                kinds += ("regional",) if layers == depths[1] else ()
                for kind in kinds:
                    cache = os.path.join(tmp, f"cache-{kind}-{layers}")
                    if kind == "kept":  # the one the warm run starts from
                        caches[layers] = cache
                    own = os.path.join(tmp, f"own-{kind}-{layers}")
                    res = spawn(kind, layers, smoke, cache, own)
                    rows.append({"round": r, "kind": kind, "layers": layers, **res})
                    print(json.dumps(rows[-1]), flush=True)
            if smoke:  # aot_eager keeps no compiled code: a warm run would be a cold one
                continue
            own = os.path.join(tmp, "own-warm")
            res = spawn("warm", depths[0], smoke, caches[depths[0]], own)
            rows.append({"round": r, "kind": "warm", "layers": depths[0], **res})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict[str, Any]], depths: tuple[int, int]) -> str:
    """The Markdown table: per-kind medians, then the ratios (medians of per-round ratios)."""

    def get(kind: str, layers: int, key: str) -> list[float]:
        return [x[key] for x in rows if x["kind"] == kind and x["layers"] == layers and key in x]

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.1f}" if xs else "–"

    lo, hi = depths
    lines = [
        "| run | layers | first step (s) | dynamo (s) | backend (s) "
        "| FX graphs generated / loaded | inductor per graph (s) [FX nodes] "
        "| steady step (ms) |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for kind, label in (
        ("model", "`torch.compile(model)`"),
        ("step", "`fasttorch.compiled`"),
        ("kept", "`fasttorch.compiled(..., cache_dir=...)`, cold (traced ahead, kept)"),
        ("warm", "`fasttorch.compiled`, warm"),
        ("inductor_update", "`fasttorch.compiled`, `adamw(..., opaque=False)`"),
        ("regional", "`fasttorch.compiled(..., regions=True)`"),
        ("opaque", "`fasttorch.compiled`, `adamw(..., opaque=True)` (older: `_foreach` operator)"),
        ("regional_opaque", "`fasttorch.compiled(..., regions=True)`, `opaque=True` (older)"),
    ):
        for layers in depths:
            if not get(kind, layers, "first"):
                continue
            lines.append(
                f"| {label} | {layers} | {med(get(kind, layers, 'first'))} | "
                f"{med(get(kind, layers, 'dynamo'))} | {med(get(kind, layers, 'backend'))} | "
                f"{med(get(kind, layers, 'miss'))} / {med(get(kind, layers, 'hit'))} | "
                f"{_per_graph(get(kind, layers, 'graphs'))} | "
                f"{statistics.median(get(kind, layers, 'step')) * 1e3:.1f} |"
            )

    def ratio(a: tuple[str, int], b: tuple[str, int], key: str = "first", over: str = "") -> str:
        """Per-round ``a``'s ``key`` over ``b``'s ``over`` (by default the same key)."""
        over = over or key
        if not get(*a, key) or not get(*b, over):  # type: ignore[arg-type]
            return "not measured"
        xs = [
            x / y
            for x, y in zip(get(*a, key), get(*b, over), strict=True)  # type: ignore[arg-type]
        ]
        return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"

    compile_model = "whole step / `torch.compile(model)`"
    growth = ratio(("model", hi), ("model", lo))
    growth_target = f"<= {growth.split()[0]}" if growth != "not measured" else ""
    lines += [
        "",
        "| ratio (median [min-max] over rounds) | measured | target | verdict |",
        "|---|---:|---:|---|",
        f"| cold compile, {compile_model}, {lo} layers "
        f"| {ratio(('step', lo), ('model', lo))} | <= 1.3 |",
        f"| cold compile, {compile_model}, {hi} layers "
        f"| {ratio(('step', hi), ('model', hi))} | <= 1.3 |",
        f"| cold compile, whole step, {hi} / {lo} layers "
        f"| {ratio(('step', hi), ('step', lo))} | {growth_target} |",
        f"| cold compile, `torch.compile(model)`, {hi} / {lo} layers | {growth} | |",
        f"| warm start (s), {lo} layers, new process, `cache_dir` "
        f"| {med(get('warm', lo, 'first'))} | <= 3 |",
    ]
    for layers in depths:
        lines.append(
            f"| `compiled(eval_step(step))`'s first call after the step's / the step's, "
            f"{layers} layers | {ratio(('step', layers), ('step', layers), 'eval_first', 'first')} "
            "| <= 0.5 |"
        )
    lines.append(
        f"| cold compile, `cache_dir=` / `torch.compile(model)`, {lo} layers "
        f"| {ratio(('kept', lo), ('model', lo))} | |"
    )
    for layers in depths:
        lines.append(
            f"| cold compile, `opaque=False` / `torch.compile(model)`, {layers} layers "
            f"| {ratio(('inductor_update', layers), ('model', layers))} | |"
        )
    lines.append(
        f"| cold compile, blocks as one region / whole step, {hi} layers "
        f"| {ratio(('regional', hi), ('step', hi))} | |"
    )
    return "\n".join(_with_verdicts(lines))


def _with_verdicts(lines: list[str]) -> list[str]:
    """The ratio table's rows with a verdict column: "met" or "not met" where the row
    has a target (``<= x``) and a measurement, else empty.

    >>> _with_verdicts(["| a | 1.20 [1.1-1.3] | <= 1.3 |", "| b | 2.0 | |"])
    ['| a | 1.20 [1.1-1.3] | <= 1.3 | met |', '| b | 2.0 | | |']
    """
    out = []
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 3 or not line.startswith("| ") or cells[1] == "measured":
            out.append(line)
            continue
        verdict = ""
        if cells[2].startswith("<= ") and cells[1] not in ("not measured", "–"):
            verdict = "met" if float(cells[1].split()[0]) <= float(cells[2][3:]) else "not met"
        out.append(f"{line} {verdict} |" if verdict else f"{line} |")
    return out


def _per_graph(runs: list[Any]) -> str:
    """The first round's graphs, in the order inductor finished them ("–" for none)."""
    graphs = runs[0] if runs else []
    return " + ".join(f"{s:.1f} [{n}]" for s, n in graphs) or "–"


def page_head(
    title: str,
    module: str,
    machine: str,
    options: str | list[str],
    args: argparse.Namespace,
    wall: float,
) -> list[str]:
    """A benchmark page's heading: title, the do-not-edit line, date, machine, torch and
    the command (``module`` run with ``options``; a list: one command per run whose rows
    the page shows). For a page rewritten from a run's rows (``args.from_json``): the
    rows' date, and no load average or wall time."""
    import torch

    cpu = platform.processor() or platform.machine()
    # The run's date: for a document rewritten from a run's rows, when they were written.
    when = Path(args.from_json).stat().st_mtime if args.from_json else time.time()
    return [
        f"# {title}",
        "",
        f"<!-- Written by `python -m benchmarks.{module}`; do not edit by hand. -->",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(when))}",
        f"- machine: {cpu}; {os.cpu_count()} logical CPUs visible; no GPU; {machine}"
        + ("" if args.from_json else f"; load average when written {os.getloadavg()[0]:.1f}"),
        f"- torch {torch.__version__}; Python {platform.python_version()}",
        ("- command: " if isinstance(options, str) or len(options) == 1 else "- commands: ")
        + "; ".join(
            f"`python -m benchmarks.{module}{' --smoke' if args.smoke else ''} {o}`"
            for o in ([options] if isinstance(options, str) else options)
        )
        + (
            "; this page rewritten from its rows"
            if args.from_json
            else f"; wall time {wall / 60:.1f} min"
        ),
    ]


def write(path: Path, body: str, args: argparse.Namespace, wall: float) -> None:
    machine = (
        "shared with other work while it ran (compile times are noisy; the ratios, taken "
        "within a round, less so); each run with OMP_NUM_THREADS=1, OMP_WAIT_POLICY=PASSIVE"
    )
    options = f"--rounds {args.rounds} --layers {args.layers}"
    head = [
        *page_head("Benchmarks: compile time", "compile_time", machine, options, args, wall),
        "",
        "Each run is a fresh process with a fresh `TORCHINDUCTOR_CACHE_DIR` (cold; it "
        "includes inductor's one-time probe of the C++ compiler's vector instruction "
        "sets), training a GPT (width 64, 4 heads, context 32, vocab 128) on 16 sequences "
        "a step as 4 microbatches under bf16 autocast, clipped to norm 1, with AdamW. "
        "`torch.compile(model)`: the hand-written loop over the compiled model. "
        "`fasttorch.compiled`: the whole step (forward, backward, accumulation, clip, "
        "AdamW), no options: on the CPU one graph, the microbatch's (its C++ wrapper built "
        "at `-Og`), and AdamW's update outside it; `cache_dir=`: the same with a directory "
        "to keep it in, which traces it ahead (`aot_compile`) and feeds the warm run. "
        "Regional (the larger depth only): the same step with "
        "`compiled(..., regions=True)`, each of the GPT's blocks a call of one "
        "`torch.compiler.nested_compile_region`, with inductor's Python wrapper (its C++ "
        'wrapper cannot call a subgraph); on the CPU `regions="auto"` leaves it off '
        '(docs/design.md, "Recompiles, warm starts, regional compilation"). '
        "The whole step's AdamW update is torch's fused CPU kernel, run outside the "
        'graphs (the default, `opaque=True`: docs/optimizers.md, "Opaque update"); '
        "`opaque=False`: the same step with the update traced and generated by inductor "
        "in a graph of its own, the default before. The `eval_step` rows: "
        "`compiled(eval_step(step))`'s first call, in the whole step's process after its "
        "steps. Warm: the "
        "same step in a new process given the first "
        'one\'s `cache_dir` (docs/transforms.md, "Warm starts"): it loads the traced '
        "step the first process kept there, so dynamo does not run. First step: the first "
        "call's wall time, compile included; dynamo: tracing time in it "
        "(`compile_inner` and, for a step traced to be kept, `fullgraph_capture`, minus the "
        "backend); backend: AOT autograd and inductor inside "
        "dynamo (the model's backward compiles outside it, at the first `backward`); "
        "inductor per graph: each graph's lowering, scheduling, code generation and C++ "
        "build, in the order they were done (the model's forward, then its backward; the "
        "step's microbatch graph, then, traced, its update graph), with the graph's FX nodes, in "
        "the first round.",
        "",
    ]
    if args.smoke:
        head.append('Smoke run: tiny sizes and `backend="aot_eager"`; the numbers mean nothing.\n')
    path.write_text("\n".join(head) + "\n" + body + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--child", choices=("model", "step", "kept", "warm", "inductor_update", "regional")
    )
    p.add_argument("--layers", default="12,24")
    p.add_argument("--cache", default="")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)  # for a --child
    p.add_argument("--json")
    p.add_argument("--from-json", help="rewrite the document from a run's --json rows")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks_compile.md"))
    args = p.parse_args()
    if args.child:
        res = child(args.child, int(args.layers), args.smoke, args.cache or None, args.device)
        print(json.dumps(res))
        return
    lo, hi = (int(x) for x in args.layers.split(","))
    if args.smoke:
        lo, hi = min(lo, 1), min(hi, 2)
    t0 = time.perf_counter()
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
    else:
        rows = measure((lo, hi), args.rounds, args.smoke)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    write(Path(args.out), table(rows, (lo, hi)), args, time.perf_counter() - t0)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
