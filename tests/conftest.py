"""Shared configuration of the unit and integration tests under tests/."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The harness tests import the conformance package from the repository root, also when pytest's
# working directory changes (pytester runs each test in its own temporary directory). The tests are
# packages by family (tests/gloo/, tests/sim/, ...: each has an __init__.py, so two folders may hold
# test files of the same name), and they import the helpers at the top of tests/ (_launch.py,
# _spawn_world.py, twin/, ...) as top-level modules: tests/ is on sys.path too.
_ROOT = Path(__file__).resolve().parents[1]
for _path in (str(_ROOT), str(_ROOT / "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

pytest_plugins = ["pytester"]

#: Modules whose tests take 10-60 s each (real processes), run first: pytest-xdist hands out tests in
#: collection order, and a slow test that sorts near the end leaves one worker running alone after the
#: other has finished. Measured with ``--durations``: docs/test_tutorial_programs.py 20-60 s a test
#: (three worlds, TensorPipe's start-up), twin/test_twin_differential.py 15-33 s, docs/test_readme.py
#: (an exploration) and docs/test_docs_examples.py up to 30 s (its gloo programs). By file name.
SLOW_MODULES = (
    "test_tutorial_programs.py",
    "test_twin_differential.py",
    "test_readme.py",
    "test_docs_examples.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow modules first, otherwise the collection order (a stable sort: the same on every worker)."""
    first = {name: rank for rank, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOW_MODULES)))
