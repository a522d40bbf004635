"""Load a benchmark script (benchmarks/*.py) as a module, as it runs: with its folder on ``sys.path``,
so its helpers (``_cli``, ``_results``, ``_two_workers``) import."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from _launch import ROOT

BENCHMARKS = ROOT / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name`` (registered, so its functions pickle by reference)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
