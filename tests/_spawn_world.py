"""Small worlds of fresh ``spawn`` processes, for tests that need workers in processes of their own.

Each process runs a program and reports what it returned, or what it raised, through the queue
``shared["results"]``; :func:`run_world` collects the reports and SIGKILLs every process at the end
whatever happened. :func:`bad_peer_world` is the three-worker scene of the tests in which one peer
sends a frame it should not: the others must see that link fail, and only that link.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import pytest


def report(shared: dict[str, Any], rank: int, program: Callable[..., Any], *args: Any) -> NoReturn:
    """In a child: run ``program(*args)``, put ``(rank, "ok", value)`` or ``(rank, "raised", text)``
    on ``shared["results"]`` and exit at once (a world's threads may still be running)."""
    try:
        value = program(*args)
    except BaseException as exc:
        shared["results"].put((rank, "raised", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    else:
        shared["results"].put((rank, "ok", value))
    shared["results"].close()
    shared["results"].join_thread()  # flush the queue's feeder thread before exiting hard
    os._exit(0)


def run_world(
    ctx: Any,
    target: Callable[..., None],
    args_per_rank: list[tuple[Any, ...]],
    shared: dict[str, Any],
    timeout: float,
    *,
    reporting: list[int] | None = None,
    started: Callable[[list[Any]], None] | None = None,
) -> dict[int, Any]:
    """Start ``target(*args)`` in one ``ctx`` process per entry of ``args_per_rank`` (``target``
    calls :func:`report`), and collect the reports of the ``reporting`` ranks (default all);
    ``started(procs)`` is called once they run. A rank that raised, or a world that does not finish
    within ``timeout`` seconds, fails the test. Every process is SIGKILLed at the end."""
    procs = [ctx.Process(target=target, args=args, daemon=True) for args in args_per_rank]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        if started is not None:  # inside: whatever it raises, every process is killed
            started(procs)
        deadline = time.monotonic() + timeout
        wanted = set(reporting if reporting is not None else range(len(procs)))
        while not wanted <= set(out):
            try:
                rank, status, value = shared["results"].get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the world did not finish within {timeout} s; results so far: {out!r}")
            if status != "ok":
                pytest.fail(f"rank {rank} raised:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):  # it may exit meanwhile
                    os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    return out


def preloaded_context() -> Any:
    """Worker processes forked from a server that imported torch and twinrpc once (a new interpreter
    importing torch takes seconds of CPU; each process still starts with no world and no threads)."""
    import multiprocessing

    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(["torch", "twinrpc.rpc", "twinrpc.impl"])
    return mp


def _keyed_child(program: Any, rank: int, key: str | None, init_file: str, shared: dict[str, Any]) -> None:
    if key is None:
        os.environ.pop("TWINRPC_AUTH_KEY", None)
    else:
        os.environ["TWINRPC_AUTH_KEY"] = key
    report(shared, rank, program, rank, init_file, shared)


def run_keyed_world(
    program: Callable[..., Any],
    keys: list[str | None],
    init_file: str,
    timeout: float,
    *,
    started: Callable[[list[Any]], None] | None = None,
    **extra: Any,
) -> dict[int, Any]:
    """Run ``program(rank, init_file, shared)`` on one fresh process (of :func:`preloaded_context`)
    per key, ``TWINRPC_AUTH_KEY`` set to it (or unset for None); every rank's result, as
    :func:`run_world` (``started`` too). ``shared`` holds ``extra`` and the results' queue."""
    mp = preloaded_context()
    shared: dict[str, Any] = {"results": mp.Queue(), **extra}
    args = [(program, r, key, init_file, shared) for r, key in enumerate(keys)]
    return run_world(mp, _keyed_child, args, shared, timeout, started=started)


def bad_peer_world(
    rank: int, shared: dict[str, Any], send_bad_frame: Callable[[Any], None], wait: float
) -> Any:
    """After ``init_rpc`` in a world of three: worker0 makes one good call to worker1, then sends it
    a bad frame with ``send_bad_frame(its link to worker1)``; worker2 idles. Worker1 calls worker0
    until that fails (30 s at most), then calls worker2, and returns ``{"error": the failure's text,
    "other": worker2's answer to 2 + 1, "bad": frames its link to worker0 rejected}``; worker0 waits
    for its link to worker1 to fail, calls worker1 and returns ``{"error": what that call raised}``. ``shared``
    holds the events ``sent`` and ``done``; ``wait`` bounds each wait for them."""
    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent

    if rank == 0:
        assert rpc.rpc_sync("worker1", operator.add, args=(1, 1)) == 2  # makes the link (first use)
        link = current_agent().world.links[1]  # type: ignore[attr-defined]
        send_bad_frame(link)
        shared["sent"].set()
        deadline = time.monotonic() + wait
        while link.failed is None and time.monotonic() < deadline:  # worker1 closes the link
            time.sleep(0.01)
        try:
            rpc.rpc_sync("worker1", operator.add, args=(1, 1), timeout=5)
            seen = "the call to worker1 succeeded"
        except Exception as exc:
            seen = f"{type(exc).__name__}: {exc}"
        shared["done"].wait(wait)
        rpc.shutdown(graceful=False)
        return {"error": seen}
    shared["sent"].wait(wait)
    if rank == 2:
        shared["done"].wait(wait)
        rpc.shutdown(graceful=False)
        return "idle"
    error = ""
    deadline = time.monotonic() + 30
    while not error and time.monotonic() < deadline:
        try:
            rpc.rpc_sync("worker0", operator.add, args=(1, 1), timeout=5)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    other = rpc.rpc_sync("worker2", operator.add, args=(2, 1))
    bad = current_agent().world.links[0].bad_frames  # type: ignore[attr-defined]
    shared["done"].set()
    rpc.shutdown(graceful=False)
    return {"error": error, "other": other, "bad": bad}


def run_barrier_world(
    child: Callable[..., None],
    size: int,
    timeout: float,
    *extra: Any,
    reporting: list[int] | None = None,
) -> dict[int, Any]:
    """:func:`run_world` of ``size`` ``spawn`` processes over a TCPStore on a free port, each
    running ``child(rank, port, barrier, event, *extra, shared)``: ``barrier`` is a manager's
    Barrier of all of them, ``event`` a manager's Event they share."""
    import multiprocessing

    from _launch import free_port

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        shared = {"results": ctx.Queue()}
        barrier, event = manager.Barrier(size), manager.Event()
        port = free_port()
        args = [(rank, port, barrier, event, *extra, shared) for rank in range(size)]
        return run_world(ctx, child, args, shared, timeout, reporting=reporting)


def process_threads() -> collections.Counter[str]:
    """This process's threads, by their kernel name (gloo names its own: gloo_tcp_loop, ...)."""
    out: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="ascii", errors="replace") as f:
                out[f.read().strip()] += 1
        except OSError:
            continue  # exited meanwhile
    return out


def process_descriptors() -> collections.Counter[str]:
    """This process's open descriptors, by kind ('socket', 'pipe', 'anon_inode', or the file)."""
    out: collections.Counter[str] = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[os.readlink(f"/proc/self/fd/{fd}").split(":")[0]] += 1
        except OSError:
            continue  # the listing's own descriptor
    return out


def held_before_rpc(
    barrier: Any, timeout: float
) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """In a child, before ``init_rpc``: start what a process opens once and keeps (torch's lazily
    started threads, the ``barrier``'s connection to its manager, libuv's once-per-process signal
    pipe, which the first store server opens), turn garbage collection off (what holds a thread or a
    descriptor past shutdown must not be let go by a collection), and count threads and descriptors
    (see held_after_rpc). Waits on ``barrier`` once."""
    import gc

    import torch

    torch.set_num_threads(1)
    torch.add(torch.ones(1), 1)
    barrier.wait(timeout)
    torch.distributed.TCPStore("127.0.0.1", 0, 1, True)  # type: ignore[attr-defined]
    gc.disable()
    return process_threads(), process_descriptors()


def held_after_rpc(
    before: tuple[collections.Counter[str], collections.Counter[str]],
) -> dict[str, dict[str, int]]:
    """After ``shutdown()``: the threads and descriptors held beyond ``before`` (held_before_rpc), as
    ``threads_left`` and ``descriptors_left``. A joined thread's kernel task goes a moment after
    join() returns: that moment is allowed, no more."""
    threads, descriptors = before
    settle = time.monotonic() + 2.0
    while (process_threads() - threads or process_descriptors() - descriptors) and time.monotonic() < settle:
        time.sleep(0.05)
    return {
        "threads_left": dict(process_threads() - threads),
        "descriptors_left": dict(process_descriptors() - descriptors),
    }
