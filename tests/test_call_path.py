"""The path the state takes through a composed eager step stays short.

``benchmarks/call_path.py`` counts it (docs/call_path.md holds the counts); this keeps
the two facts docs/design.md builds on: the gradient engine never sees the train state
(it differentiates a function of the module's tensors), and the state's path enters no
more files, and climbs back no more often, than docs/call_path.md says.
"""

from __future__ import annotations

from benchmarks import call_path

ENGINE = {"_core/phases:gradients", "_core/phases:apply_optimizer", "_core/phases:module_tensors"}


def test_the_state_passes_through_six_files_and_climbs_back_once():
    functions: set[str] = set()
    files, climbs = call_path.trace(compile_it=False, state_only=True, functions=functions)
    assert not ENGINE & functions, functions  # the engine gets tensors and a bound loss phase
    everything: set[str] = set()
    call_path.trace(compile_it=False, state_only=False, functions=everything)
    assert everything >= ENGINE, everything  # and runs in this call: the check can fail
    assert files == {
        "_core/phases",
        "_core/state",
        "_core/step",
        "struct",
        "transforms/clip_scaled",
        "transforms/with_amp",
    }, files
    assert climbs == {("transforms/with_amp", "_core/phases")}, climbs
