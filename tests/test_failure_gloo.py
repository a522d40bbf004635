"""The gloo world under failures it cannot see as a closed connection (multiprocess, wall-clock).

* A peer that stops without closing its sockets (SIGSTOP: a hung or partitioned host) is declared dead
  by the heartbeat (ERR-7), while a peer busy in a long user function is not.
* Malformed and truncated frames are rejected (logged, naming the peer) and the receiver keeps going.

Each test starts its own small world in fresh ``spawn`` processes; every wait is bounded, and the
processes are SIGKILLed at the end whatever happened.
"""

from __future__ import annotations

import logging
import multiprocessing
import operator
import os
import queue
import signal
import struct
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

#: generous bound on every failure the tests measure (the measured values are printed)
BOUND = 10.0
#: wall-clock bound of one whole world (process start-up included; the host may be loaded)
WORLD_TIMEOUT = 120.0
#: heartbeat settings of these worlds: a stopped peer is declared dead after ~1 s of silence
INTERVAL, MISSES = 0.2, 5


def _init(rank: int, world_size: int, init_file: str) -> Any:
    import twinrpc.rpc as rpc

    options = rpc.RpcBackendOptions(
        init_method=f"file://{init_file}", heartbeat_interval=INTERVAL, heartbeat_misses=MISSES
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    return rpc


def _child(program: Any, rank: int, world_size: int, init_file: str, shared: dict[str, Any]) -> None:
    try:
        value = program(rank, world_size, init_file, shared)
    except BaseException as exc:
        shared["results"].put((rank, "raised", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    else:
        shared["results"].put((rank, "ok", value))
    shared["results"].close()
    shared["results"].join_thread()  # flush the queue's feeder thread before exiting hard
    os._exit(0)


def _run_world(
    program: Any,
    world_size: int,
    tmp_path: Path,
    *,
    reporting: list[int] | None = None,
    started: Any = None,
    **extra: Any,
) -> dict[int, Any]:
    """Run ``program(rank, world_size, init_file, shared)`` in ``world_size`` fresh processes and
    collect the results of the ``reporting`` ranks (default all); ``started(procs)`` is called once
    the processes run. Every process is SIGKILLed at the end."""
    mp = multiprocessing.get_context("spawn")
    shared: dict[str, Any] = {"results": mp.Queue(), "pids": mp.Queue(), **extra}
    init_file = str(tmp_path / "rendezvous")
    procs = [
        mp.Process(target=_child, args=(program, r, world_size, init_file, shared), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    if started is not None:
        started(procs)
    out: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + WORLD_TIMEOUT
        wanted = set(reporting if reporting is not None else range(world_size))
        while not wanted <= set(out):
            try:
                rank, status, value = shared["results"].get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the world did not finish within {WORLD_TIMEOUT} s; results so far: {out!r}")
            if status != "ok":
                pytest.fail(f"rank {rank} raised:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
            p.join(5)
    return out


# ---------------------------------------------------------------------------------------------------
# A stopped peer (heartbeat)
# ---------------------------------------------------------------------------------------------------
def _spin(seconds: float) -> str:
    """A user function that keeps its worker busy (pure Python, holding the GIL between switches)."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return "done"


def _timed(thunk: Any) -> tuple[str | None, str, float]:
    start = time.monotonic()
    try:
        thunk()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def _stopped_peer_program(rank: int, world_size: int, init_file: str, shared: dict[str, Any]) -> Any:
    rpc = _init(rank, world_size, init_file)
    if rank == 1:
        time.sleep(WORLD_TIMEOUT)  # SIGSTOPped in here by the test (not in an Event.wait: a stopped
        return "slept"  # waiter would block the Event's set() in the other processes)
    if rank == 2:
        shared["done"].wait(WORLD_TIMEOUT)
        rpc.shutdown(graceful=False)
        return "left"
    result: dict[str, Any] = {}
    # A peer busy for 5 heartbeat thresholds in a user function is alive: the call succeeds.
    start = time.monotonic()
    result["busy_call"] = (rpc.rpc_sync("worker1", _spin, args=(5 * INTERVAL * MISSES,), timeout=0),)
    result["busy_elapsed"] = time.monotonic() - start
    fut = rpc.rpc_async("worker1", time.sleep, args=(60.0,), timeout=0)  # only the death can end it
    time.sleep(0.3)  # the request is running on worker1
    shared["stop_rank1"].set()
    shared["rank1_stopped"].wait(WORLD_TIMEOUT)
    result["pending"] = _timed(fut.wait)
    result["later"] = _timed(lambda: rpc.rpc_sync("worker1", operator.add, args=(1, 2)))
    result["other_peer"] = rpc.rpc_sync("worker2", operator.add, args=(1, 2))
    shared["done"].set()
    result["local_shutdown"] = _timed(lambda: rpc.shutdown(graceful=False))
    return result


def test_a_stopped_peer_is_declared_dead_by_the_heartbeat_but_a_busy_one_is_not(tmp_path: Path) -> None:
    mp = multiprocessing.get_context("spawn")
    stop_rank1, rank1_stopped, done = mp.Event(), mp.Event(), mp.Event()

    def operator(procs: list[Any]) -> None:
        """The test process plays the operator: it SIGSTOPs rank 1 when rank 0 asks."""

        def act() -> None:
            if stop_rank1.wait(WORLD_TIMEOUT):
                os.kill(procs[1].pid, signal.SIGSTOP)
                rank1_stopped.set()

        threading.Thread(target=act, daemon=True).start()

    results = _run_world(
        _stopped_peer_program,
        3,
        tmp_path,
        reporting=[0],
        started=operator,
        stop_rank1=stop_rank1,
        rank1_stopped=rank1_stopped,
        done=done,
    )[0]
    print(
        f"busy call ({5 * INTERVAL * MISSES:.1f} s of user code) returned after {results['busy_elapsed']:.2f} s"
    )
    assert results["busy_call"] == ("done",)
    for what in ("pending", "later"):
        name, message, elapsed = results[what]
        print(f"{what}: {name} after {elapsed:.3f} s: {message[:160]}")
        assert name == "WorkerUnavailableError", (what, name, message)
        assert "'worker1'" in message and "heartbeat" in message, message
        assert elapsed < BOUND
    assert results["other_peer"] == 3
    name, message, elapsed = results["local_shutdown"]
    print(f"shutdown(graceful=False) returned after {elapsed:.3f} s")
    assert name is None, message
    assert elapsed < BOUND


# ---------------------------------------------------------------------------------------------------
# Malformed frames
# ---------------------------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


_RECORDS = _Records()


def _report() -> tuple[int, list[str]]:
    """On worker1: how many frames its link from worker0 rejected, and what it logged."""
    from twinrpc._current import current_agent

    link = current_agent().world.links[0]  # type: ignore[attr-defined]
    return link.bad_frames, list(_RECORDS.lines)


def _bad_frames() -> list[tuple[str, Any]]:
    """Frames no twinrpc sender produces, each at most one header long (see the note below)."""
    import torch

    from impl._framing import HEADER_BYTES, MAGIC, VERSION, encode_header, new_header_tensor
    from twinrpc._message import Kind, Message

    def header(kind: int = int(Kind.CALL), src: int = 0) -> Any:
        t, view = new_header_tensor()
        encode_header(view, Message(Kind.CALL, 7, 0, 1, b"x"))
        struct.pack_into("<H", view, 8, kind)
        struct.pack_into("<i", view, 12, src)
        return t

    short = torch.zeros(6, dtype=torch.uint8)
    struct.pack_into("<IH", memoryview(short.numpy()), 0, MAGIC, VERSION)  # type: ignore[arg-type]
    return [
        ("10 bytes of garbage", torch.full((10,), 0xAB, dtype=torch.uint8)),
        ("a header-sized frame of garbage", torch.full((HEADER_BYTES,), 0x5A, dtype=torch.uint8)),
        ("a header cut after its version field", short),
        ("a header claiming another source rank", header(src=5)),
        ("a header with an unknown message kind", header(kind=999)),
    ]


def _frames_program(rank: int, world_size: int, init_file: str, shared: dict[str, Any]) -> Any:
    logging.getLogger("twinrpc.impl").addHandler(_RECORDS)
    rpc = _init(rank, world_size, init_file)
    if rank == 1:
        shared["done"].wait(WORLD_TIMEOUT)
        rpc.shutdown()
        return "served"
    from impl._link import _TAG
    from twinrpc._current import current_agent

    link = current_agent().world.links[1]  # type: ignore[attr-defined]
    assert rpc.rpc_sync("worker1", operator.add, args=(1, 1)) == 2
    frames = _bad_frames()
    with link._send_lock:  # test-only injection: raw frames on the pair's own process group
        for _, t in frames:
            link.pg.send([t], link._peer_rank_in_pg, _TAG).wait()
    after = [rpc.rpc_sync("worker1", operator.add, args=(i, 1)) for i in range(3)]
    bad, logged = rpc.rpc_sync("worker1", _report)
    shared["done"].set()
    rpc.shutdown()
    return {"sent": [what for what, _ in frames], "after": after, "bad": bad, "logged": logged}


def test_malformed_frames_are_rejected_and_the_link_keeps_working(tmp_path: Path) -> None:
    """Each bad frame is logged as an error naming the sending worker and dropped; later messages on
    the same link work and the world shuts down gracefully.

    Not covered, because gloo cannot survive it: a frame LONGER than the receive posted for it aborts
    the receiving process inside gloo (``op.preamble.length <= op.nbytes`` enforce failure on its IO
    thread, then std::terminate; measured on torch 2.13), before Python sees anything. twinrpc's own
    senders never send one: every header frame is exactly HEADER_BYTES.
    """
    mp = multiprocessing.get_context("spawn")
    got = _run_world(_frames_program, 2, tmp_path, reporting=[0, 1], done=mp.Event())
    result = got[0]
    assert got[1] == "served"
    assert result["after"] == [1, 2, 3]
    print(f"rejected {result['bad']} bad frames; logged:\n  " + "\n  ".join(result["logged"]))
    assert result["bad"] == len(result["sent"]) == 5
    rejections = [line for line in result["logged"] if "rejected a malformed frame" in line]
    assert len(rejections) == 5, result["logged"]
    assert all("'worker0' (rank 0)" in line for line in rejections), rejections
