"""Errors name their cause, in the gloo world.

* Under ``torch.multiprocessing.spawn`` the launcher reports the failure that started it: one worker's
  program raises, its links close, so its peers' calls and shutdown fail at once with
  ``WorkerUnavailableError`` and their programs raise too; ``mp.spawn`` reports the first process that
  exits with an error, so the peers let the failed worker's process exit first (``impl/_world.py``,
  ``FollowOnExit``).
* A broken connection is reported in twinrpc's words (which peer, what happened to its connection),
  with gloo's own text after them (``impl/_link_state.py``, ``link_broken``), or on one host what the
  same-host doorbell saw (``impl/_doorbell.py``).

Fresh ``spawn`` processes, as PyTorch's examples start them; every run is bounded.
"""

from __future__ import annotations

import multiprocessing
import operator
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from _spawn_world import report, run_world

WORLD_SIZE = 3
#: wall-clock bound of one whole world (process start-up included; the host may be loaded)
WORLD_TIMEOUT = 120.0


def _init(rank: int, world_size: int, init_file: str) -> Any:
    import twinrpc.rpc as rpc

    options = rpc.RpcBackendOptions(init_method=f"file://{init_file}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    return rpc


def _call_until_it_fails(rpc: Any, to: str) -> str:
    deadline = time.monotonic() + WORLD_TIMEOUT
    while time.monotonic() < deadline:
        try:
            rpc.rpc_sync(to, operator.add, args=(1, 1))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        time.sleep(0.01)
    return "no failure"


def _spawned_worker(rank: int, init_file: str) -> None:
    """worker1 raises; worker0 calls it until that fails and raises the error; worker2 waits in the
    graceful shutdown, which fails too."""
    rpc = _init(rank, WORLD_SIZE, init_file)
    if rank == 1:
        time.sleep(0.5)
        raise ValueError("the first failure, in worker1")
    if rank == 0:
        raise RuntimeError(_call_until_it_fails(rpc, "worker1"))
    rpc.shutdown()


def test_spawn_reports_the_worker_whose_failure_started_it(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessRaisedException) as raised:
        mp.spawn(_spawned_worker, args=(str(tmp_path / "init"),), nprocs=WORLD_SIZE, join=True)
    assert raised.value.error_index == 1, str(raised.value)
    assert "ValueError: the first failure, in worker1" in str(raised.value)


def _dies_or_calls(rank: int, init_file: str, shared: dict[str, Any]) -> None:
    """worker0 calls worker1 once (their link is made), then worker1 exits at once without shutting
    RPC down (its connections close); worker0 reports what its calls to worker1 then raise."""
    rpc = _init(rank, 2, init_file)
    if rank == 1:
        shared["ready"].wait(WORLD_TIMEOUT)
        os._exit(3)
    assert rpc.rpc_sync("worker1", operator.add, args=(1, 1)) == 2
    shared["ready"].set()
    report(shared, rank, _call_until_it_fails, rpc, "worker1")


def test_a_broken_connection_is_reported_in_twinrpc_words_then_gloos(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        shared = {"results": ctx.Queue(), "ready": manager.Event()}
        args = [(rank, str(tmp_path / "init"), shared) for rank in range(2)]
        error = run_world(ctx, _dies_or_calls, args, shared, WORLD_TIMEOUT, reporting=[0])[0]
    assert error.startswith("WorkerUnavailableError: worker 'worker1' (rank 1) is unavailable"), error
    assert "its connection to this worker closed without a close frame (its process exited or died)" in error
    # then what the transport saw: gloo's text, or on one host the doorbell's (the peer's pidfd)
    said = "; gloo said: " in error or "; the same-host doorbell saw process" in error
    assert said and "Its process has probably died" in error, error
    assert "pair.cc" not in error  # not gloo's source location


def _dies_before_any_link(rank: int, init_file: str, shared: dict[str, Any]) -> None:
    """worker2 exits once every worker has joined, before any link to it is made (links are made on
    first use); worker0 then calls it for the first time, and worker1 shuts down gracefully: both
    report what they raised."""
    import twinrpc.rpc as rpc

    options = rpc.RpcBackendOptions(
        init_method=f"file://{init_file}", heartbeat_interval=0.2, heartbeat_misses=5
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 2:
        shared["gone"].set()
        os._exit(3)
    shared["gone"].wait(WORLD_TIMEOUT)
    if rank == 0:
        first = _call_until_it_fails(rpc, "worker2")
    try:
        rpc.shutdown()
        ended = "shutdown returned"
    except Exception as exc:
        ended = f"{type(exc).__name__}: {exc}"
    report(shared, rank, lambda: {"first": first, "shutdown": ended} if rank == 0 else {"shutdown": ended})


def test_a_worker_that_died_before_any_link_to_it_fails_the_first_call_and_shutdown_naming_it(
    tmp_path: Path,
) -> None:
    """No link to worker2 was ever made when it died, so no connection closing tells anyone: the
    first call to it fails once it has not answered the link's set-up within the liveness bound,
    and graceful shutdown (whose leader reaches every follower) fails naming it rather than waiting."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        shared = {"results": ctx.Queue(), "gone": manager.Event()}
        args = [(rank, str(tmp_path / "init"), shared) for rank in range(3)]
        got = run_world(ctx, _dies_before_any_link, args, shared, WORLD_TIMEOUT, reporting=[0, 1])
    print(got)
    first = got[0]["first"]
    assert first.startswith("WorkerUnavailableError: worker 'worker2' (rank 2) is unavailable"), first
    assert "did not answer this worker's connection" in first, first
    for rank in (0, 1):
        ended = got[rank]["shutdown"]
        assert ended.startswith("WorkerUnavailableError") and "worker2" in ended, ended
