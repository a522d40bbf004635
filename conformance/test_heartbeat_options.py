"""A stopped peer is declared dead by the caller's own heartbeat options (ERR-7), on both of twinrpc's
worlds: SIGSTOP/SIGCONT of the peer's process on gloo, ``Simulation.pause`` on sim (virtual time).

The callee stops its own process from inside a call for ``STOP`` seconds; the caller's options decide
whether that silence is a death (``heartbeat_interval * heartbeat_misses`` < ``STOP``) or only a delay
(``heartbeat_interval=0``: no heartbeat, no silence detection).
"""

from __future__ import annotations

import operator
import os
import subprocess
import time
from typing import Any

import pytest

#: how long the callee's process is stopped (seconds)
STOP = 6.0
#: the heartbeat options under test: a 1 s bound, well under STOP and well over a loaded machine's hiccup
INTERVAL, MISSES = 0.2, 5


def _now(backend: str) -> float:
    if backend == "sim":
        from twinrpc.simulator import now

        return now()
    return time.monotonic()


def _stop_for(backend: str, rank: int, seconds: float) -> str:
    """Stop this worker's whole process (every thread: its heartbeats too) for ``seconds``, then go on."""
    if backend == "sim":
        from twinrpc.simulator import current

        sim = current()
        assert sim is not None
        sim.pause(rank, seconds)  # called from the paused worker's own task: returns after the pause
    else:
        # One shell outside this process sends both signals, SIGSTOP then SIGCONT ``seconds`` later,
        # while this thread waits for it: the last signal the process gets is always the SIGCONT. (A
        # process that stops itself in a loop until a deadline can stop again after the shell's SIGCONT,
        # if that SIGCONT lands between its deadline check and its kill, and then never wakes.)
        pid = os.getpid()
        subprocess.run(["sh", "-c", f"kill -STOP {pid}; sleep {seconds}; kill -CONT {pid}"], check=True)
    return "resumed"


def _call_a_peer_that_stops(ctx: Any, interval: float, misses: int) -> Any:
    """Rank 0 calls rank 1 (no timeout); the call stops rank 1's process for STOP seconds."""
    ctx.init_rpc(heartbeat_interval=interval, heartbeat_misses=misses)
    rpc, backend = ctx.rpc, ctx.backend
    assert rpc.rpc_sync(ctx.name(1 - ctx.rank), operator.add, args=(1, 2)) == 3  # both links are up
    if ctx.rank == 1:
        ctx.sleep(STOP + 4.0)  # stopped for STOP s of it by rank 0's call; the caller is done after
        rpc.shutdown(graceful=False)
        return None
    start = _now(backend)
    fut = rpc.rpc_async(ctx.name(1), _stop_for, args=(backend, 1, STOP), timeout=0)
    try:
        out: dict[str, Any] = {"value": fut.wait(), "raised": None}
    except Exception as exc:
        out = {"raised": type(exc).__name__, "message": str(exc)}
    out["elapsed"] = _now(backend) - start
    ctx.sleep(STOP + 5.0 - out["elapsed"])  # rank 1 resumed and left first
    rpc.shutdown(graceful=False)
    return out


@pytest.mark.spec("ERR-7")
@pytest.mark.backends("sim", "gloo")
def test_a_stopped_peer_is_declared_dead_after_the_callers_heartbeat_bound(world: Any) -> None:
    """Heartbeat options are twinrpc's own (TensorPipe has no heartbeat: there a call to a stopped
    peer ends at its RPC timeout, or never with ``timeout=0``)."""
    got = world.spawn(_call_a_peer_that_stops, INTERVAL, MISSES, world_size=2)[0]
    print(f"pending call: {got['raised']} after {got['elapsed']:.3f} s")
    assert got["raised"] == "WorkerUnavailableError", got
    assert "'worker1'" in got["message"] and "no frame or heartbeat from it for" in got["message"]
    assert "heartbeat_interval x heartbeat_misses" in got["message"]
    # Declared after the 1 s bound (virtual: exactly; gloo: within its next heartbeat ticks), long
    # before the peer resumes.
    assert INTERVAL * MISSES <= got["elapsed"] < STOP - 2.0, got


@pytest.mark.spec("ERR-7")
@pytest.mark.backends("sim", "gloo")
def test_with_heartbeats_off_a_stopped_peer_only_delays_the_call(world: Any) -> None:
    """Heartbeat options are twinrpc's own (TensorPipe has no heartbeat to turn off)."""
    got = world.spawn(_call_a_peer_that_stops, 0.0, MISSES, world_size=2)[0]
    print(f"pending call: {got['raised']} after {got['elapsed']:.3f} s")
    assert got["raised"] is None and got["value"] == "resumed", got
    assert got["elapsed"] >= STOP - 0.5, got
