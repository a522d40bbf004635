"""Shutdown: graceful shutdown is a barrier that drains work; non-graceful is local; afterwards (SHUT-*).

Every test spawns a fresh world. Worker-side sleeps go through ``ctx.sleep`` in programs and
:func:`_sleep` in user functions, so they are virtual on the simulator and short (<= 1 s) elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance._support import backend_sleep, outcome, rpc_module, slow_echo

NOT_INITIALIZED = "RPC has not been initialized"


_rpc_module = rpc_module


_sleep = backend_sleep


def _noop() -> str:
    return "pong"


_slow_echo = slow_echo


_RECORDED: list[Any] = []


def _record_later(backend: str, seconds: float, value: Any) -> None:
    _sleep(backend, seconds)
    _RECORDED.append(value)


def _fire_and_forget_to_worker0(backend: str, seconds: float, value: Any) -> str:
    """Runs on worker1: starts an RPC back to worker0 and returns without waiting for it."""
    _rpc_module(backend).rpc_async("worker0", _record_later, args=(backend, seconds, value))
    return "started"


def _nested_back_to_worker0(backend: str, seconds: float, value: int) -> int:
    return _rpc_module(backend).rpc_sync("worker0", _slow_echo, args=(backend, seconds, value)) + 1


def _make_list(n: int) -> list[int]:
    return list(range(n))


_outcome = outcome


# ---------------------------------------------------------------------------------------------------
# Worker programs
# ---------------------------------------------------------------------------------------------------


def _prog_one_slow_rank(ctx: Any, slow_rank: int) -> dict[str, Any]:
    """Every rank but ``slow_rank`` shuts down at once; ``slow_rank`` first sleeps, then calls everyone."""
    ctx.init_rpc()
    out: dict[str, Any] = {}
    if ctx.rank == slow_rank:
        ctx.sleep(1.0)
        out["late_calls"] = [
            _outcome(lambda r=r: ctx.rpc.rpc_sync(ctx.name(r), _noop))
            for r in range(ctx.world_size)
            if r != slow_rank
        ]
    ctx.rpc.shutdown()
    out["shutdown"] = "returned"
    return out


def _prog_outstanding_futures(ctx: Any) -> dict[str, Any]:
    ctx.init_rpc()
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        seen: list[Any] = []
        futs = [
            ctx.rpc.rpc_async("worker1", _slow_echo, args=(ctx.backend, 0.3 * (i + 1), i)) for i in range(3)
        ]
        for fut in futs:
            fut.add_done_callback(lambda f: seen.append(f.value()))
        ctx.rpc.shutdown()
        out["done"] = [f.done() for f in futs]
        out["seen"] = sorted(seen)
    else:
        ctx.rpc.shutdown()
    return out


def _prog_nested_work_drains(ctx: Any) -> dict[str, Any]:
    ctx.init_rpc()
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        _RECORDED.clear()
        nested = ctx.rpc.rpc_async("worker1", _nested_back_to_worker0, args=(ctx.backend, 0.4, 10))
        seen: list[Any] = []
        nested.add_done_callback(lambda f: seen.append(f.value()))
        started = ctx.rpc.rpc_sync(
            "worker1", _fire_and_forget_to_worker0, args=(ctx.backend, 0.5, "late-write")
        )
        ctx.rpc.shutdown()
        out = {"started": started, "nested": (nested.done(), seen), "recorded": list(_RECORDED)}
    else:
        ctx.rpc.shutdown()
    return out


def _prog_nongraceful(ctx: Any) -> dict[str, Any]:
    ctx.init_rpc()
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        ctx.sleep(0.2)
        out["shutdown"] = _outcome(lambda: ctx.rpc.shutdown(graceful=False))
        out["after"] = _outcome(lambda: ctx.rpc.rpc_sync("worker1", _noop))
    else:
        # Keep calling worker0 until it is gone; worker1 itself never shuts down before that, so
        # worker0's shutdown(graceful=False) cannot have waited for it. Bounded: 40 x 0.1 s.
        answers = []
        for _ in range(40):
            got = _outcome(lambda: ctx.rpc.rpc_sync("worker0", _noop, timeout=2))
            answers.append(got[0])
            if got[0] != "ok":
                out["failure"] = got
                break
            ctx.sleep(0.1)
        out["answers_before_failure"] = answers.count("ok")
        out["shutdown"] = _outcome(lambda: ctx.rpc.shutdown(graceful=False))
    return out


def _prog_second_shutdown(ctx: Any, graceful: bool) -> dict[str, Any]:
    ctx.init_rpc()
    ctx.rpc.rpc_sync(ctx.name(1 - ctx.rank), _noop)
    if not graceful:
        # Both ranks must be done calling each other before either leaves without a barrier.
        ctx.rpc.rpc_sync(ctx.name(1 - ctx.rank), _noop)
        ctx.sleep(0.3)
    first = _outcome(lambda: ctx.rpc.shutdown(graceful=graceful))
    second = _outcome(lambda: ctx.rpc.shutdown(graceful=graceful))
    return {"first": first, "second": second}


def _prog_use_rref_after_shutdown(ctx: Any) -> dict[str, Any]:
    ctx.init_rpc()
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        rref = ctx.rpc.remote("worker1", _make_list, args=(3,))
        out["before"] = rref.to_here()
        ctx.rpc.shutdown()
        out["after"] = _outcome(rref.to_here)
    else:
        ctx.rpc.shutdown()
    return out


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


@pytest.mark.spec("SHUT-1")
def test_graceful_shutdown_waits_for_slower_peer(world):
    # worker0 (the leader) calls shutdown at once; worker1 calls it after sleeping and an RPC to worker0.
    got = world.spawn(_prog_one_slow_rank, 1)
    assert got[1]["late_calls"] == [("ok", "pong")]
    assert got[0] == {"shutdown": "returned"}
    assert got[1]["shutdown"] == "returned"


@pytest.mark.spec("SHUT-1")
def test_graceful_shutdown_of_followers_waits_for_slow_leader(world):
    # Here the slow one is worker0, the shutdown leader: worker1 and worker2 must both still serve it.
    got = world.spawn(_prog_one_slow_rank, 0, world_size=3)
    assert got[0]["late_calls"] == [("ok", "pong"), ("ok", "pong")]
    assert [r["shutdown"] for r in got] == ["returned"] * 3


@pytest.mark.spec("SHUT-1")
def test_graceful_shutdown_completes_outstanding_rpc_async_futures(world):
    got = world.spawn(_prog_outstanding_futures)[0]
    assert got == {"done": [True, True, True], "seen": [0, 1, 2]}


@pytest.mark.spec("SHUT-1")
def test_graceful_shutdown_drains_nested_and_fire_and_forget_rpcs(world):
    got = world.spawn(_prog_nested_work_drains)[0]
    assert got["started"] == "started"
    assert got["nested"] == (True, [11])
    # worker1 started this RPC to worker0 without waiting for it; shutdown still let it finish.
    assert got["recorded"] == ["late-write"]


@pytest.mark.spec("SHUT-3")
def test_nongraceful_shutdown_returns_without_waiting_for_peers(world):
    got = world.spawn(_prog_nongraceful)
    assert got[0]["shutdown"] == ("ok", None)
    assert "RuntimeError" in got[0]["after"][0], got[0]
    assert NOT_INITIALIZED in got[0]["after"][1]
    # worker1 saw worker0 answer, then saw it go away, all before worker1 itself shut down.
    assert got[1]["answers_before_failure"] >= 1
    assert "RuntimeError" in got[1]["failure"][0], got[1]
    assert got[1]["shutdown"] == ("ok", None)


@pytest.mark.spec("SHUT-5", "ERR-8")
@pytest.mark.parametrize("graceful", [True, False], ids=["graceful", "nongraceful"])
def test_second_shutdown_raises_not_initialized(world, graceful):
    for result in world.spawn(_prog_second_shutdown, graceful):
        assert result["first"] == ("ok", None)
        kind, message = result["second"]
        assert "RuntimeError" in kind
        assert NOT_INITIALIZED in message


@pytest.mark.spec("SHUT-5", "RREF-D1")
def test_user_rref_to_here_after_graceful_shutdown_raises_deleted(world):
    got = world.spawn(_prog_use_rref_after_shutdown)[0]
    assert got["before"] == [0, 1, 2]
    kind, message = got["after"]
    assert "RuntimeError" in kind
    assert "has been deleted" in message
