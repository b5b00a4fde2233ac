"""The suite's schedule (conftest.py): the files it starts first exist."""

from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
# The root conftest (tests/ has one of its own, first on sys.path).
_spec = importlib.util.spec_from_file_location(
    "root_conftest", os.path.join(HERE, "..", "conftest.py")
)
assert _spec is not None and _spec.loader is not None
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def test_every_file_scheduled_first_exists_once():
    names = conftest.LONGEST_FIRST
    assert len(set(names)) == len(names)
    missing = [n for n in names if not os.path.exists(os.path.join(HERE, n))]
    assert missing == [], f"conftest.LONGEST_FIRST names files that are gone: {missing}"


def test_the_longest_files_come_first_and_each_file_stays_together():
    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [
        Item("tests/test_a.py::one"),
        Item("tests/test_compile_cache.py::x"),
        Item("tests/test_b.py::one"),
        Item("tests/test_b.py::two"),
        Item("tests/test_benchmarks.py::y"),
        Item("tests/test_a.py::two"),
        Item("tests/test_a.py::three"),
    ]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        "tests/test_benchmarks.py::y",
        "tests/test_compile_cache.py::x",
        "tests/test_a.py::one",  # three tests: before test_b's two
        "tests/test_a.py::two",
        "tests/test_a.py::three",
        "tests/test_b.py::one",
        "tests/test_b.py::two",
    ]
