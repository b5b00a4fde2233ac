"""Populations: n members in one vmapped, compiled step against n steps one after another.

For n = 1, 4, 16, 64 members of a small MLP and of the main job's character model
(examples/train_charlm.py's ``CharGPT``, small), three ways to train all members one
step each, timed in interleaved rounds (median of the rounds):

* ``vmapped``: ``compiled(vmapped(step(loss_fn), n))``, one call for all members;
* ``sequential``: one ``compiled(step(loss_fn))``, called once per member's state;
* ``hand``: n models and n ``torch.optim.AdamW``, the plain loop, once per member.

Throughput is member-steps per second (n x calls / seconds). Memory: the tensors each
way keeps (parameters, optimizer state, and for ``vmapped`` the stacked population),
counted exactly, and the peak: those plus the most bytes one call (all n members'
steps) holds allocated at once, from the profiler's allocator events (as
benchmarks/activation_checkpointing.py measures it); a CPU process's peak resident set
covers every run at once, so it is reported once. Writes its table to
docs/benchmarks_population.md::

    python -m benchmarks.population            # the full table (minutes: compiling)
    python -m benchmarks.population --smoke    # the machinery, in seconds
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import fasttorch
from benchmarks.activation_checkpointing import peak_bytes

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks_population.md"


@functools.cache
def _charlm() -> Any:
    path = ROOT / "examples" / "train_charlm.py"
    if str(path.parent) not in sys.path:  # it imports its neighbour example_utils
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("train_charlm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_charlm", module)
    spec.loader.exec_module(module)
    return module


class SmallMLP(nn.Module):
    """Two hidden layers of 32: the small-MLP member."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def _mse(apply: Callable[..., torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(apply(x), y)


def _xent(apply: Callable[..., torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(apply(x).flatten(0, 1).float(), y.flatten())


def models() -> dict[str, tuple[str, Callable[[], nn.Module], Callable[..., Any], Any]]:
    """name -> (description, make_model, loss_fn, batch)."""
    g = torch.Generator().manual_seed(0)
    mlp_batch = (torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g))
    vocab, block = 64, 32
    tokens = torch.randint(0, vocab, (8, block + 1), generator=g)

    def make_gpt() -> nn.Module:
        return _charlm().CharGPT(vocab, block, 1, 32, 2, 0.1, True)  # type: ignore[no-any-return]

    return {
        "mlp": ("MLP 16-32-32-4, batch 32", SmallMLP, _mse, mlp_batch),
        "charlm": (
            f"CharGPT (1 layer, n_embd 32, 2 heads, dropout 0.1), batch 8 x {block} tokens",
            make_gpt,
            _xent,
            (tokens[:, :-1], tokens[:, 1:]),
        ),
    }


def _tensor_bytes(tree: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class Runner:
    """One way to train n members: ``call()`` advances every member one step."""

    def __init__(self, kind: str, make: Callable[[], nn.Module], loss_fn: Any, batch: Any,
                 n: int, backend: str) -> None:  # fmt: skip
        self.kind, self.batch = kind, batch
        opt = fasttorch.optim.adamw(1e-3)
        pop = fasttorch.create_population(make, opt, n)

        def jit(step: Any) -> Any:
            return step if backend == "none" else fasttorch.compiled(step, backend=backend)

        if kind == "vmapped":
            self.step = jit(fasttorch.vmapped(fasttorch.step(loss_fn), n))
            self.states: list[Any] = [pop]
        elif kind == "sequential":
            self.step = jit(fasttorch.step(loss_fn))
            self.states = [fasttorch.member(pop, i) for i in range(n)]
        else:
            self.models = []
            for i in range(n):
                m = make()
                m.load_state_dict(fasttorch.member_state_dict(pop, i))
                self.models.append(m)
            self.opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in self.models]
            self.loss_fn = loss_fn
        start = time.perf_counter()
        self.call()  # compiles (vmapped, sequential) and creates the optimizer state
        self.first_s = time.perf_counter() - start

    def call(self) -> None:
        if self.kind == "hand":
            for m, o in zip(self.models, self.opts):
                self.loss_fn(m, self.batch).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            return
        self.states = [self.step(s, self.batch)[0] for s in self.states]

    def state_bytes(self) -> int:
        if self.kind == "hand":
            return _tensor_bytes([list(m.parameters()) for m in self.models]) + _tensor_bytes(
                [o.state_dict()["state"] for o in self.opts]
            )
        return _tensor_bytes(self.states)


def _rounds(runners: dict[str, Runner], rounds: int, calls: int) -> Iterator[tuple[str, float]]:
    """Interleaved: each round times every runner for ``calls`` calls, in turn."""
    for _ in range(rounds):
        for kind, r in runners.items():
            r.call()  # warm-up of this round
            start = time.perf_counter()
            for _ in range(calls):
                r.call()
            yield kind, (time.perf_counter() - start) / calls


def measure(model: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    _, make, loss_fn, batch = models()[model]
    torch.manual_seed(0)
    runners = {k: Runner(k, make, loss_fn, batch, n, args.backend) for k in args.kinds}
    times: dict[str, list[float]] = {k: [] for k in runners}
    for kind, seconds in _rounds(runners, args.rounds, args.calls):
        times[kind].append(seconds)
    out: dict[str, Any] = {"model": model, "n": n}
    for kind, r in runners.items():
        per_call = statistics.median(times[kind])
        out[kind] = {
            "member_steps_per_s": n / per_call,
            "first_call_s": r.first_s,
            "state_bytes": r.state_bytes(),
            "peak_bytes": r.state_bytes() + peak_bytes(r.call),
        }
    return out


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def render(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    rss = _peak_rss()
    lines = [
        "# Benchmarks: populations (vmapped)",
        "",
        "Written by `python -m benchmarks.population"
        + (" --smoke" if args.smoke else "")
        + "` (never edit by hand). Member-steps per second: n members each taking one",
        "optimizer step per call of the population, median over interleaved rounds.",
        "`vmapped`: `compiled(vmapped(step(loss_fn), n))`, one call for all members;",
        "`sequential`: one `compiled(step(loss_fn))` called once per member's state;",
        "`hand`: n models and n `torch.optim.AdamW` (foreach), the plain loop.",
        "State MiB: the tensors each keeps (parameters and optimizer state), counted;",
        "peak MiB: those plus the most one call (every member's step) holds allocated at once.",
        "",
        "## Conditions",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{torch.get_num_threads()} torch threads",
        f"- load average at the end: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
        "(the machine was shared with other work: ratios from one run, interleaved, "
        "mean more than absolute rates)",
        f"- backend: {args.backend}; {args.rounds} rounds x {args.calls} calls per runner",
        f"- process peak resident set (all runs together): {rss / 2**20:.0f} MiB",
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in results):
        desc = models()[model][0]
        lines += [f"## {model}: {desc}", ""]
        head = "| n |" + "".join(f" {k} member-steps/s |" for k in args.kinds)
        head += " vmapped / sequential | vmapped / hand |"
        head += "".join(f" {k} state MiB |" for k in args.kinds)
        head += "".join(f" {k} peak MiB |" for k in args.kinds)
        head += " vmapped first call s | sequential first call s |"
        lines += [head, "|" + " --- |" * (head.count("|") - 1)]
        for r in (r for r in results if r["model"] == model):
            rates = {k: r[k]["member_steps_per_s"] for k in args.kinds}
            row = f"| {r['n']} |" + "".join(f" {_fmt_rate(rates[k])} |" for k in args.kinds)
            row += (
                f" {_ratio(rates, 'vmapped', 'sequential')} | {_ratio(rates, 'vmapped', 'hand')} |"
            )
            row += "".join(f" {r[k]['state_bytes'] / 2**20:.2f} |" for k in args.kinds)
            row += "".join(f" {r[k]['peak_bytes'] / 2**20:.2f} |" for k in args.kinds)
            row += "".join(
                f" {r[k]['first_call_s']:.1f} |" if k in r else " – |"
                for k in ("vmapped", "sequential")
            )
            lines.append(row)
        lines.append("")
    lines += _target(results)
    return "\n".join(lines) + "\n"


def _ratio(rates: dict[str, float], a: str, b: str) -> str:
    return f"{rates[a] / rates[b]:.2f}x" if a in rates and b in rates else "–"


def _target(results: list[dict[str, Any]]) -> list[str]:
    hit = [r for r in results if r["model"] == "mlp" and r["n"] == 16]
    if not hit or "sequential" not in hit[0]:
        return ["Target (n = 16 small-MLP members >= 4x sequential compiled): not measured.", ""]
    r = hit[0]
    ratio = r["vmapped"]["member_steps_per_s"] / r["sequential"]["member_steps_per_s"]
    verdict = "met" if ratio >= 4 else "NOT met"
    return [
        f"Target (n = 16 small-MLP members >= 4x the member-steps/s of 16 sequential "
        f"compiled steps): {ratio:.2f}x, {verdict}.",
        "",
    ]


def _peak_rss() -> int:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,charlm")
    p.add_argument("--n", default="1,4,16,64", help="population sizes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=10, help="timed calls per runner per round")
    p.add_argument("--backend", default="inductor", help="torch.compile's; none: eager")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on shared, oversubscribed cores spinning OpenMP waiters "
        "slow every small op several-fold; see benchmarks/README.md)",
    )
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--smoke", action="store_true", help="tiny: n=1,2, MLP, eager")
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.n, args.rounds, args.calls, args.backend = "mlp", "1,2", 1, 2, "none"
    args.kinds = ["vmapped", "sequential", "hand"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    results = []
    for model in args.models.split(","):
        for n in (int(x) for x in args.n.split(",")):
            results.append(measure(model, n, args))
            r = results[-1]
            print(
                model,
                n,
                {k: round(r[k]["member_steps_per_s"], 1) for k in args.kinds},
                flush=True,
            )
            # Rewritten after each row: a long run stopped part-way keeps what it measured.
            args.out.write_text(render(results, args))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
