"""SHUT-4 on the simulator: the default leak check logs PyTorch's warning (no conformance test can read
a torch worker's C++ log); debug info lists the leaking fork."""

from __future__ import annotations

import logging

from twinrpc.simulator import Simulation

import twinrpc.rpc as rpc

_KEEP: list[object] = []


def _make() -> list[int]:
    return [1]


def _program(rank: int) -> object:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        _KEEP.append(rpc.remote("worker1", _make))
        _KEEP[0].to_here()  # type: ignore[attr-defined]
        rpc.rpc_sync("worker1", _make)
        rpc.shutdown(graceful=False)
        return None
    from twinrpc.simulator import sleep

    sleep(0.5)
    info = rpc._get_debug_info()
    rpc.shutdown(graceful=False)  # the user on worker0 is still alive: a leak, only logged
    return info


def test_default_leak_check_logs_pytorchs_warning_with_each_leaking_fork(caplog):
    caplog.set_level(logging.WARNING, logger="twinrpc")
    try:
        values = Simulation(2, seed=0).run(_program).values()
    finally:
        _KEEP.clear()
    info = values[1]
    assert info["num_owner_rrefs"] == "1" and info["num_forks"] == "1"
    assert list(info["rref_forks"].values()) == [["GloballyUniqueId(created_on=0, local_id=1)"]]
    text = caplog.text
    assert "Detected RRef Leaks during shutdown" in text
    assert (
        "Leaking RRef GloballyUniqueId(created_on=0, local_id=0) with fork Id "
        "GloballyUniqueId(created_on=0, local_id=1)" in text
    )
