"""``benchmarks.steady_step``: its table and its command (no performance claim here).

The options' steps themselves are compiled and run by the compile-time benchmark's
smoke test (tests/test_benchmarks.py); here the measurement is stood in for, so that
the page's arithmetic is checked exactly.
"""

from __future__ import annotations

import json
import sys

from benchmarks import steady_step

LEGACY = ("step", "opaque", "regional", "regional_opaque")
"""The kinds of rows from before the opaque update was the default."""


def _result(layers, per_round, model="gpt", kinds=steady_step.KINDS):
    """A row of ``per_round`` times, in ``kinds``' order (fewer: a row from before the
    last options)."""
    kinds = kinds[: len(per_round[0])]
    rounds = [dict(zip(kinds, r, strict=True)) for r in per_round]
    compile_s = dict.fromkeys(kinds, 2.0)
    return {"model": model, "layers": layers, "compile": compile_s, "rounds": rounds}


def test_the_table_gives_medians_over_rounds_and_per_round_speed_ups():
    # Three rounds: the whole step 0.10, 0.20, 0.10 s; opaque=False 0.15, 0.20, 0.12 s.
    res = _result(4, [(0.10, 0.15, 0.05, 0.1), (0.20, 0.20, 0.1, 0.2), (0.10, 0.12, 0.05, 0.1)])
    text = steady_step.table([res])
    # opaque=False: ms 150, 200, 120 -> median 150; speed-ups 0.10/0.15, 1, 0.10/0.12 -> 0.83.
    before = (
        "| `fasttorch.compiled`, `adamw(..., opaque=False)` | GPT, 4 layers | 150.0 | "
        "0.83 [0.67-1.00] |"
    )
    assert before in text
    assert "| `fasttorch.compiled` | GPT, 4 layers | 100.0 | 1.00 [1.00-1.00] | 2.0 |" in text
    # regions: half the whole step's time in every round.
    regions = "| `fasttorch.compiled(..., regions=True)` | GPT, 4 layers | 50.0 | 2.00 [2.00-2.00]"
    assert regions in text
    # The verdict: the default's speed over opaque=False's, 1.5, 1, 1.2 -> 1.2.
    assert "| GPT, 4 layers | 1.20 [1.00-1.50] | >= 0.97 | met |" in text


def test_the_verdict_is_not_met_below_the_target():
    res = _result(4, [(0.10, 0.096, 0.1, 0.1)] * 3)
    assert "| GPT, 4 layers | 0.96 [0.96-0.96] | >= 0.97 | not met |" in steady_step.table([res])


def test_the_python_wrapper_row_splits_the_regions_cost_and_older_rows_keep_their_options():
    new = _result(4, [(0.10, 0.1, 0.125, 0.11)] * 3)
    old = _result(6, [(0.1, 0.2, 0.1, 0.1)] * 3, kinds=LEGACY)
    text = steady_step.table([new, old])
    wrapper = "inductor's Python wrapper (`cpp_wrapper=False`) | GPT, 4 layers | 110.0 | 0.91"
    assert wrapper in text
    assert "Python wrapper (`cpp_wrapper=False`) | GPT, 6 layers" not in text
    assert text.count("| GPT, 6 layers |") == 4
    older = "| `fasttorch.compiled`, `adamw(..., opaque=True)` (older: `_foreach` operator) |"
    assert f"{older} GPT, 6 layers | 200.0 | 0.50 [0.50-0.50] |" in text
    assert "| GPT, 6 layers | " not in text.split("| measured | target | verdict |")[1]


def test_the_command_writes_the_page_for_every_depth_asked(tmp_path, monkeypatch):
    asked = []

    def fake(layers, rounds, block, smoke, model_name):
        asked.append((model_name, layers, rounds, block, smoke))
        return _result(layers, [(0.1, 0.1, 0.1, 0.1)] * rounds, model_name)

    monkeypatch.setattr(steady_step, "measure", fake)
    out, raw = tmp_path / "steady.md", tmp_path / "rows.json"
    argv = ["steady_step", "--layers", "3,5", "--mlp", "7", "--rounds", "2", "--block", "4"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out), "--json", str(raw)])
    steady_step.main()
    assert asked == [("gpt", 3, 2, 4, False), ("gpt", 5, 2, 4, False), ("mlp", 7, 2, 4, False)]
    text = out.read_text()
    assert "do not edit by hand" in text
    command = "python -m benchmarks.steady_step --layers 3,5 --mlp 7 --rounds 2 --block 4"
    assert f"- command: `{command}`" in text
    assert "| `fasttorch.compiled(..., regions=True)` | GPT, 5 layers |" in text
    assert "| `fasttorch.compiled` | MLP (M1), 7 blocks |" in text
    assert "Smoke run" not in text
    # Each row keeps its run's command, for a page rewritten from several runs.
    rows = json.loads(raw.read_text())
    assert {r["options"] for r in rows} == {"--layers 3,5 --mlp 7 --rounds 2 --block 4"}
    assert all(r["regions_alias_pass"] == steady_step.ALIAS_PASS for r in rows)
    assert "were measured while" not in text and "before the alias pass" not in text


def test_the_rows_record_how_regions_are_compiled():
    from fasttorch._compile import regions as _regions
    from fasttorch._compile.region_aliases import RegionAliases

    # The benchmark names the library's pass, which inductor_options installs.
    assert RegionAliases.__name__ == steady_step.ALIAS_PASS
    inner = _regions.inductor_options({"backend": "inductor"})["options"]
    assert isinstance(inner["post_grad_custom_pre_pass"], RegionAliases)


def test_rows_measured_with_a_reuse_option_on_are_named_for_each():
    rows = [
        {**_result(12, [(0.1,) * 4])},  # neither off (before the record)
        {**_result(4, [(0.1,) * 4]), "regions_without_buffer_reuse": True},
        {**_result(6, [(0.1,) * 4], "mlp"), "regions_compiled_without": ["allow_buffer_reuse"]},
        {**_result(8, [(0.1,) * 4]), "regions_compiled_without": list(steady_step.NO_REUSE)},
        {**_result(10, [(0.1,) * 4]), "regions_alias_pass": steady_step.ALIAS_PASS},
    ]
    assert steady_step._stale(rows) == {
        "`allow_buffer_reuse`": ["GPT, 12 layers"],
        "`inplace_buffers`": ["GPT, 12 layers", "GPT, 4 layers", "MLP (M1), 6 blocks"],
    }
    assert steady_step._without_reuse(rows) == ["GPT, 8 layers"]


def test_a_page_from_two_runs_gives_both_commands(tmp_path, monkeypatch):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps([{**_result(12, [(0.1, 0.1, 0.1, 0.1)]), "threads": 1}]))
    newer = {**_result(4, [(0.1, 0.2, 0.1, 0.1)]), "threads": 1, "options": "--layers 4 --x"}
    new.write_text(json.dumps([newer]))
    monkeypatch.setattr(steady_step, "measure", None)  # nothing is measured
    out = tmp_path / "steady.md"
    argv = ["steady_step", "--layers", "12", "--from-json", f"{old},{new}", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    steady_step.main()
    text = out.read_text()
    # The old rows have no command of their own: they take this one's options.
    assert (
        "- commands: `python -m benchmarks.steady_step --layers 12 --rounds 7 --block 5`; "
        "`python -m benchmarks.steady_step --layers 4 --x`; this page rewritten from its rows"
    ) in text
    assert "torch threads: 1;" in text
    # Rows from before regions compiled without buffer reuse say so.
    assert (
        "The regions rows (GPT, 12 layers; GPT, 4 layers) were measured while a graph with "
        "regions was still compiled with inductor's `allow_buffer_reuse` on"
    ) in text
    assert "| `fasttorch.compiled` | GPT, 12 layers |" in text
    assert "| `fasttorch.compiled` | GPT, 4 layers |" in text


def test_a_page_rewritten_from_a_runs_results_says_so_and_keeps_its_threads(tmp_path, monkeypatch):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{**_result(2, [(0.1, 0.2, 0.1, 0.1)]), "threads": 7}]))
    monkeypatch.setattr(steady_step, "measure", None)  # nothing is measured
    out = tmp_path / "steady.md"
    argv = ["steady_step", "--layers", "2", "--from-json", str(rows), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    steady_step.main()
    text = out.read_text()
    assert "torch threads: 7;" in text and "this page rewritten from its rows" in text
    assert "load average" not in text and "wall time" not in text
    before = (
        "| `fasttorch.compiled`, `adamw(..., opaque=False)` | GPT, 2 layers | 200.0 | "
        "0.50 [0.50-0.50] |"
    )
    assert before in text
