"""A static group's links are made on first use, and nothing of them outlives ``shutdown()``
(impl/_link_table.py, ``GlooWorld._release``).

A world of four ``spawn`` processes over a TCPStore: each worker first calls only its right-hand
neighbour, so it holds links to its two neighbours only; then every worker calls every other at once
(both sides of a pair start its link together, and they make one). After ``shutdown()``, with garbage
collection disabled, the process has exactly the threads and descriptors it had before ``init_rpc``:
gloo's loop and work threads, its sockets and pipes, the store's connections all went with RPC.
(libuv opens a signal pipe once per process with the first store server, and keeps it: the workers
open one before counting.)
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
from _spawn_world import held_after_rpc, held_before_rpc, report, run_barrier_world

WORLD = 4
WORLD_TIMEOUT = 180.0
KEY = b"the job's key"


def _links_program(rank: int, port: int, keyed: bool, barrier: Any) -> dict[str, Any]:
    import torch

    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent

    before = held_before_rpc(barrier, WORLD_TIMEOUT)
    options = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", auth_key=KEY if keyed else None)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD, rpc_backend_options=options)
    world = current_agent().world
    at_init = sorted(world.links)  # type: ignore[attr-defined]
    right = (rank + 1) % WORLD
    assert rpc.rpc_sync(f"worker{right}", operator.add, args=(rank, 1)) == rank + 1
    barrier.wait(WORLD_TIMEOUT)  # every worker has called its neighbour
    after_one = sorted(world.links)  # type: ignore[attr-defined]
    futs = [rpc.rpc_async(f"worker{p}", torch.add, args=(torch.ones(2), p)) for p in range(WORLD)]
    answers = [f.wait().tolist() for f in futs]
    after_all = sorted(world.links)  # type: ignore[attr-defined]
    rpc.shutdown()
    return {
        "at_init": at_init,
        "after_one": after_one,
        "answers": answers,
        "after_all": after_all,
        **held_after_rpc(before),
    }


def _child(rank: int, port: int, barrier: Any, _event: Any, keyed: bool, shared: dict[str, Any]) -> None:
    report(shared, rank, _links_program, rank, port, keyed, barrier)


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "job-key"])
def test_links_are_made_on_first_use_and_nothing_of_them_outlives_shutdown(keyed: bool) -> None:
    got = run_barrier_world(_child, WORLD, WORLD_TIMEOUT, keyed)
    for rank, found in sorted(got.items()):
        print(rank, found)
        neighbours = sorted({(rank + 1) % WORLD, (rank - 1) % WORLD})
        assert found["at_init"] == [], found
        assert found["after_one"] == neighbours, found
        assert found["answers"] == [[1.0 + p, 1.0 + p] for p in range(WORLD)], found
        assert found["after_all"] == [p for p in range(WORLD) if p != rank], found
        assert found["threads_left"] == {}, found
        assert found["descriptors_left"] == {}, found
