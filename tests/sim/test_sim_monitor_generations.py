"""The RRef monitors across generations: a worker that re-initialises RPC numbers its RRefs anew.

A simulated worker's k-th ``init_rpc`` joins generation k's group, and its RRef ids start from the
beginning again, so the ids of one generation name other RRefs in the next. The monitors
(``simulator/_checks/_monitors.py``) check each generation on its own: re-initialising reports no
false owner-free violation (RREF-D1), and a real one is still reported in a later generation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from twinrpc.simulator import MonitorViolation, Simulation

import twinrpc.rpc as rpc
from twinrpc._rref import GloballyUniqueId, OwnerState

GENERATIONS = 3


def _ones() -> torch.Tensor:
    return torch.ones(2)


def _total(rref: Any) -> float:
    return float(rref.to_here().sum())


def _rrefs_in_every_generation(rank: int) -> list[float]:
    """Every generation: a remote() RRef and a local one passed to its peer, then shut down."""
    out = []
    for _ in range(GENERATIONS):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        peer = f"worker{1 - rank}"
        remote = rpc.remote(peer, _ones)
        local = rpc.RRef(torch.full((2,), float(rank)))
        out.append(_total(remote) + rpc.rpc_sync(peer, _total, args=(local,)))
        del remote, local
        rpc.shutdown()
    return out


@pytest.mark.parametrize("seed", range(4))
def test_reinitialising_rpc_reports_no_owner_free_violation(seed: int) -> None:
    sim = Simulation(2, seed=seed)
    result = sim.run(_rrefs_in_every_generation)
    assert result.values() == [[2.0] * GENERATIONS, [4.0] * GENERATIONS]
    assert sim.monitor is not None and sim.monitor.violations == []
    assert sim.monitor.events > 0  # the monitors watched every generation


def _gid(rank: int, n: int) -> GloballyUniqueId:
    return GloballyUniqueId(rank, n)


class _User:
    """What the monitors read of a user RRef (``twinrpc._rref.UserState``), without an agent."""

    def __init__(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId, owner: int) -> None:
        self.rref_id, self.fork_id, self.owner, self.timed_out = rref_id, fork_id, owner, False


def test_a_later_generation_still_reports_a_value_freed_under_a_live_user() -> None:
    sim = Simulation(2, seed=0)
    assert sim.monitor is not None
    first, second = sim.monitor.generation(0), sim.monitor.generation(1)
    rref_id, fork_id = _gid(0, 0), _gid(0, 1)
    user = _User(rref_id, fork_id, owner=1)
    first.user_created(0, user)  # type: ignore[arg-type]  # generation 0's user of (0, 0) ...
    first.user_deleted(0, user, True)  # type: ignore[arg-type]
    first.delete_heard(1, rref_id, fork_id)
    first.owner_dropped(1, OwnerState(rref_id))  # ... freed at its end
    again = _User(rref_id, fork_id, owner=1)
    second.user_created(0, again)  # type: ignore[arg-type] # the same ids in generation 1: another RRef, no violation
    assert sim.monitor.violations == []
    second.owner_dropped(1, OwnerState(rref_id))  # its owner drops it while the user lives
    [violation] = sim.monitor.violations
    assert isinstance(violation, MonitorViolation)
    assert (violation.requirement, violation.invariant) == ("RREF-D1", "owner-free")
