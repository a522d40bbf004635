"""RRef lifetimes: forks, deletion, the owner's value, timeouts, debug info and shutdown.

Requirements RREF-1..3, RREF-6, RREF-7, RREF-9, RREF-12, RREF-F1..F3, RREF-D1, ERR-5, ERR-6, SHUT-1 and
SHUT-4. The owner's value is observed through a weak reference the owner-side user function keeps
(values are :class:`Tracked`, a plain class, so the weak reference is to the very object the owner
holds) and through ``_get_debug_info()``, whose RRef keys are the same on every backend. Deletion is
asynchronous (RREF-D1), so "freed" is polled with a bound. Counts are compared as deltas: the torch
backend reuses its worker processes across tests.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from conformance._support import backend_sleep, rpc_module

_POLLS = 100  # x 0.05 s: the bound on waiting for an asynchronous delete to reach the owner


class Tracked:
    """A value whose owner-side object can be watched with a weak reference."""

    def __init__(self, key: str, items: list[int]) -> None:
        self.key = key
        self.items = items

    def get_items(self) -> list[int]:
        return list(self.items)


_rpc = rpc_module


_sleep = backend_sleep


# Per process on torch; keyed by worker name because simulated workers share this module.
_WATCH: dict[tuple[str, str], Any] = {}
_KEEP: dict[str, list[Any]] = {}


def _me(backend: str) -> str:
    return str(_rpc(backend).get_worker_info().name)


def _make_tracked(backend: str, key: str, items: list[int], delay: float = 0.0) -> Tracked:
    if delay:
        _sleep(backend, delay)
    value = Tracked(key, items)
    _WATCH[(_me(backend), key)] = weakref.ref(value)
    return value


def _alive(backend: str, key: str) -> bool:
    ref = _WATCH.get((_me(backend), key))
    return ref is not None and ref() is not None


def _keep(backend: str, rref: Any) -> dict[str, Any]:
    """Keep a received RRef; report what the receiver saw when its function ran (RREF-F3)."""
    _KEEP.setdefault(_me(backend), []).append(rref)
    return {"confirmed": rref.confirmed_by_owner(), "is_owner": rref.is_owner()}


def _release(backend: str) -> None:
    _KEEP.pop(_me(backend), None)


def _kept_values(backend: str) -> list[list[int]]:
    return [r.to_here().items for r in _KEEP.get(_me(backend), [])]


def _forward_and_drop(backend: str, rref: Any, to: str) -> None:
    """Fork ``rref`` on to ``to`` without waiting, and drop this worker's copy at once."""
    _rpc(backend).rpc_async(to, _keep, args=(backend, rref))


def _echo_in_containers(rref: Any) -> tuple[Any, ...]:
    return ({"inner": [rref]}, rref)


def _wrap(rref: Any) -> list[Any]:
    return [rref]


def _rref_counts(rpc: Any) -> dict[str, int]:
    info = rpc._get_debug_info()
    return {k: int(info[k]) for k in ("num_owner_rrefs", "num_forks", "num_pending_users")}


def _remote_counts(backend: str) -> dict[str, int]:
    return _rref_counts(_rpc(backend))


def _wait_freed(ctx: Any, owner: str, key: str) -> int:
    """Poll until the owner dropped the value; returns the number of polls (``_POLLS`` = never)."""
    for i in range(_POLLS):
        if not ctx.rpc.rpc_sync(owner, _alive, args=(ctx.backend, key)):
            return i
        ctx.sleep(0.05)
    return _POLLS


def _collect_garbage() -> None:
    gc.collect()


def _settle(ctx: Any) -> None:
    """Let asynchronous RRef deletes (this test's and earlier tests' in a reused world) land: collect
    every worker's garbage first (an RRef an earlier test left in a reference cycle is deleted only
    when the collector runs, at any later moment otherwise), then wait until every worker's RRef
    counts are unchanged across two polls (bounded), rather than a fixed sleep."""
    for r in range(ctx.world_size):
        ctx.rpc.rpc_sync(ctx.name(r), _collect_garbage)
    previous = None
    for _ in range(40):
        ctx.sleep(0.1)
        counts = [
            ctx.rpc.rpc_sync(ctx.name(r), _remote_counts, args=(ctx.backend,)) for r in range(ctx.world_size)
        ]
        if counts == previous:
            return
        previous = counts


# ---------------------------------------------------------------------------------------------------
# Worker programs
# ---------------------------------------------------------------------------------------------------


def _prog_freed_after_last_user(ctx: Any, key: str) -> dict[str, Any]:
    _settle(ctx)
    before = ctx.rpc.rpc_sync("worker1", _remote_counts, args=(ctx.backend,))
    rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [1, 2]))
    value = rref.to_here().items
    _settle(ctx)
    during = ctx.rpc.rpc_sync("worker1", _remote_counts, args=(ctx.backend,))
    alive = ctx.rpc.rpc_sync("worker1", _alive, args=(ctx.backend, key))
    del rref
    polls = _wait_freed(ctx, "worker1", key)
    _settle(ctx)
    after = ctx.rpc.rpc_sync("worker1", _remote_counts, args=(ctx.backend,))
    return {
        "value": value,
        "alive_while_user": alive,
        "owner_rrefs_delta": during["num_owner_rrefs"] - before["num_owner_rrefs"],
        "forks_delta": during["num_forks"] - before["num_forks"],
        "freed": polls < _POLLS,
        "after_delta": (
            after["num_owner_rrefs"] - before["num_owner_rrefs"],
            after["num_forks"] - before["num_forks"],
        ),
    }


def _prog_kept_alive_by_third_worker(ctx: Any, key: str) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [5]))
    seen = ctx.rpc.rpc_sync("worker2", _keep, args=(ctx.backend, rref))
    del rref
    _settle(ctx)
    alive_after_creator_died = ctx.rpc.rpc_sync("worker1", _alive, args=(ctx.backend, key))
    fetched = ctx.rpc.rpc_sync("worker2", _kept_values, args=(ctx.backend,))
    ctx.rpc.rpc_sync("worker2", _release, args=(ctx.backend,))
    polls = _wait_freed(ctx, "worker1", key)
    return {
        "third_saw": seen,
        "alive_after_creator_died": alive_after_creator_died,
        "fetched_by_third": fetched,
        "freed_after_third_released": polls < _POLLS,
    }


def _prog_unconfirmed_grandchild(ctx: Any, key: str) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [7, 7]))
    rref.to_here()
    # worker2 gets a child, forks a grandchild on to worker0 without waiting and drops its copy;
    # worker0 drops the original at once: the grandchild, maybe not yet confirmed, is the only user.
    ctx.rpc.rpc_sync("worker2", _forward_and_drop, args=(ctx.backend, rref, "worker0"))
    del rref
    _settle(ctx)
    alive = ctx.rpc.rpc_sync("worker1", _alive, args=(ctx.backend, key))
    kept = _KEEP.get(ctx.name(0), [])
    fetched = [r.to_here().items for r in kept]
    confirmed = [r.confirmed_by_owner() for r in kept]
    _release(ctx.backend)
    del kept
    polls = _wait_freed(ctx, "worker1", key)
    return {"alive": alive, "fetched": fetched, "confirmed": confirmed, "freed": polls < _POLLS}


def _prog_rref_in_containers_and_back(ctx: Any, key: str) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [3]))
    via_third, plain = ctx.rpc.rpc_sync("worker2", _echo_in_containers, args=(rref,))
    back = via_third["inner"][0]
    out: dict[str, Any] = {
        "back_is_owner": back.is_owner(),
        "back_owner": back.owner_name(),
        "back_value": back.to_here().items,
        "plain_value": plain.to_here().items,
    }
    out["owner_sees"] = ctx.rpc.rpc_sync("worker1", _echo_in_containers, args=(rref,))[1].owner_name()
    del rref, via_third, plain, back
    out["freed"] = _wait_freed(ctx, "worker1", key) < _POLLS
    return out


def _prog_nested_remote_keeps_value(ctx: Any, key: str) -> dict[str, Any]:
    inner = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [4, 2]))
    outer = ctx.rpc.remote("worker2", _wrap, args=(inner,))
    outer.to_here()  # the wrapper exists on worker2
    del inner
    _settle(ctx)
    alive_while_wrapped = ctx.rpc.rpc_sync("worker1", _alive, args=(ctx.backend, key))
    through_wrapper = outer.to_here()[0].to_here().items
    del outer
    polls = _wait_freed(ctx, "worker1", key)
    return {"alive_while_wrapped": alive_while_wrapped, "value": through_wrapper, "freed": polls < _POLLS}


def _prog_fork_to_owner_and_back(ctx: Any, key: str) -> dict[str, Any]:
    # A value owned by worker0 itself (RRef(value)): registered only once forked (RREF-3).
    value = Tracked(key, [8])
    local = ctx.rpc.RRef(value)
    before = _rref_counts(ctx.rpc)
    seen = ctx.rpc.rpc_sync("worker1", _keep, args=(ctx.backend, local))
    _settle(ctx)
    while_forked = _rref_counts(ctx.rpc)
    ctx.rpc.rpc_sync("worker1", _release, args=(ctx.backend,))
    polls = 0
    while _rref_counts(ctx.rpc)["num_owner_rrefs"] > before["num_owner_rrefs"] and polls < _POLLS:
        ctx.sleep(0.05)
        polls += 1
    return {
        "seen": seen,
        "owner_rrefs_delta_while_forked": while_forked["num_owner_rrefs"] - before["num_owner_rrefs"],
        "released": polls < _POLLS,
        "local_still_works": local.to_here() is value,
    }


def _prog_forked_user_is_confirmed_when_function_runs(ctx: Any, key: str) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [1]))
    seen_from_user = ctx.rpc.rpc_sync("worker2", _keep, args=(ctx.backend, rref))
    ctx.rpc.rpc_sync("worker2", _release, args=(ctx.backend,))
    return {"from_user": seen_from_user}


def _prog_pending_user_in_debug_info(ctx: Any, key: str) -> dict[str, Any]:
    before = _rref_counts(ctx.rpc)
    rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [1], 1.0))
    pending = _rref_counts(ctx.rpc)["num_pending_users"] - before["num_pending_users"]
    rref.to_here()
    polls = 0
    while _rref_counts(ctx.rpc)["num_pending_users"] > before["num_pending_users"] and polls < _POLLS:
        ctx.sleep(0.05)
        polls += 1
    info = ctx.rpc._get_debug_info()
    return {
        "pending_while_creating": pending,
        "confirmed_later": polls < _POLLS,
        "string_values": all(
            isinstance(info[k], str)
            for k in ("num_owner_rrefs", "num_forks", "num_pending_users", "num_pending_futures")
        ),
    }


def _prog_remote_timeout(ctx: Any, key: str) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [1], 1.5), timeout=0.2)
    out: dict[str, Any] = {}
    try:
        rref._get_future().wait()
        out["future"] = None
    except RuntimeError as exc:
        out["future"] = "RPC ran for more than" in str(exc)
    for name, thunk in (
        ("to_here", rref.to_here),
        ("fork", lambda: ctx.rpc.rpc_sync("worker2", _keep, args=(ctx.backend, rref))),
    ):
        try:
            thunk()
            out[name] = None
        except RuntimeError as exc:
            out[name] = "RRef creation via rpc.remote() timed out" in str(exc)
    ctx.sleep(2.0)  # let the slow creation finish before the next test uses worker1
    return out


def _prog_to_here_timeout_only_that_fetch(ctx: Any, key: str) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [6], 1.0))
    out: dict[str, Any] = {}
    try:
        rref.to_here(timeout=0.1)
        out["short"] = None
    except RuntimeError as exc:
        out["short"] = "RPC ran for more than" in str(exc)
    out["retry"] = rref.to_here().items
    rref._get_future().wait()
    out["creation_ok"] = True
    return out


def _prog_type_and_proxies_while_creating(ctx: Any, key: str) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key, [2, 3], 0.5))
    t = rref._get_type()
    after_blocking = rref._get_type(blocking=False)  # cached: the type itself, as in PyTorch
    other = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key + "-o", [1], 0.5))
    f1 = other._get_type(blocking=False)
    f2 = other._get_type(blocking=False)
    after_future = other._get_type()  # cached: the same Future, even when blocking
    slow = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key + "-p", [9], 0.5))
    sync = slow.rpc_sync().get_items()
    slow2 = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key + "-q", [8], 0.5))
    fut = slow2.rpc_async().get_items()
    slow3 = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, key + "-r", [7], 0.5))
    via_remote = slow3.remote().get_items()
    return {
        "type": t.__name__,
        "after_blocking": after_blocking.__name__ if isinstance(after_blocking, type) else "future",
        "same_future": f1 is f2,
        "blocking_after_future_is_it": after_future is f1,
        "future_type": f1.wait().__name__,
        "sync": sync,
        "async": fut.wait(),
        "remote": via_remote.to_here(),
    }


def _spawn_no_leak_after_graceful_shutdown(ctx: Any, key: str) -> Any:
    ctx.init_rpc()
    api = ctx.rpc.api
    old = api._ignore_rref_leak
    peer = ctx.name((ctx.rank + 1) % ctx.world_size)
    third = ctx.name((ctx.rank + 2) % ctx.world_size)
    kept = [
        ctx.rpc.remote(peer, _make_tracked, args=(ctx.backend, f"{key}-{ctx.rank}-{i}", [i]))
        for i in range(3)
    ]
    kept[0].to_here()
    ctx.rpc.rpc_sync(third, _keep, args=(ctx.backend, kept[1]))  # a fork held elsewhere at shutdown
    api._ignore_rref_leak = False  # any leak left by the graceful shutdown now raises
    try:
        ctx.rpc.shutdown()
        return "ok"
    except RuntimeError as exc:
        return ("raised", str(exc))
    finally:
        api._ignore_rref_leak = old
        _KEEP.clear()


def _spawn_leak_check(ctx: Any, ignore: bool) -> Any:
    ctx.init_rpc()
    if ctx.rank == 0:
        rref = ctx.rpc.remote("worker1", _make_tracked, args=(ctx.backend, "leak", [1]))
        rref.to_here()
        ctx.rpc.rpc_sync("worker1", _set_go, args=(ctx.backend,))
        # worker1 shuts down locally while this user RRef is alive: its owner leaks it.
        ctx.rpc.rpc_sync("worker1", _wait_stop, args=(ctx.backend,))
        ctx.rpc.shutdown(graceful=False)
        del rref
        return "user side"
    # Only this rank touches the flag: simulated workers share the module.
    api = ctx.rpc.api
    old = api._ignore_rref_leak
    try:
        for _ in range(400):
            if _GO.get(ctx.backend):
                break
            ctx.sleep(0.01)
        api._ignore_rref_leak = ignore
        _GO["stop"] = True
        ctx.sleep(1.0)  # worker0's _wait_stop returns and its reply leaves, even on a loaded machine
        try:
            ctx.rpc.shutdown(graceful=False)
            return "no error"
        except RuntimeError as exc:
            return ("RuntimeError", str(exc))
    finally:
        api._ignore_rref_leak = old
        _GO.clear()


_GO: dict[str, bool] = {}


def _set_go(backend: str) -> None:
    _GO[backend] = True


def _wait_stop(backend: str) -> None:
    for _ in range(400):
        if _GO.get("stop"):
            return
        _sleep(backend, 0.01)


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


@pytest.mark.spec("RREF-D1", "RREF-1", "RREF-12")
def test_owner_frees_the_value_after_its_last_user_is_deleted(world):
    out = world.run_on(0, _prog_freed_after_last_user, "freed-1", world_size=2)
    assert out["value"] == [1, 2]
    assert out["alive_while_user"] is True
    assert out["owner_rrefs_delta"] == 1 and out["forks_delta"] == 1
    assert out["freed"] is True
    assert out["after_delta"] == (0, 0)


@pytest.mark.spec("RREF-D1", "RREF-9", "RREF-F2", "RREF-F3")
def test_value_lives_while_a_third_worker_holds_a_fork(world):
    out = world.run_on(0, _prog_kept_alive_by_third_worker, "third-1", world_size=3)
    assert out["third_saw"] == {"confirmed": True, "is_owner": False}
    assert out["alive_after_creator_died"] is True
    assert out["fetched_by_third"] == [[5]]
    assert out["freed_after_third_released"] is True


@pytest.mark.spec("RREF-F1", "RREF-F2", "RREF-D1")
def test_value_is_never_freed_while_an_unconfirmed_grandchild_fork_lives(world):
    out = world.run_on(0, _prog_unconfirmed_grandchild, "grandchild-1", world_size=3)
    assert out["alive"] is True
    assert out["fetched"] == [[7, 7]]
    assert out["confirmed"] == [True]
    assert out["freed"] is True


@pytest.mark.spec("RREF-9", "RREF-F2", "RREF-D1")
def test_rref_returned_inside_containers_from_third_worker_and_owner(world):
    out = world.run_on(0, _prog_rref_in_containers_and_back, "containers-1", world_size=3)
    assert out["back_is_owner"] is False and out["back_owner"] == "worker1"
    assert out["back_value"] == [3] and out["plain_value"] == [3]
    assert out["owner_sees"] == "worker1"
    assert out["freed"] is True


@pytest.mark.spec("RREF-9", "RREF-D1")
def test_value_held_by_a_nested_remote_lives_until_the_wrapper_is_deleted(world):
    out = world.run_on(0, _prog_nested_remote_keeps_value, "nested-1", world_size=3)
    assert out == {"alive_while_wrapped": True, "value": [4, 2], "freed": True}


@pytest.mark.spec("RREF-3", "RREF-6", "RREF-12", "RREF-D1")
def test_local_rref_enters_owner_table_when_forked_and_leaves_when_fork_dies(world):
    out = world.run_on(0, _prog_fork_to_owner_and_back, "local-1", world_size=2)
    assert out["seen"] == {"confirmed": False, "is_owner": False}  # straight from the owner (RREF-6)
    assert out["owner_rrefs_delta_while_forked"] == 1
    assert out["released"] is True
    assert out["local_still_works"] is True


@pytest.mark.spec("RREF-F3", "RREF-6")
def test_rref_forked_by_a_user_is_confirmed_before_the_function_runs(world):
    out = world.run_on(0, _prog_forked_user_is_confirmed_when_function_runs, "f3-1", world_size=3)
    assert out["from_user"] == {"confirmed": True, "is_owner": False}


@pytest.mark.spec("RREF-1", "RREF-12")
def test_debug_info_counts_a_pending_user_until_the_owner_confirms_it(world):
    out = world.run_on(0, _prog_pending_user_in_debug_info, "pending-1", world_size=2)
    assert out == {"pending_while_creating": 1, "confirmed_later": True, "string_values": True}


@pytest.mark.spec("ERR-5")
def test_timed_out_remote_makes_later_use_raise_creation_timed_out(world):
    out = world.run_on(0, _prog_remote_timeout, "timeout-1", world_size=3)
    assert out == {"future": True, "to_here": True, "fork": True}


@pytest.mark.spec("ERR-6", "RREF-4")
def test_to_here_timeout_fails_only_that_fetch(world):
    out = world.run_on(0, _prog_to_here_timeout_only_that_fetch, "to-here-1", world_size=2)
    assert out == {"short": True, "retry": [6], "creation_ok": True}


@pytest.mark.spec("RREF-7")
def test_get_type_and_proxies_work_on_rrefs_still_being_created(world):
    out = world.run_on(0, _prog_type_and_proxies_while_creating, "type-1", world_size=2)
    assert out == {
        "type": "Tracked",
        "after_blocking": "Tracked",
        "same_future": True,
        "blocking_after_future_is_it": True,
        "future_type": "Tracked",
        "sync": [9],
        "async": [8],
        "remote": [7],
    }


@pytest.mark.spec("SHUT-1", "SHUT-4", "RREF-D1")
def test_graceful_shutdown_deletes_users_and_leaves_no_leak(world):
    assert world.spawn(_spawn_no_leak_after_graceful_shutdown, "noleak", world_size=3) == ["ok"] * 3


@pytest.mark.spec("SHUT-4")
@pytest.mark.parametrize("ignore", [False, True])
def test_leak_check_raises_only_when_rref_leaks_are_not_ignored(world, ignore):
    user, owner = world.spawn(_spawn_leak_check, ignore, world_size=2)
    assert user == "user side"
    if ignore:
        assert owner == "no error"
    else:
        assert owner[0] == "RuntimeError"
        assert "Leaking RRef" in owner[1] and "with fork Id" in owner[1], owner
