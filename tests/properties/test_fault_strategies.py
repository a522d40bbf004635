"""Hypothesis strategies for network models and fault plans (``twinrpc.simulator.strategies``)."""

from __future__ import annotations

import operator
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from twinrpc.simulator import (
    FAULT_KINDS,
    Crash,
    Delay,
    Drop,
    Duplicate,
    FaultPlan,
    Hold,
    NetworkModel,
    Partition,
    Pause,
    Simulation,
)
from twinrpc.simulator.strategies import fault_plans, network_models

import twinrpc.rpc as rpc

_FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
_TYPES = {"delay": Delay, "drop": Drop, "duplicate": Duplicate, "hold": Hold, "partition": Partition}
_TYPES |= {"crash": Crash, "pause": Pause}


@_FAST
@given(plan=fault_plans(4, kinds=FAULT_KINDS, lossy=(None, "request"), max_faults=5, max_actions=3))
def test_generated_plans_name_only_workers_of_the_world_and_round_trip(plan: FaultPlan) -> None:
    plan.check_world(4)
    assert len(plan.faults) <= 5 and len(plan.actions) <= 3
    assert FaultPlan.from_dict(plan.to_dict()) == plan


@_FAST
@given(plan=fault_plans(3, kinds=("delay", "hold"), messages=("gradient",)))
def test_generated_plans_keep_to_the_kinds_and_messages_asked_for(plan: FaultPlan) -> None:
    for f in plan.faults:
        assert isinstance(f, (Delay, Hold))
        if isinstance(f, Delay):
            assert f.kind == "gradient"


@_FAST
@given(plan=fault_plans(3, messages=(None,)))
def test_the_default_plans_hold_only_faults_a_correct_program_survives(plan: FaultPlan) -> None:
    for f in plan.faults:
        assert not isinstance(f, Crash)
        if isinstance(f, (Drop, Duplicate)):
            assert f.kind == "rref-control"
        if isinstance(f, Partition):
            assert f.mode == "hold" and f.end is not None and f.end - f.start < 10.0


def test_every_fault_kind_is_generated() -> None:
    for name, cls in _TYPES.items():
        found = find(
            fault_plans(3, kinds=(name,), max_faults=1),
            lambda p, cls=cls: len(p.faults) == 1 and isinstance(p.faults[0], cls),
            settings=settings(database=None, max_examples=200, phases=(Phase.generate,)),  # no shrinking
        )
        assert isinstance(found.faults[0], cls)


def test_network_models_shrink_to_the_default_model() -> None:
    assert find(network_models(), lambda m: True) == NetworkModel()
    slow = find(network_models(), lambda m: m.latency > 1e-3)
    assert slow == NetworkModel(latency=5e-3)  # everything else stays at its default


def _one_call(rank: int) -> Any:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: Any = None
    if rank == 0:
        try:
            out = rpc.rpc_sync("worker1", operator.add, args=(1, 2), timeout=2.0)
        except RuntimeError as exc:
            out = type(exc).__name__
    rpc.shutdown()
    return out


def _times_out(plan: FaultPlan) -> bool:
    try:
        return (
            Simulation(2, seed=1, faults=plan, max_time=1000).run(_one_call).values()[0] == "RPCTimeoutError"
        )
    except Exception:  # a plan that breaks the run some other way (a lost shutdown message) is not it
        return False


def test_a_failing_plan_shrinks_to_one_minimal_fault() -> None:
    plan = find(
        fault_plans(2, kinds=("delay", "pause", "drop"), lossy=(None, "request"), max_faults=4),
        _times_out,
        settings=settings(max_examples=500, database=None, derandomize=True, deadline=None),
    )
    # hypothesis found some plan that loses the call, then shrank it to its essence
    assert plan == FaultPlan([Drop()]) or plan == FaultPlan([Drop()], gc_delay=plan.gc_delay), plan
    assert plan.describe().endswith("faults=[drop the 1st message])")


def test_fault_plans_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="'flood' is not one of"):
        fault_plans(3, kinds=("flood",))
    with pytest.raises(ValueError, match="'reply' is not one of"):
        fault_plans(3, messages=("reply",))
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        fault_plans(0)
