"""``init_rpc`` freezes the heap (``gc.freeze``) in the gloo world, where a worker owns its process,
unless ``TWINRPC_GC_FREEZE=0``; the simulator, many workers in one process, never does."""

from __future__ import annotations

import gc
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
from _spawn_world import report, run_world

import twinrpc.rpc as rpc


def _frozen_around_init(init_file: str, setting: str | None) -> tuple[int, int]:
    if setting is not None:
        os.environ["TWINRPC_GC_FREEZE"] = setting
    before = gc.get_freeze_count()
    rpc.init_rpc(
        "worker0",
        rank=0,
        world_size=1,
        rpc_backend_options=rpc.RpcBackendOptions(init_method=f"file://{init_file}"),
    )
    after = gc.get_freeze_count()
    rpc.shutdown()
    return before, after


def _child(rank: int, init_file: str, setting: str | None, shared: dict[str, Any]) -> None:
    report(shared, rank, _frozen_around_init, init_file, setting)


@pytest.mark.parametrize(("setting", "frozen"), [(None, True), ("1", True), ("0", False)])
def test_a_gloo_worker_freezes_its_heap_at_init_unless_turned_off(
    tmp_path: Path, setting: str | None, frozen: bool
) -> None:
    mp = multiprocessing.get_context("spawn")
    shared: dict[str, Any] = {"results": mp.Queue()}
    got = run_world(mp, _child, [(0, str(tmp_path / "rendezvous"), setting, shared)], shared, 60.0)
    before, after = got[0]
    assert before == 0
    assert (after > 0) is frozen, (before, after)


def _init_and_leave(rank: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    rpc.shutdown()


def test_the_simulator_never_freezes_the_heap_it_shares_with_every_simulation() -> None:
    from twinrpc.simulator import Simulation

    before = gc.get_freeze_count()
    Simulation(2, seed=0).run(_init_and_leave)
    assert gc.get_freeze_count() == before
