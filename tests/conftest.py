"""Shared configuration of the unit and integration tests under tests/."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The harness tests import the conformance package from the repository root, also when pytest's
# working directory changes (pytester runs each test in its own temporary directory).
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

pytest_plugins = ["pytester"]

#: Modules whose tests take 10-30 s each (real processes), run first: pytest-xdist hands out tests in
#: collection order, and these two sort near the end, where a 30 s test left one worker running alone
#: after the other had finished. Measured with ``--durations``: test_twin_differential.py 15-33 s a
#: test, test_docs_examples.py up to 27 s (its gloo programs).
SLOW_MODULES = ("test_twin_differential.py", "test_docs_examples.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow modules first, otherwise the collection order (a stable sort: the same on every worker)."""
    first = {name: rank for rank, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOW_MODULES)))
