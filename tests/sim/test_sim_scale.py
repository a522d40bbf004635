"""256 simulated workers: a parameter-server job with distributed autograd and DistributedOptimizer.

The job is benchmarks/bench_sim_scale.py's (it prints the speed figures); here it must be right: every
worker exits ok, every trainer saw exactly its gradient on every server, every server ends with the
exact parameters (the loss is linear in them, so the result does not depend on the order the steps
landed in), and the RRef monitors (on by default) saw no violation.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from _benchmarks import load_benchmark
from twinrpc.simulator import NetworkModel


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    return load_benchmark("bench_sim_scale")  # its functions travel by reference: registered as a module


def _check(scale: ModuleType, result: object, world_size: int, servers: int, steps: int) -> None:
    outcomes = result.outcomes  # type: ignore[attr-defined]
    assert len(outcomes) == world_size
    assert [o.rank for o in outcomes if o.error is not None or o.crashed] == []
    expected = scale.expected_parameter(world_size, servers, steps)
    assert not torch.equal(expected, scale.P0)  # the job changes the parameters
    for o in outcomes[:servers]:
        assert torch.equal(o.value, expected), (o.rank, o.value, expected)
    assert [o.rank for o in outcomes[servers:] if o.value is not True] == []  # gradient checks


def test_256_workers_train_to_the_exact_parameters(scale: ModuleType) -> None:
    result = scale.run_job(256, servers=4, steps=2, seed=1)
    _check(scale, result, 256, 4, 2)
    assert result.messages > 255 * 2 * 4 * 2  # a request and a reply per forward, at least


def test_a_busy_server_makes_the_job_take_longer_in_virtual_time(scale: ModuleType) -> None:
    """With a per-message handling cost the one server is the bottleneck: virtual time grows with the
    number of trainers, and the results stay exact."""
    model = NetworkModel(message_cost=20e-6)
    small = scale.run_job(9, servers=1, steps=2, network=model, trace=False)
    large = scale.run_job(33, servers=1, steps=2, network=model, trace=False)
    _check(scale, small, 9, 1, 2)
    _check(scale, large, 33, 1, 2)
    assert large.virtual > 2.5 * small.virtual


def test_the_scheduler_s_events_per_message_do_not_grow_with_the_world(scale: ModuleType) -> None:
    """Scheduler events per message are the simulator's cost per message: 8 times the workers is
    within 10% of the same per message (a shutdown announced to every peer made it grow with N)."""
    small = scale.run_job(32, servers=4, steps=2)
    large = scale.run_job(256, servers=4, steps=2)
    per_message = [r.events / r.messages for r in (small, large)]
    assert per_message[1] / per_message[0] == pytest.approx(1.0, abs=0.1), per_message
