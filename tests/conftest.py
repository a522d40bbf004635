"""Shared configuration of the unit and integration tests under tests/."""

from __future__ import annotations

import sys
from pathlib import Path

# The harness tests import the conformance package from the repository root, also when pytest's
# working directory changes (pytester runs each test in its own temporary directory).
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

pytest_plugins = ["pytester"]
