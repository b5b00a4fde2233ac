"""The path the state takes through a composed eager step stays short.

``benchmarks/call_path.py`` counts it (docs/call_path.md holds the counts); this keeps
the two facts docs/design.md builds on: the gradient engine never sees the train state
(it differentiates a function of the module's tensors), and the state's path enters no
more files, and climbs back no more often, than docs/call_path.md says.
"""

from __future__ import annotations

from benchmarks import call_path


def test_the_state_passes_through_seven_files_and_climbs_back_once():
    files, climbs = call_path.trace(compile_it=False, state_only=True)
    assert "_engine" not in files, files  # the engine gets tensors and a bound loss phase
    assert files == {
        "phases",
        "state",
        "steps",
        "struct",
        "transforms/clip_scaled",
        "transforms/with_amp",
        "window",
    }, files
    assert climbs == {("transforms/with_amp", "phases")}, climbs
