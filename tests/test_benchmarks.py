"""The benchmark suite's machinery: its statistics, and that the one command runs.

Nothing here is a performance claim: the smoke run's numbers mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerance import gamma

from benchmarks.stats import drifted_rounds, payback_steps, per_step, schedule, summarize

ROOT = Path(__file__).resolve().parent.parent
# Python float arithmetic on decimal literals (rule 3 in float64): each literal and each
# operation rounds once, fewer than 16 times in any expression compared here.
F64 = {"rel": gamma(16, torch.float64), "abs": 0.0}


def test_rounds_interleave_every_variant():
    order = schedule(["B0", "F0", "F1"], 3)
    assert [v for _, v in order] == ["B0", "F0", "F1"] * 3
    assert [r for r, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_schedule_rejects_bad_input():
    with pytest.raises(ValueError, match="rounds"):
        schedule(["B0"], 0)
    with pytest.raises(ValueError, match="distinct"):
        schedule(["B0", "B0"], 3)


def test_time_per_step_is_the_median_block():
    # One slow block (a hiccup) does not move the median.
    assert per_step([2.0, 2.1, 1.9, 9.0, 2.0], 100) == pytest.approx(0.02, **F64)
    assert per_step([1.0, 3.0], 10) == pytest.approx(0.2, **F64)  # even count: mean of middle two
    with pytest.raises(ValueError):
        per_step([], 100)


def test_drift_rule_discards_only_rounds_past_the_limit():
    base = {0: 1.00, 1: 1.04, 2: 0.97, 3: 1.06, 4: 0.90}
    # low median over 5 values: 1.00; 1.06 is 6% away, 0.90 is 10%: both dropped
    out = drifted_rounds(base, tol=0.05)
    assert sorted(out) == [3, 4]
    assert out[4] == pytest.approx(0.10, **F64)
    assert drifted_rounds({0: 1.0, 1: 1.049}, tol=0.05) == {}  # within the limit: kept


def test_drift_rule_always_keeps_a_round():
    out = drifted_rounds({0: 1.0, 1: 2.0}, tol=0.05)
    assert len(out) == 1


def test_summary_uses_per_round_ratios_over_kept_rounds():
    times = {
        "B0": {0: 0.10, 1: 0.20, 2: 0.10},
        "F1": {0: 0.05, 1: 0.05, 2: 0.04},
    }
    s = summarize(times, "B0", keep=[0, 2])
    assert s["F1"].rounds == 2
    assert s["F1"].ratio_to_baseline == pytest.approx((2.0 + 2.5) / 2, **F64)
    assert (s["F1"].ratio_min, s["F1"].ratio_max) == pytest.approx((2.0, 2.5), **F64)
    assert s["B0"].ratio_to_baseline == 1.0
    assert s["F1"].seconds_per_step == pytest.approx(0.045, **F64)


def test_payback():
    assert payback_steps(10.0, 0.01, 0.02) == pytest.approx(1000.0, **F64)
    assert payback_steps(10.0, 0.03, 0.02) is None  # slower per step: never pays


def _suite(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.run ARGS`` in a subprocess; its exit status checked."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (proc.returncode == 0) == ok, proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One ``benchmarks.run --smoke`` for the tests below (a run costs half a minute):
    the document it wrote and the results it saved with ``--json``."""
    where = tmp_path_factory.mktemp("smoke")
    out, raw = where / "benchmarks.md", where / "raw.json"
    _suite("--smoke", "--out", str(out), "--json", str(raw))
    return out, raw


def test_smoke_run_writes_the_document(smoke_run):
    out, _ = smoke_run
    text = out.read_text()
    assert "torch " in text and "date:" in text
    assert "| B0 |" in text and "| F0 |" in text
    assert "not run: no GPU" in text or "GPU:" in text


DISTRIBUTED = [
    "DDP no_sync",
    "fasttorch reducer",
    "fasttorch reducer, compiled",
    "FSDP2 loop, reshard=False",
    "fasttorch FSDP2, reshard=True",
    "fasttorch FSDP2, reshard=False",
    "fasttorch FSDP2, reshard=True, compiled",
    "fasttorch FSDP2, reshard=False, compiled",
    "fasttorch FSDP2, reshard=False, compiled + blocks compiled",
]


def test_distributed_smoke_run_measures_every_variant(tmp_path):
    """``python -m benchmarks.distributed --smoke``: 2 gloo ranks, every variant timed,
    compared and counted. Whether the variants are equivalent is tests/test_fsdp.py's and
    tests/test_distributed.py's business (bounds from tests/tolerance.py); here only that
    each one trained the same model, sharded as its name says."""
    out, raw = tmp_path / "distributed.md", tmp_path / "distributed.json"
    args = ["--smoke", "--out", str(out), "--json", str(raw)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.distributed", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res, text = json.loads(raw.read_text()), out.read_text()
    assert list(res["times"]) == DISTRIBUTED
    for name in DISTRIBUTED:
        assert f"| {name} |" in text
        assert all(t > 0 for t in res["times"][name]), name
        # A variant that did not train, or trained another model, is as far from DDP as
        # DDP's own two AdamW steps moved it (or NaN): correct ones differ by rounding.
        assert res["diffs"][name] < res["moved"], (name, res["diffs"][name], res["moved"])
    assert "## Conclusion" in text and "target >= 1.0x" in text
    from benchmarks.distributed import SMOKE, make_model

    model = make_model(SMOKE["width"], SMOKE["depth"])
    assert all(p.shape[0] % 2 == 0 for p in model.parameters())  # FSDP2 halves each
    # fp32 parameters and AdamW's two moments: 12 bytes per parameter, replicated; the
    # rest of a state is its scalars (step counters, lr, betas), the same on every rank.
    whole = 12 * sum(p.numel() for p in model.parameters())
    size = {name: [b[name] for b in res["state_bytes"]] for name in DISTRIBUTED}
    scalars = {
        "torch": size["DDP no_sync"][0] - whole,
        "fasttorch": size[DISTRIBUTED[1]][0] - whole,
    }
    assert 0 < scalars["torch"] < 0.05 * whole and 0 < scalars["fasttorch"] < 0.05 * whole
    calls = res["collectives"]
    units = 3  # --smoke: the input block, 1 hidden block, the root
    for name in DISTRIBUTED:
        sharded = "FSDP2" in name
        own = scalars["fasttorch" if name.startswith("fasttorch") else "torch"]
        assert size[name] == [whole // (2 if sharded else 1) + own] * 2, (name, size[name])
        if sharded:
            # No gradient sync but on the last microbatch: one reduce-scatter per unit.
            # With reshard_after_forward=False the units stay gathered across the 4
            # microbatches: one all-gather each per step. With True FSDP2 gathers each
            # unit (the root included: it was sharded with True explicitly) for every
            # microbatch's forward and again for its backward.
            gathers = 2 * units * 4 if "reshard=True" in name else units
            assert calls[name]["RS"] == units, (name, calls[name])
            assert calls[name]["AG"] == gathers, (name, calls[name])
        else:
            assert calls[name]["AG"] == calls[name]["RS"] == 0, (name, calls[name])


def test_stats_doctests():
    import doctest

    import benchmarks.stats

    result = doctest.testmod(benchmarks.stats, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_a_missed_speedup_quotes_the_bound_from_extern_kernels():
    from benchmarks.run import targets
    from benchmarks.stats import Summary
    from benchmarks.worker import _is_extern

    assert _is_extern("aten::mm") and _is_extern("aten::_scaled_dot_product_flash_attention")
    assert _is_extern("aten::convolution_backward") and not _is_extern("aten::add_")

    def analysis(f1_speedup: float, share: float) -> dict:
        return {
            "summary": {
                "B0": Summary(1.0, 1.0, 1.0, 1.0, 3),
                "F1": Summary(1 / f1_speedup, f1_speedup, f1_speedup, f1_speedup, 3),
            },
            "figures": {"B0": {"extern": share}, "F1": {}},
        }

    rows = {
        name: (got, verdict)
        for name, got, verdict in targets(
            [
                {"model": "M3", "precision": "bf16", "analysis": analysis(1.05, 0.8)},
                {"model": "M1", "precision": "bf16", "analysis": analysis(2.5, 0.5)},
            ],
            gpu=False,
        )
    }
    got, verdict = rows["M3: F1 >= 1.2x B0"]
    assert (
        verdict == "**missed**" and got == "1.05 (bound 1.25: 80% of B0 is matmul/conv/attention)"
    )
    assert rows["M1: F1 >= 2.0x B0"] == ("2.50", "met")  # no bound quoted when met


def test_from_json_rewrites_the_document_without_running(smoke_run, tmp_path):
    """--json saves what --from-json needs; the second writes the same tables."""
    (out, raw), again = smoke_run, tmp_path / "b.md"
    proc = _suite("--smoke", "--out", str(again), "--from-json", str(raw))
    assert "M1 bf16 on" not in proc.stdout, "nothing ran"
    first, second = out.read_text(), again.read_text()
    assert "nothing was re-run" in second and "nothing was re-run" not in first
    drop = [ln for ln in second.splitlines() if "nothing was re-run" not in ln]
    assert drop == first.splitlines()
    (tmp_path / "bad.json").write_text("[]")
    proc = _suite("--from-json", str(tmp_path / "bad.json"), ok=False)
    assert "not a results file" in proc.stderr


FAKE_WORKER = """
import json, sys, time
name, log = sys.argv[1], sys.argv[2]
if name == "BAD":
    print("boom", file=sys.stderr)
    sys.exit(3)
print("a line of the variant's own output")
print("@@READY@@", flush=True)
blocks = []
for line in sys.stdin:
    if line.strip() == "block":
        if name == "HANG":
            time.sleep(60)
        with open(log, "a") as f:
            f.write(name + "\\n")
        blocks.append(0.01)
        print("@@BLOCK@@ 0.01", flush=True)
    elif line.strip() == "done":
        break
print("@@RESULT@@ " + json.dumps({"variant": name, "blocks_s": blocks}), flush=True)
"""


def test_a_rounds_blocks_take_turns_and_failures_are_reported(tmp_path, monkeypatch):
    from benchmarks import run

    fake, log = tmp_path / "fake_worker.py", tmp_path / "order.txt"
    fake.write_text(FAKE_WORKER)
    monkeypatch.setattr(
        run, "worker_cmd", lambda args, m, v, p, d: [sys.executable, str(fake), v, str(log)]
    )
    args = run.parse(["--blocks", "3", "--gap", "0", "--timeout", "3"])
    variants = ["A", "BAD", "B", "HANG", "C"]
    out = run.run_round(args, "M1", variants, "bf16", "cpu", dict.fromkeys(variants, tmp_path), 1)
    assert list(out) == variants
    assert log.read_text().split() == ["A", "B", "C"] * 3
    for v in "ABC":
        assert out[v]["blocks_s"] == [0.01] * 3 and "error" not in out[v]
    assert "exited 3" in out["BAD"]["error"] and "boom" in out["BAD"]["error"]
    assert "timed out after 3 s" in out["HANG"]["error"]


def test_the_isa_probe_of_cold_compiles_is_reported():
    from benchmarks.run import analyse

    def res(v: str, r: int, probe: float) -> dict:
        out = {"blocks_s": [1.0] * 5, "steps_per_block": 100, "cold": r == 0}
        if v != "B0":
            out.update(compile_s=40.0 + probe, isa_probe_s=probe)
        return out

    runs = {
        r: {v: res(v, r, p) for v, p in (("B0", 0.0), ("B1", 8.0), ("F1", 10.0 if r else 9.0))}
        for r in range(3)
    }
    a = analyse({"runs": runs})
    assert a["isa_probe_s"] == 8.5  # round 0's (cold) probes only
    assert a["figures"]["F1"]["cold_s"] == 49.0


def test_update_graph_forms_compute_the_same_update():
    """benchmarks.update_graph compares forms of one update: they must agree (eagerly here).

    The per-tensor forms run the same kernels in the same order as each other and give
    the same bits; the lean and flat forms sum the norm in another order, so they agree
    within Higham's bound for that sum. The clip is active (the gradient's norm is above 1).
    """
    import torch

    from benchmarks.update_graph import FORMS, make_form

    shapes = [torch.Size([512, 256]), torch.Size([256]), torch.Size([3, 5, 2])]
    out, start = {}, {}
    for form in FORMS:
        fn, result = make_form(form, shapes)
        start[form] = before = result()
        fn()
        out[form] = result()
        assert any(not torch.equal(before[k], out[form][k]) for k in before), form
    ref = out["per-parameter"]
    # Rule 3: two orders of the norm's sum of n squares give clip coefficients apart by
    # at most 2 gamma(n) relative; exp_avg is linear in the clipped gradient, exp_avg_sq
    # quadratic, and the step m / sqrt(v) moves by both, relative to its own size. The
    # lean form's fewer operations per element round up to gamma(4) differently.
    n = sum(s.numel() for s in shapes)
    delta = 2 * gamma(n)
    step = float((ref["params"] - start["per-parameter"]["params"]).abs().max())
    bound = {
        "params": {"rtol": gamma(4), "atol": 2 * delta * step},
        "exp_avg": {"rtol": delta + gamma(4), "atol": 0.0},
        "exp_avg_sq": {"rtol": 2 * delta + gamma(4), "atol": 0.0},
    }
    for k in ("params", "exp_avg", "exp_avg_sq"):
        assert torch.equal(out["per-parameter-foreach"][k], ref[k])
        assert torch.equal(out["opaque-optimizer"][k], ref[k])
        for form in ("per-parameter-lean", "flat"):
            torch.testing.assert_close(out[form][k], ref[k], **bound[k])
    gen = torch.Generator().manual_seed(0)
    [torch.randn(s, generator=gen) for s in shapes]  # the parameters come first
    grads = torch.cat([(torch.randn(s, generator=gen) * 1e-2).reshape(-1) for s in shapes])
    assert torch.linalg.vector_norm(grads / 2.0) > 1.5  # the window's mean: clipped
    assert torch.equal(out["window-slices"]["window"], grads)
    assert torch.equal(out["window-cat"]["window"], grads)
    with pytest.raises(ValueError, match="unknown form"):
        make_form("fused", shapes)


def test_gpu_targets_compare_m4_bf16_f1_with_the_fp32_hand_loop():
    """The ResNet target crosses precisions: bf16 F1 against the fp32 B0 loop."""
    from benchmarks.run import targets
    from benchmarks.stats import Summary

    def block(prec: str, seconds: dict[str, float], alloc: dict[str, float]) -> dict:
        return {
            "model": "M4",
            "precision": prec,
            "analysis": {
                "summary": {v: Summary(s, 1.0, 1.0, 1.0, 3) for v, s in seconds.items()},
                "figures": {v: {"alloc_mb": a} for v, a in alloc.items()},
            },
        }

    results = [
        block("fp32", {"B0": 3.0}, {"B0": 100.0}),
        block("bf16", {"B0": 2.0, "F1": 1.0}, {"B0": 60.0, "F1": 40.0}),
    ]
    rows = {name: (got, verdict) for name, got, verdict in targets(results, gpu=True)}
    assert rows["M4: bf16 F1 >= 2.5x fp32 B0"] == ("3.00", "met")
    assert rows["M4: bf16 F1 peak <= 0.5x fp32 B0"] == ("2.50", "met")
    assert rows["M3 (GPT-2 124M): F1 >= 1.6x B0"] == ("not run", "–")


def test_m4_is_a_channels_last_resnet_and_its_steps_agree_on_cpu(two_threads):
    """M4's CPU size trains one window in F0 and in the hand loop, on channels_last
    tensors. The window's loss is taken before the update, from the same forward; the
    two only sum the four microbatch means differently (a few additions). On two
    threads (conftest's ``two_threads``: one corrupts the heap on torch 2.13)."""
    from benchmarks import models, variants

    device = torch.device("cpu")
    window = models.windows("M4", device, n=1)[0]
    assert window[0].is_contiguous(memory_format=torch.channels_last)
    model = models.build("M4", device)
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert sum(isinstance(m, models.Bottleneck) for m in model.modules()) == 16
    losses = [float(variants.make(v, "M4", "fp32", device).step(window)) for v in ("B0", "F0")]
    # Rule 3: a mean of 4 positive losses (3 additions, 1 division) is within gamma(4)
    # relative of the exact mean in any order; two orders, twice that.
    assert losses[0] == pytest.approx(losses[1], rel=2 * gamma(4), abs=0)


def test_compile_time_table_ratios_are_per_round_medians():
    from benchmarks.compile_time import table

    def row(r, kind, layers, first):
        x = {"round": r, "kind": kind, "layers": layers, "first": first, "step": 0.01}
        return {**x, "dynamo": 1.0, "backend": 2.0, "hit": 0, "miss": 2}

    rows = [
        {**row(0, "model", 2, 10), "graphs": [[3.3, 100], [1.0, 50]]},
        *(row(0, k, n, f) for k, n, f in [("step", 2, 20), ("model", 4, 12)]),
        *(row(0, k, n, f) for k, n, f in [("step", 4, 22), ("warm", 2, 3)]),
        *(row(1, k, n, f) for k, n, f in [("model", 2, 10), ("step", 2, 10), ("model", 4, 12)]),
        *(row(1, k, n, f) for k, n, f in [("step", 4, 11), ("warm", 2, 4)]),
    ]
    text = table(rows, (2, 4))
    # step/model at 2 layers: rounds 2.0 and 1.0 -> median 1.5; 4/2 layers: 1.1 and 1.1.
    assert (
        "| cold compile, whole step / `torch.compile(model)`, 2 layers | 1.50 [1.00-2.00] |" in text
    )
    assert "| cold compile, whole step, 4 / 2 layers | 1.10 [1.10-1.10] |" in text
    assert "| warm start (s), 2 layers, new process, `cache_dir` | 3.5 |" in text
    # Per graph: the first round's, in order; none recorded (older rows, aot_eager): "–".
    model = "| `torch.compile(model)` | 2 | 10.0 | 1.0 | 2.0 | 2.0 / 0.0 |"
    assert f"{model} 3.3 [100] + 1.0 [50] |" in text
    assert "| `fasttorch.compiled` | 2 | 15.0 | 1.0 | 2.0 | 2.0 / 0.0 | – |" in text


def test_the_per_graph_timer_sees_each_graph_inductor_compiles_and_lets_go():
    """``_compat.inductor_graph_seconds``, behind the benchmark's per-graph column: one
    entry per graph inductor builds in the block (its FX nodes, its seconds), and
    nothing recorded after the block."""
    import random

    from fasttorch import _compat

    torch.compiler.reset()
    shift = random.random()  # a constant of its own: no graph from inductor's cache

    def f(x):
        return torch.relu(x * 2 + shift)

    with _compat.inductor_graph_seconds() as graphs:
        torch.compile(f)(torch.randn(8))
    assert len(graphs) == 1
    seconds, nodes = graphs[0]
    assert seconds > 0 and nodes >= 4  # placeholder, mul, add, relu, output
    torch.compile(lambda x: x - shift)(torch.randn(8))
    assert len(graphs) == 1


def test_compile_time_smoke_run_writes_the_document(tmp_path):
    """``python -m benchmarks.compile_time --smoke``: every run measured, table written.

    No warm run: the smoke run's ``aot_eager`` keeps no compiled code to start from."""
    out, raw = tmp_path / "compile.md", tmp_path / "raw.json"
    more = ["--json", str(raw)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compile_time", "--smoke", "--out", str(out), *more],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(raw.read_text())
    # Each kind once; the depth ratios of the whole step and the model (a smoke run
    # measures the options at the larger depth only).
    assert sorted((r["kind"], r["layers"]) for r in rows) == [
        ("inductor_update", 2),
        ("model", 1),
        ("model", 2),
        ("regional", 2),
        ("step", 1),
        ("step", 2),
    ]
    assert all(r["first"] > 0 and r["dynamo"] > 0 for r in rows)
    # The step's process compiles an evaluation after it.
    assert all(r["eval_first"] > 0 for r in rows if r["kind"] == "step")
    text = out.read_text()
    assert "do not edit by hand" in text and "Smoke run" in text
    assert "cold compile, whole step / `torch.compile(model)`" in text
    assert "cold compile, blocks as one region / whole step, 2 layers" in text
    # The smoke run measures opaque=False at the larger depth only: no ratio at the other.
    assert "cold compile, `opaque=False` / `torch.compile(model)`, 1 layers | not measured" in text
    assert (
        "cold compile, `opaque=False` / `torch.compile(model)`, 2 layers | not measured" not in text
    )
    assert "cold compile, whole step, 2 / 1 layers | " in text
    assert "cold compile, whole step, 2 / 1 layers | not measured" not in text
    assert (
        "`compiled(eval_step(step))`'s first call after the step's / the step's, 2 layers" in text
    )


def test_population_smoke_writes_its_table(tmp_path):
    out = tmp_path / "population.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "benchmarks.population", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=600,
        capture_output=True,
    )
    text = out.read_text()
    assert "## mlp:" in text and "backend: none" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2
    # 14 columns: n, 3 rates, 2 ratios, 3 state sizes, 3 peaks, 2 first calls
    assert all(line.count("|") == 15 for line in rows)


def _gpu_command(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--dry-run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_gpu_command_dry_run_resumes_part_by_part(tmp_path):
    """The GPU machine's one command, every piece on a CPU: four runs, each the next
    part, resuming from its results file; the section lands between its markers in the
    document and survives benchmarks.run rewriting the rest."""
    from benchmarks.sections import BEGIN, END, keep_section

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nthe suite's tables\n")
    cache = tmp_path / "cache"
    common = ("--cache-dir", str(cache), "--out", str(doc))
    left = []
    for _ in range(4):
        out = _gpu_command(*common).stdout
        left.append(out.strip().splitlines()[-1])
    assert left[0].endswith("parts left: [2, 3, 4]") and left[1].endswith("parts left: [3, 4]")
    assert left[2].endswith("parts left: [4]") and left[3].endswith("parts left: none")
    saved = json.loads((cache / "dry-run-results.json").read_text())
    assert set(saved["stages"]) == {
        "tests",
        "M3 bf16",
        "M3 bf16 peers",
        "M3 fp16",
        "M3 fp16 peers",
        "M3 bf16 kernels",
        "M1 bf16",
        "M2 bf16",
        "M4 fp32",
        "M4 bf16",
        "compile 12",
        "compile 24",
    }
    assert "collected" in saved["stages"]["tests"]["summary"]
    assert saved["stages"]["M3 bf16"]["variants"] == ["B0", "F0"]
    compiled = saved["stages"]["compile 12"]["compile"]  # the 24-layer stage is the same
    assert [(r["kind"], r["layers"]) for r in compiled] == [
        ("model", 2),
        ("step", 2),
        ("regional", 2),
    ]
    assert all("error" not in r and r["first"] > 0 for r in compiled), compiled
    assert saved["stages"]["compile 24"] == "not run"
    kernels = saved["stages"]["M3 bf16 kernels"]
    assert set(kernels) == {"F0", "B0"} and all(isinstance(k, list) and k for k in kernels.values())
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nthe suite's tables")
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    assert "DRY RUN on a CPU: the numbers mean nothing" in text
    assert "| B0 |" in text and "Top kernels of F0" in text and "fp16: not run" in text
    assert "parts run: part 1" in text and "part 4" in text
    assert "| cold compile, whole step / `torch.compile(model)`, 2 layers |" in text
    # A fourth run only rewrites the section; benchmarks.run keeps it.
    assert "every part is done" in _gpu_command(*common).stdout
    rewritten = keep_section(doc, "# Benchmarks\n\nnew tables\n")
    assert "new tables" in rewritten and rewritten.count(BEGIN) == 1
    assert "Top kernels of F0" in rewritten


def test_launch_counts_hold_f0_to_b0():
    """benchmarks.launches' counts on the suite's small GPT: fasttorch's eager step with a
    CUDA step's kernel choice launches no more than the hand loop with torch's AdamW,
    foreach or fused, in bf16 and in fp16 (GradScaler), and no foreach call of it runs
    per tensor on CUDA."""
    from benchmarks.launches import measure, render

    results = measure(("bf16", "fp16"), "M3")
    for precision, rows in results.items():
        f0 = rows["F0"]
        assert f0["slow"] == 0 and rows["F0 (CPU choice)"]["slow"] == 0
        assert f0["launches"] <= rows["B0 fused"]["launches"], (precision, rows)
        assert f0["launches"] <= rows["B0 foreach"]["launches"], (precision, rows)
    assert "does NOT hold" not in render(results, "M3")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout


def test_against_names_a_commit_and_a_fasttorch_variant(capsys):
    """--against REV: resolved to the commit at parse time; a bad revision, no fasttorch
    variant to compare or --from-json (nothing runs) stop the run before it starts."""
    import doctest

    import benchmarks.run
    from benchmarks.run import parse

    head = _git("rev-parse", "HEAD").strip()
    args = parse(["--against", "HEAD", "--variants", "B0,F1"])
    assert args.against == "HEAD" and args.against_commit == head
    assert parse([]).against_commit is None
    assert parse(["--smoke", "--against", "HEAD"]).against_commit == head
    with pytest.raises(SystemExit, match="'no-such-rev-48': not a commit.*HEAD~1"):
        parse(["--against", "no-such-rev-48"])
    with pytest.raises(SystemExit):
        parse(["--against", "HEAD", "--variants", "B0,B1"])
    assert "--variants B0,B1 has none: add F0 or F1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--against", "HEAD", "--from-json", "x.json"])
    assert "--from-json runs nothing" in capsys.readouterr().err
    result = doctest.testmod(benchmarks.run, optionflags=doctest.ELLIPSIS)  # with_against
    assert result.failed == 0 and result.attempted > 0


def test_a_row_that_imported_the_wrong_tree_is_marked_failed(tmp_path):
    from benchmarks.run import _check_tree

    res = {"blocks_s": [0.1], "fasttorch_file": str(ROOT / "fasttorch" / "__init__.py")}
    _check_tree(res, tmp_path, "F0@abc1234")
    assert "F0@abc1234 imported fasttorch from" in res["error"]
    ok = {"blocks_s": [0.1], "fasttorch_file": str(tmp_path / "fasttorch" / "__init__.py")}
    _check_tree(ok, tmp_path, "F0@abc1234")
    assert "error" not in ok


def test_smoke_run_against_head_runs_the_other_tree_in_the_same_round(tmp_path):
    """--smoke --against HEAD: F0 also runs from HEAD's fasttorch/ (extracted into a
    temporary directory, removed after), in the same round, and the page has its ratio;
    the user's tree and its git worktrees are untouched."""
    status, worktrees = _git("status", "--porcelain"), _git("worktree", "list")
    out, raw = tmp_path / "b.md", tmp_path / "raw.json"
    _suite("--smoke", "--against", "HEAD", "--out", str(out), "--json", str(raw))
    sha = _git("rev-parse", "HEAD").strip()
    key = f"F0@{sha[:7]}"
    (block,) = json.loads(raw.read_text())["results"]
    (by_variant,) = block["runs"].values()
    assert list(by_variant) == ["B0", "F0", key]
    new, old = by_variant["F0"], by_variant[key]
    assert "error" not in new and "error" not in old, (new.get("error"), old.get("error"))
    assert Path(new["fasttorch_file"]) == ROOT / "fasttorch" / "__init__.py"
    other = Path(old["fasttorch_file"]).parent.parent
    assert other.name.startswith(f"ft-bench-against-{sha[:7]}-") and not other.exists()
    text = out.read_text()
    assert f"| {key} |" in text and f"against: `HEAD` = {sha[:12]}" in text
    assert f"### M1: this tree against HEAD ({sha[:12]})" in text
    assert "| F0 |" in text.split("this tree against HEAD")[1]
    assert "load average (1 / 5 / 15 min) at the start" in text
    assert _git("status", "--porcelain") == status and _git("worktree", "list") == worktrees


def test_main_job_page_gives_per_round_ratios_and_the_verdict():
    """``benchmarks.main_job``'s arithmetic (the runs themselves take minutes: none here)."""
    from benchmarks.main_job import parse, table

    assert parse("x\nwall 57.1 s | first step 31.8 s | 14.42 steps/s\n") == {
        "wall": 57.1,
        "first": 31.8,
    }
    with pytest.raises(ValueError, match="first step"):
        parse("the job printed nothing of the kind")
    rows = [
        {"round": 0, "tree": "this", "first": 10.0, "wall": 20.0},
        {"round": 0, "tree": "abc1234", "first": 30.0, "wall": 50.0},
        {"round": 1, "tree": "abc1234", "first": 20.0, "wall": 40.0},
        {"round": 1, "tree": "this", "first": 12.0, "wall": 22.0},
    ]
    text = table(rows, "abc1234")
    # per round 10/30 and 12/20: median 0.47, within the target.
    assert "| the main job | 0.47 [0.33-0.60] | <= 0.5 | met |" in text
    assert "| first step, median (s) | 11.0 | 25.0 |" in text
    slow = [dict(r, first=r["first"] * (3 if r["tree"] == "this" else 1)) for r in rows]
    assert "| not met |" in table(slow, "abc1234")
