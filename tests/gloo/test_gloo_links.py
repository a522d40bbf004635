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

import collections
import multiprocessing
import operator
import time
from typing import Any

import pytest
from _launch import free_port
from _spawn_world import report, run_world

WORLD = 4
WORLD_TIMEOUT = 180.0
KEY = b"the job's key"


def _threads() -> collections.Counter[str]:
    """This process's threads, by their kernel name (gloo names its own: gloo_tcp_loop, ...)."""
    import os

    out: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="ascii", errors="replace") as f:
                out[f.read().strip()] += 1
        except OSError:
            continue  # exited meanwhile
    return out


def _descriptors() -> collections.Counter[str]:
    """This process's open descriptors, by kind ('socket', 'pipe', 'anon_inode', or the file)."""
    import os

    out: collections.Counter[str] = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[os.readlink(f"/proc/self/fd/{fd}").split(":")[0]] += 1
        except OSError:
            continue  # the listing's own descriptor
    return out


def _links_program(rank: int, port: int, keyed: bool, barrier: Any) -> dict[str, Any]:
    import gc

    import torch

    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent

    torch.set_num_threads(1)
    torch.add(torch.ones(1), 1)  # torch's own lazily started threads, before the count
    barrier.wait(WORLD_TIMEOUT)  # and the barrier's connection to its manager
    # and libuv's once-per-process signal pipe, which the first store server (rank 0's) opens
    torch.distributed.TCPStore("127.0.0.1", 0, 1, True)  # type: ignore[attr-defined]
    gc.disable()
    threads, descriptors = _threads(), _descriptors()
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
    # a joined thread's kernel task goes a moment after join() returns: allow that moment, no more
    # (what holds a thread or a descriptor past shutdown would hold it for good: gc is off)
    settle = time.monotonic() + 2.0
    while (_threads() - threads or _descriptors() - descriptors) and time.monotonic() < settle:
        time.sleep(0.05)
    return {
        "at_init": at_init,
        "after_one": after_one,
        "answers": answers,
        "after_all": after_all,
        "threads_left": dict(_threads() - threads),
        "descriptors_left": dict(_descriptors() - descriptors),
    }


def _child(rank: int, port: int, keyed: bool, barrier: Any, shared: dict[str, Any]) -> None:
    report(shared, rank, _links_program, rank, port, keyed, barrier)


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "job-key"])
def test_links_are_made_on_first_use_and_nothing_of_them_outlives_shutdown(keyed: bool) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        shared = {"results": ctx.Queue()}
        barrier = manager.Barrier(WORLD)
        port = free_port()
        args = [(rank, port, keyed, barrier, shared) for rank in range(WORLD)]
        got = run_world(ctx, _child, args, shared, WORLD_TIMEOUT)
    for rank, found in sorted(got.items()):
        print(rank, found)
        neighbours = sorted({(rank + 1) % WORLD, (rank - 1) % WORLD})
        assert found["at_init"] == [], found
        assert found["after_one"] == neighbours, found
        assert found["answers"] == [[1.0 + p, 1.0 + p] for p in range(WORLD)], found
        assert found["after_all"] == [p for p in range(WORLD) if p != rank], found
        assert found["threads_left"] == {}, found
        assert found["descriptors_left"] == {}, found
