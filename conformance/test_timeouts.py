"""RPC timeouts: per-call, default, timeout=0, late responses, ``to_here(timeout)`` (ERR-4, ERR-6, LIFE-7).

User functions sleep through :func:`_sleep`, which uses the simulator's virtual clock on ``sim`` and the
wall clock elsewhere, so the same durations mean the same thing on every backend. Sleeps are short
(<= 1 s). Every test that lets a call time out waits until the slow remote call has finished before it
returns, so no late work spills into the next test of a reused world.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance._support import backend_sleep, slow_echo

TIMEOUT_FRAGMENT = "RPC ran for more than"


_sleep = backend_sleep


_slow_echo = slow_echo


_FINISHED: list[Any] = []


def _slow_record(backend: str, seconds: float, value: Any) -> Any:
    _sleep(backend, seconds)
    _FINISHED.append(value)
    return value


def _finished() -> list[Any]:
    return list(_FINISHED)


def _describe(exc: BaseException) -> tuple[str, bool, str]:
    return (type(exc).__name__, isinstance(exc, RuntimeError), str(exc))


def _outcome(thunk: Any) -> tuple[str, Any]:
    try:
        return ("ok", thunk())
    except Exception as exc:
        return ("error", _describe(exc))


# ---------------------------------------------------------------------------------------------------
# Worker programs
# ---------------------------------------------------------------------------------------------------


def _prog_call_with_short_timeout(ctx: Any, mode: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if mode == "rpc_sync":
        out["call"] = _outcome(
            lambda: ctx.rpc.rpc_sync("worker1", _slow_echo, args=(ctx.backend, 0.6, 1), timeout=0.2)
        )
    else:
        fut = _outcome(
            lambda: ctx.rpc.rpc_async("worker1", _slow_echo, args=(ctx.backend, 0.6, 1), timeout=0.2)
        )
        out["issue"] = fut[0]
        out["call"] = _outcome(lambda: fut[1].wait()) if fut[0] == "ok" else fut
    ctx.sleep(0.6)  # let the slow call finish remotely before the next test
    return out


def _prog_late_response_dropped(ctx: Any) -> dict[str, Any]:
    fut = ctx.rpc.rpc_async("worker1", _slow_echo, args=(ctx.backend, 0.5, "late"), timeout=0.1)
    first = _outcome(fut.wait)
    ctx.sleep(0.8)  # the late response arrives in here and must be dropped
    return {
        "first": first,
        "again": _outcome(fut.wait),
        "after": [ctx.rpc.rpc_sync("worker1", _slow_echo, args=(ctx.backend, 0, i)) for i in range(3)],
        "self_after": ctx.rpc.rpc_sync("worker0", _slow_echo, args=(ctx.backend, 0, "me")),
    }


def _prog_timeout_does_not_cancel(ctx: Any, token: str) -> dict[str, Any]:
    call = _outcome(
        lambda: ctx.rpc.rpc_sync("worker1", _slow_record, args=(ctx.backend, 0.4, token), timeout=0.1)
    )
    # The 0.4 s call keeps running on the callee after our timeout; poll (bounded) rather than guess
    # how long it takes on a loaded machine.
    finished: list[Any] = []
    for _ in range(100):
        ctx.sleep(0.1)
        finished = ctx.rpc.rpc_sync("worker1", _finished)
        if token in finished:
            break
    return {"call": call, "finished": finished}


def _prog_to_here_timeout(ctx: Any) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _slow_echo, args=(ctx.backend, 0.6, {"v": 7}))
    first = _outcome(lambda: rref.to_here(timeout=0.1))
    return {
        "first": first,
        "retry": _outcome(lambda: rref.to_here(timeout=5)),
        "retry_default": _outcome(rref.to_here),
    }


def _prog_default_timeout(ctx: Any) -> dict[str, Any]:
    return {"default": ctx.rpc.get_rpc_timeout()}


def _prog_options_timeout(ctx: Any) -> dict[str, Any]:
    # torch also uses rpc_timeout as its store timeout (the shutdown barrier), so keep it >= 1 s.
    ctx.init_rpc(rpc_timeout=1.0)
    out: dict[str, Any] = {"timeout": ctx.rpc.get_rpc_timeout()}
    if ctx.rank == 0:
        out["default_call"] = _outcome(
            lambda: ctx.rpc.rpc_sync("worker1", _slow_echo, args=(ctx.backend, 1.5, 1))
        )
        out["explicit_long"] = _outcome(
            lambda: ctx.rpc.rpc_sync("worker1", _slow_echo, args=(ctx.backend, 1.5, 2), timeout=5)
        )
        out["quick"] = _outcome(lambda: ctx.rpc.rpc_sync("worker1", _slow_echo, args=(ctx.backend, 0, 3)))
    ctx.rpc.shutdown()
    return out


def _prog_zero_timeout(ctx: Any) -> dict[str, Any]:
    previous = ctx.rpc.get_rpc_timeout()
    ctx.rpc._set_rpc_timeout(0.3)
    try:
        out = {
            "sync": _outcome(
                lambda: ctx.rpc.rpc_sync("worker1", _slow_echo, args=(ctx.backend, 0.8, "s"), timeout=0)
            )
        }
        fut = ctx.rpc.rpc_async("worker1", _slow_echo, args=(ctx.backend, 0.8, "a"), timeout=0)
        out["async"] = _outcome(fut.wait)
        rref = ctx.rpc.remote("worker1", _slow_echo, args=(ctx.backend, 0.8, "r"), timeout=0)
        out["to_here"] = _outcome(lambda: rref.to_here(timeout=0))
        # Control: the same call with the (short) default does time out.
        out["default"] = _outcome(
            lambda: ctx.rpc.rpc_sync("worker1", _slow_echo, args=(ctx.backend, 0.8, "d"))
        )
        ctx.sleep(0.6)
    finally:
        ctx.rpc._set_rpc_timeout(previous)
    return out


def _prog_set_rpc_timeout(ctx: Any) -> dict[str, Any]:
    previous = ctx.rpc.get_rpc_timeout()
    ctx.rpc._set_rpc_timeout(0.3)
    try:
        out: dict[str, Any] = {}
        early = ctx.rpc.rpc_async("worker1", _slow_echo, args=(ctx.backend, 0.8, "early"))
        ctx.rpc._set_rpc_timeout(5.0)
        out["timeout_after_set"] = ctx.rpc.get_rpc_timeout()
        out["early"] = _outcome(early.wait)  # took the default at call time: 0.3 s
        out["later"] = _outcome(
            lambda: ctx.rpc.rpc_sync("worker1", _slow_echo, args=(ctx.backend, 0.8, "later"))
        )
        ctx.rpc._set_rpc_timeout(0.3)
        out["shortened"] = _outcome(
            lambda: ctx.rpc.rpc_sync("worker1", _slow_echo, args=(ctx.backend, 0.8, "short"))
        )
        ctx.sleep(0.6)
    finally:
        ctx.rpc._set_rpc_timeout(previous)
    out["restored"] = ctx.rpc.get_rpc_timeout()
    return out


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


def _assert_timed_out(outcome: tuple[str, Any]) -> None:
    kind, detail = outcome
    assert kind == "error", outcome
    _name, is_runtime_error, message = detail
    assert is_runtime_error, outcome
    assert TIMEOUT_FRAGMENT in message, outcome


@pytest.mark.spec("ERR-4")
@pytest.mark.parametrize("mode", ["rpc_sync", "rpc_async"])
def test_call_slower_than_its_timeout_fails_with_rpc_ran_for_more_than(world, mode):
    got = world.run_on(0, _prog_call_with_short_timeout, mode)
    if mode == "rpc_async":
        assert got["issue"] == "ok", "rpc_async itself must not raise; the timeout is reported by the future"
    _assert_timed_out(got["call"])


@pytest.mark.spec("ERR-4")
def test_late_response_after_timeout_is_dropped_and_world_keeps_working(world):
    got = world.run_on(0, _prog_late_response_dropped)
    _assert_timed_out(got["first"])
    # The future stays failed: the late value never replaces the timeout error.
    _assert_timed_out(got["again"])
    assert got["after"] == [0, 1, 2]
    assert got["self_after"] == "me"


@pytest.mark.spec("ERR-4")
def test_timed_out_call_still_runs_to_completion_on_the_callee(world):
    token = "not-cancelled-token"
    got = world.run_on(0, _prog_timeout_does_not_cancel, token)
    _assert_timed_out(got["call"])
    assert token in got["finished"]


@pytest.mark.spec("ERR-6", "RREF-4")
def test_to_here_timeout_fails_only_that_fetch_and_can_be_retried(world):
    got = world.run_on(0, _prog_to_here_timeout)
    _assert_timed_out(got["first"])
    assert got["retry"] == ("ok", {"v": 7})
    assert got["retry_default"] == ("ok", {"v": 7})


@pytest.mark.spec("LIFE-7", "ERR-4")
def test_default_rpc_timeout_is_60_seconds(world):
    assert world.run(_prog_default_timeout) == [{"default": 60.0}, {"default": 60.0}]


@pytest.mark.spec("LIFE-7", "ERR-4")
def test_rpc_timeout_option_sets_the_default_timeout(world):
    got = world.spawn(_prog_options_timeout)
    assert got[1] == {"timeout": 1.0}
    assert got[0]["timeout"] == 1.0
    _assert_timed_out(got[0]["default_call"])
    assert got[0]["explicit_long"] == ("ok", 2)
    assert got[0]["quick"] == ("ok", 3)


@pytest.mark.spec("ERR-4")
def test_zero_timeout_never_expires(world):
    got = world.run_on(0, _prog_zero_timeout)
    assert got["sync"] == ("ok", "s")
    assert got["async"] == ("ok", "a")
    assert got["to_here"] == ("ok", "r")
    _assert_timed_out(got["default"])


@pytest.mark.spec("ERR-4", "LIFE-7")
def test_set_rpc_timeout_applies_only_to_later_calls(world):
    got = world.run_on(0, _prog_set_rpc_timeout)
    assert got["timeout_after_set"] == 5.0
    assert got["restored"] == 60.0
    _assert_timed_out(got["early"])
    assert got["later"] == ("ok", "later")
    _assert_timed_out(got["shortened"])
