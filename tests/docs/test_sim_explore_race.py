"""The parameter-server tutorial's race, found by exploration from Python and shrunk.

The program is the race tutorial's (docs/examples/ps_race.py): the seeds' parameter server as written
(a ``ParameterServer`` module behind an RRef, ``TrainerNet`` forwarding through it with
``remote_method``, a distributed backward and a ``DistributedOptimizer`` step per batch, two
trainers), with a small model and five batches of random data so that a run takes milliseconds. It
is written for ``torch.distributed.rpc``; here it is imported once with those modules served by
twinrpc, and explored with :func:`twinrpc.simulator.explore` (the tutorial does the same from the
command line, tests/docs/test_docs_examples.py runs that). The race: a trainer's optimizer step updates
the server's parameters in place; landing between another trainer's forward and its backward, it
makes that backward fail with "one of the variables needed for gradient computation has been
modified by an inplace operation" (PyTorch too). ``ps_race.FIXED = True`` is the tutorial's fix.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import strategies as st
from twinrpc.simulator import Failure, explore, replay
from twinrpc.simulator._launch._torch import serve_torch_rpc

RACE = "modified by an inplace operation"
PROGRAM = Path(__file__).resolve().parents[2] / "docs" / "examples" / "ps_race.py"


def _import_program() -> ModuleType:
    """docs/examples/ps_race.py as module ``ps_race``, its torch.distributed imports bound to twinrpc."""
    if "ps_race" in sys.modules:
        return sys.modules["ps_race"]
    spec = importlib.util.spec_from_file_location("ps_race", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ps_race"] = module  # RPCs pickle its functions by reference: ps_race.call_method
    with serve_torch_rpc():
        spec.loader.exec_module(module)
    return module


ps_race = _import_program()


def run_worker(rank: int) -> None:
    """One worker of the tutorial's program (all three share the module, unlike separate processes)."""
    if rank == 0:
        ps_race.param_server = None  # the singleton of an earlier run
    ps_race.run_worker(rank, 3)


def _check_race(failure: Failure) -> None:
    assert failure.runs <= 200
    assert len(failure.faults) <= 3, failure.faults.describe()
    assert failure.exception_type == "builtins.RuntimeError"
    assert RACE in str(failure.error) and RACE in str(failure.minimal_error)
    assert failure.rank in (1, 2)  # a trainer's backward fails, on the server
    with pytest.raises(RuntimeError, match=failure.pattern):
        replay(run_worker, 3, seed=failure.seed, faults=failure.faults)


def test_exploration_finds_the_inplace_race_within_200_runs_and_shrinks_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(Failure) as info:
        explore(run_worker, 3, runs=200, max_shrink_runs=100)
    failure = info.value
    print(failure)
    _check_race(failure)
    monkeypatch.setattr(ps_race, "FIXED", True)  # the fix passes the run that failed
    replay(run_worker, 3, seed=failure.seed, faults=failure.faults)


def test_faults_alone_find_the_race_under_one_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Failure) as info:
        explore(run_worker, 3, runs=200, seeds=st.just(0), max_shrink_runs=100)
    failure = info.value
    print(failure)
    _check_race(failure)
    assert failure.seed == 0 and len(failure.faults) >= 1  # seed 0 alone passes
    monkeypatch.setattr(ps_race, "FIXED", True)
    replay(run_worker, 3, seed=0, faults=failure.faults)
