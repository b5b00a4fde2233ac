"""Compile time of a CPU update graph, by the form its arithmetic takes.

    python -m benchmarks.update_graph [--model M3] [--rounds 3]

A compiled step's update graph (unscale, clip, AdamW) costs most of its cold compile
in inductor's Python, per node, not in the C++ compiler. This measures, for the
parameter shapes of a benchmark model, what the same update costs to compile and to
run in several forms, each in a fresh process with an empty inductor cache (the
compiler's instruction-set probe runs before the clock starts):

- ``per-parameter``: fasttorch's own update code (window mean, ``global_norm``, the
  clip through ``scale_grads``, ``optim.adamw``'s ``update``, the copy into the
  state), which in a CPU graph writes AdamW one expression per tensor with its 0-d
  factors computed once;
- ``per-parameter-foreach``: the same update as ``_foreach`` calls with the 0-d
  factors inline, as fasttorch's CPU graph computed it before;
- ``per-parameter-lean``: the same arithmetic with fewer operations per element (the
  scalar factors computed once, ``lerp`` written out for a weight below 0.5);
- ``opaque-optimizer``: the same, with AdamW as one custom op that runs torch's eager
  ``_foreach`` kernels (inductor compiles only the norm and the clip);
- ``flat``: gradient and both moments as one flat buffer each, parameters separate;
- ``window-slices`` / ``window-cat``: not an update, the other half of a flat layout:
  adding each parameter's gradient into a flat window inside a graph, by in-place adds
  into slices of the window, or by one ``cat`` and one add.

Rounds are interleaved; the table gives medians. Only the ``per-parameter`` form is
what the library runs; the others are the measured alternatives (docs/design.md,
"Compile time").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

FORMS = (
    "per-parameter",
    "per-parameter-foreach",
    "per-parameter-lean",
    "opaque-optimizer",
    "flat",
    "window-slices",
    "window-cat",
)


_OPS: dict[str, Any] = {}


def _adamw(p, g, m, v, lr, beta1, beta2, eps, wd, t):  # type: ignore[no-untyped-def]
    """AdamW over lists of tensors, as fasttorch's CPU update graph writes it: the calls
    of ``torch.optim.AdamW(foreach=True, capturable=True)``, in its order."""
    t = t.to(torch.float32)
    step_size = beta1.pow(t).sub(1).div(lr.to(torch.float32)).reciprocal()
    bias_correction2_sqrt = beta2.pow(t).sub(1).neg().sqrt()
    torch._foreach_mul_(p, 1 - lr.to(torch.float32) * wd)
    torch._foreach_lerp_(m, g, [1 - beta1] * len(m))
    torch._foreach_mul_(v, beta2)
    scaled = torch._foreach_mul(g, 1 - beta2)
    torch._foreach_addcmul_(v, scaled, g)
    denom = list(torch._foreach_sqrt(v))
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, [eps] * len(denom))
    torch._foreach_div_(denom, step_size)
    torch._foreach_addcdiv_(p, m, denom)


def _adamw_op() -> Any:
    """``_adamw`` as one custom op: opaque to inductor, eager ``_foreach`` kernels inside."""
    if "adamw" not in _OPS:
        _OPS["adamw"] = torch.library.custom_op(
            "fasttorch_bench::adamw_",
            _adamw,
            mutates_args=("p", "m", "v"),
            schema="(Tensor(a!)[] p, Tensor[] g, Tensor(b!)[] m, Tensor(c!)[] v, Tensor lr, "
            "Tensor beta1, Tensor beta2, Tensor eps, Tensor wd, Tensor t) -> ()",
        )
        _OPS["adamw"].register_fake(lambda *args: None)
    return _OPS["adamw"]


def make_form(
    form: str, shapes: list[torch.Size]
) -> tuple[Callable[[], None], Callable[[], dict[str, torch.Tensor]]]:
    """``form``'s function over fresh seeded tensors, and what it leaves, flattened.

    Every update form starts from the same parameters, gradients and moments and
    leaves ``params``, ``exp_avg`` and ``exp_avg_sq`` (each one flat tensor); the window
    forms leave ``window``. The tests hold the forms to the same results.
    """
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; choose from {', '.join(FORMS)}")
    gen = torch.Generator().manual_seed(0)
    p = [torch.randn(s, generator=gen) for s in shapes]
    g = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
    m = [torch.zeros(s) for s in shapes]
    v = [torch.zeros(s) for s in shapes]
    h = {
        k: torch.tensor(x)
        for k, x in dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, total=2.0).items()
    }
    count = torch.tensor(0)

    def flat(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([x.reshape(-1) for x in ts])

    def hyper() -> tuple[torch.Tensor, ...]:
        count.add_(1)
        return (h["lr"], h["beta1"], h["beta2"], h["eps"], h["wd"], count.to(torch.float64))

    def clipped(g: list[torch.Tensor]) -> list[torch.Tensor]:
        g = list(torch._foreach_div(g, h["total"]))
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g]))
        return list(torch._foreach_mul(g, torch.clamp(1.0 / (norm + 1e-6), max=1.0)))

    def per_parameter_foreach() -> None:
        _adamw(p, clipped(g), m, v, *hyper())

    import fasttorch
    from fasttorch.steps import global_norm, scale_grads

    opt = fasttorch.optim.adamw(1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    names = [str(i) for i in range(len(shapes))]
    state = opt.init(dict(zip(names, p)))
    state = state.replace(slots={"exp_avg": dict(zip(names, m)), "exp_avg_sq": dict(zip(names, v))})

    def per_parameter() -> None:
        mean = {n: x / h["total"] for n, x in zip(names, g)}
        coef = torch.clamp(1.0 / (global_norm(mean) + 1e-6), max=1.0)
        new_p, new = opt.update(dict(zip(names, p)), scale_grads(mean, coef), state, count)
        torch._foreach_copy_(
            [*p, *m, *v, state.count],
            [
                *new_p.values(),
                *new.slots["exp_avg"].values(),
                *new.slots["exp_avg_sq"].values(),
                new.count,
            ],
        )

    def per_parameter_lean() -> None:
        lr, beta1, beta2, eps, wd, t = hyper()
        norm = torch.stack([(x * x).sum() for x in g]).sum().sqrt() / h["total"]
        scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0) / h["total"]
        step_size = (lr / (1 - beta1**t)).float()
        root = (1 - beta2**t).sqrt().float()
        for pi, gi, mi, vi in zip(p, g, m, v):
            gi = gi * scale
            mi.add_((1 - beta1) * (gi - mi))
            vi.mul_(beta2).add_((1 - beta2) * gi * gi)
            pi.mul_(1 - lr * wd).sub_(step_size * (mi / (vi.sqrt() / root + eps)))

    op = _adamw_op() if form == "opaque-optimizer" else None

    def opaque() -> None:
        op(p, clipped(g), m, v, *hyper())

    flat_g, flat_m, flat_v = flat(g), flat(m), flat(v)

    def flat_update() -> None:
        lr, beta1, beta2, eps, wd, t = hyper()
        gm = flat_g / h["total"]
        gm = gm * torch.clamp(1.0 / (torch.linalg.vector_norm(gm) + 1e-6), max=1.0)
        flat_m.lerp_(gm, 1 - beta1)
        flat_v.mul_(beta2).addcmul_(gm, gm, value=1 - beta2)
        u = flat_m / (flat_v.sqrt() / (1 - beta2**t).sqrt() + eps) * (lr / (1 - beta1**t))
        o = 0
        for x in p:
            n = x.numel()
            x.mul_(1 - lr * wd).sub_(u[o : o + n].view_as(x))
            o += n

    window = torch.zeros(sum(s.numel() for s in shapes))

    def window_slices() -> None:
        o = 0
        for x in g:
            n = x.numel()
            window[o : o + n].view(x.shape).add_(x)
            o += n

    def window_cat() -> None:
        window.add_(flat(g))

    if form.startswith("window"):
        return (window_slices if form == "window-slices" else window_cat), lambda: {
            "window": window.clone()
        }
    if form == "flat":
        return flat_update, lambda: {
            "params": flat(p),
            "exp_avg": flat_m.clone(),
            "exp_avg_sq": flat_v.clone(),
        }
    fn = {
        "per-parameter": per_parameter,
        "per-parameter-foreach": per_parameter_foreach,
        "per-parameter-lean": per_parameter_lean,
        "opaque-optimizer": opaque,
    }[form]
    return fn, lambda: {"params": flat(p), "exp_avg": flat(m), "exp_avg_sq": flat(v)}


def _measure(form: str, model: str) -> dict[str, float]:
    from torch._inductor import cpu_vec_isa

    from benchmarks.models import build

    cpu_vec_isa.valid_vec_isa_list()  # once per process and cache: not what is compared
    torch._inductor.config.max_fusion_buffer_group_pairwise_attempts = 4  # as `compiled`
    shapes = [p.shape for p in build(model, torch.device("cpu")).parameters()]
    fn = torch.compile(make_form(form, shapes)[0], fullgraph=True)
    t0 = time.perf_counter()
    fn()
    compile_s = time.perf_counter() - t0
    for _ in range(20):
        fn()
    blocks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        blocks.append((time.perf_counter() - t0) / 100 * 1e3)
    return {
        "compile_s": compile_s,
        "call_ms": statistics.median(blocks),
        "params": len(shapes),
        "numel": sum(s.numel() for s in shapes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="M3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_measure(args.worker, args.model)))
        return
    forms = args.forms.split(",")
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        ap.error(f"unknown form(s) {unknown}; choose from {', '.join(FORMS)}")
    runs: dict[str, list[dict[str, float]]] = {f: [] for f in forms}
    for _ in range(args.rounds):
        for form in forms:
            with tempfile.TemporaryDirectory(prefix="fasttorch-ug-") as cache:
                cmd = [sys.executable, "-m", "benchmarks.update_graph", "--worker", form]
                out = subprocess.run(
                    [*cmd, "--model", args.model],
                    capture_output=True,
                    text=True,
                    env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                    check=True,
                )
            runs[form].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = runs[forms[0]][0]
    print(
        f"{args.model}: {first['params']:g} parameters, {first['numel']:g} elements; "
        f"medians of {args.rounds} interleaved rounds, one fresh process and cache each"
    )
    print()
    print("| form | cold compile (s) | call (ms) |")
    print("|---|---|---|")
    for form in forms:
        c = statistics.median(r["compile_s"] for r in runs[form])
        t = statistics.median(r["call_ms"] for r in runs[form])
        print(f"| {form} | {c:.1f} | {t:.3f} |")


if __name__ == "__main__":
    main()
