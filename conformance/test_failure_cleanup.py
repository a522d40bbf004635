"""What survivors release after a worker dies, and RRefs that can no longer be used (RREF-D2,
RREF-14, DAG-18, ERR-5).

A victim rank kills itself with ``ctx.crash()`` (SIGKILL on torch/gloo, ``Simulation.crash`` on sim)
inside a fresh ``world.spawn(..., expect_dead=[rank])``. The survivors watch what they keep for it:
an owner's RRef counts (``_get_debug_info()``, whose RRef keys are PyTorch's), the distributed
autograd contexts it took part in (``_retrieve_context``, ``num_autograd_contexts``), and how RRefs it
owned fail. Each survivor polls for at most ``BOUND`` seconds of its world's clock and reports how
long the state took to settle: upstream PyTorch keeps both the forks and the contexts (DEV-11,
DEV-12), so its polls run out.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

from conformance._support import backend_now, backend_sleep, rpc_module, timed

#: seconds within which what a dead worker held must be released, and its RRefs' uses must fail
BOUND = 10.0
#: how often a survivor looks again while it waits
POLL = 0.05
#: how long a worker waits for another to reach a step of the scenario (a loaded host is slow)
SETUP_BOUND = 3 * BOUND

#: marks set by RPCs on the worker that runs them: (token, what) -> value. On sim every simulated
#: worker shares this module, so each mark names its worker.
_MARKS: dict[tuple[str, str], Any] = {}


def _mark(token: str, what: str, value: Any = True) -> None:
    _MARKS[(token, what)] = value


def _wait_for(ctx: Any, check: Callable[[], bool], bound: float = BOUND) -> float | None:
    """Seconds until ``check()`` held (polled every POLL s), or None if it never did within ``bound``."""
    start = backend_now(ctx.backend)
    while True:
        if check():
            return backend_now(ctx.backend) - start
        if backend_now(ctx.backend) - start > bound:
            return None
        ctx.sleep(POLL)


def _serve_until(ctx: Any, token: str) -> bool:
    """A survivor that only serves: wait until rank 0 marks ``token`` done (bounded)."""
    return _wait_for(ctx, lambda: (token, "done") in _MARKS, SETUP_BOUND) is not None


class Box:
    """A user-class value (pickled by reference on every backend)."""

    def __init__(self, items: list[int]) -> None:
        self.items = items

    def total(self) -> int:
        return sum(self.items)


def _make_box(items: list[int]) -> Box:
    return Box(items)


def _share_box(backend: str, items: list[int]) -> Any:
    """Runs on the owner: a new local RRef, forked to the caller by returning it."""
    return rpc_module(backend).RRef(Box(items))


def _slow_box(backend: str, seconds: float, items: list[int]) -> Box:
    backend_sleep(backend, seconds)
    return Box(items)


def _total_kept(token: str) -> int:
    """Runs on worker1: use the RRef it kept (a fetch from its owner, worker0)."""
    return int(_MARKS[(token, "worker1 keeps")].to_here().total())


def _owner_counts(rpc: Any) -> tuple[int, int]:
    info = rpc._get_debug_info()
    return int(info["num_owner_rrefs"]), int(info["num_forks"])


# ---------------------------------------------------------------------------------------------------
# RREF-D2: an owner drops the forks a dead worker held
# ---------------------------------------------------------------------------------------------------
def _owner_outlives_a_holder(ctx: Any, token: str) -> Any:
    """Rank 0 owns three values: one created by rank 2's remote(), one it forked to rank 2, one it
    forked to rank 1. Rank 2 dies holding its two; rank 1 keeps using its own."""
    ctx.init_rpc()
    rpc, backend = ctx.rpc, ctx.backend
    if ctx.rank == 2:
        by_remote = rpc.remote("worker0", _make_box, args=([1, 2],))
        shared = rpc.rpc_sync("worker0", _share_box, args=(backend, [3, 4]))
        held = [by_remote.to_here().total(), shared.to_here().total()]  # both confirmed and used
        rpc.rpc_sync("worker0", _mark, args=(token, "held", held))
        _wait_for(ctx, lambda: (token, "counted") in _MARKS, SETUP_BOUND)  # the owner counted them
        ctx.crash()
    if ctx.rank == 1:
        kept = rpc.rpc_sync("worker0", _share_box, args=(backend, [5, 6]))
        kept.to_here()
        _MARKS[(token, "worker1 keeps")] = kept  # for _total_kept, which rank 0 calls here
        rpc.rpc_sync("worker0", _mark, args=(token, "kept"))
        released = _serve_until(ctx, token)
        del _MARKS[(token, "worker1 keeps")]
        rpc.shutdown(graceful=False)
        return released
    _wait_for(ctx, lambda: (token, "held") in _MARKS and (token, "kept") in _MARKS, SETUP_BOUND)
    result: dict[str, Any] = {"held": _MARKS.get((token, "held")), "before": _owner_counts(rpc)}
    rpc.rpc_sync("worker2", _mark, args=(token, "counted"))
    result["settled_after"] = _wait_for(ctx, lambda: _owner_counts(rpc) == (1, 1))
    result["after"] = _owner_counts(rpc)
    result["kept_after"] = timed(backend, lambda: rpc.rpc_sync("worker1", _total_kept, args=(token,)))
    rpc.rpc_sync("worker1", _mark, args=(token, "done"))
    result["local_shutdown"] = timed(backend, lambda: rpc.shutdown(graceful=False))
    return result


@pytest.mark.spec("RREF-D2", "RREF-12")
def test_owner_drops_the_forks_a_dead_worker_held_and_keeps_the_others(world: Any) -> None:
    token = uuid.uuid4().hex
    results = world.spawn(_owner_outlives_a_holder, token, world_size=3, expect_dead=[2])
    assert results[2] is None
    assert results[1] is True, results[1]
    got = results[0]
    assert got["held"] == [3, 7], got
    assert got["before"] == (3, 3), got
    print(f"owner released the dead worker's forks after {got['settled_after']} s")
    assert got["after"] == (1, 1), f"the owner still counts {got['after']} (owner rrefs, forks)"
    assert got["settled_after"] is not None and got["settled_after"] < BOUND, got
    kept = got["kept_after"]
    assert kept["raised"] is None and kept["value"] == 11, kept
    assert got["local_shutdown"]["raised"] is None, got["local_shutdown"]


# ---------------------------------------------------------------------------------------------------
# DAG-18: contexts a dead worker took part in are released on the survivors
# ---------------------------------------------------------------------------------------------------
def _join_context(token: str, backend: str, t: torch.Tensor) -> torch.Tensor:
    """Runs inside the caller's context: remember its id on this worker."""
    dist_autograd = _dist_autograd(backend)
    me = rpc_module(backend).get_worker_info().name
    _mark(token, me, dist_autograd._current_context()._context_id())
    return t * 2


def _forward_into_context(token: str, backend: str, t: torch.Tensor) -> torch.Tensor:
    """Runs on the victim inside the caller's context: a nested call carries it on to worker1."""
    return rpc_module(backend).rpc_sync("worker1", _join_context, args=(token, backend, t * 3))


def _dist_autograd(backend: str) -> Any:
    if backend == "torch":
        import torch.distributed.autograd as dist_autograd
    else:
        import twinrpc.autograd as dist_autograd
    return dist_autograd


def _seen(token: str, *names: str) -> bool:
    return all((token, f"seen by {name}") in _MARKS for name in names)


def _context_count(ctx: Any) -> int:
    return int(ctx.dist_autograd._get_debug_info()["num_autograd_contexts"])


def _context_gone(ctx: Any, context_id: int) -> bool:
    try:
        ctx.dist_autograd._retrieve_context(context_id)
    except RuntimeError as exc:
        return "Could not find autograd context with id" in str(exc)
    return False


def _survivor_watches(ctx: Any, token: str, baseline: int) -> dict[str, Any]:
    """Wait for the context this worker joined, then for it to be released after the death."""
    me = ctx.name(ctx.rank)
    _wait_for(ctx, lambda: (token, me) in _MARKS, SETUP_BOUND)
    context_id = _MARKS[(token, me)]
    result: dict[str, Any] = {
        "joined": not _context_gone(ctx, context_id),
        "count_while_alive": _context_count(ctx) - baseline,
    }
    ctx.rpc.rpc_sync("worker2", _mark, args=(token, f"seen by {me}"))  # the victim may die now
    result["released_after"] = _wait_for(ctx, lambda: _context_gone(ctx, context_id))
    result["count_after"] = _context_count(ctx) - baseline
    try:
        ctx.dist_autograd._retrieve_context(context_id)
        result["retrieve"] = None
    except RuntimeError as exc:
        result["retrieve"] = str(exc)
    return result


def _contexts_of_a_dead_creator(ctx: Any, token: str) -> Any:
    """Rank 2 opens a context, calls ranks 0 and 1 inside it with a tensor requiring grad, and dies
    inside its ``context()`` block: no one will ever release the context for it."""
    ctx.init_rpc()
    rpc, backend = ctx.rpc, ctx.backend
    baseline = _context_count(ctx)
    if ctx.rank == 2:
        with ctx.dist_autograd.context():
            t = torch.ones(2, requires_grad=True)
            for peer in ("worker0", "worker1"):
                rpc.rpc_sync(peer, _join_context, args=(token, backend, t))
            _wait_for(ctx, lambda: _seen(token, "worker0", "worker1"), SETUP_BOUND)
            ctx.crash()
    result = _survivor_watches(ctx, token, baseline)
    rpc.shutdown(graceful=False)
    return result


def _contexts_through_a_dead_worker(ctx: Any, token: str) -> Any:
    """Rank 0 opens a context and calls rank 2, which calls rank 1 inside it; rank 2 dies while
    rank 0's ``context()`` block still runs. Rank 1 knows the context only through rank 2, so the
    release rank 0 sends when its block ends would have reached it only through rank 2."""
    ctx.init_rpc()
    rpc, backend = ctx.rpc, ctx.backend
    baseline = _context_count(ctx)
    if ctx.rank == 2:
        _wait_for(ctx, lambda: (token, "called") in _MARKS and _seen(token, "worker1"), SETUP_BOUND)
        ctx.crash()
    if ctx.rank == 1:
        result = _survivor_watches(ctx, token, baseline)
        rpc.rpc_sync("worker0", _mark, args=(token, "watched"))
        rpc.shutdown(graceful=False)
        return result
    result = {}
    with ctx.dist_autograd.context() as context_id:
        t = torch.ones(2, requires_grad=True)
        got = rpc.rpc_sync("worker2", _forward_into_context, args=(token, backend, t))
        result["value"] = got.tolist()
        rpc.rpc_sync("worker2", _mark, args=(token, "called"))
        _wait_for(ctx, lambda: (token, "watched") in _MARKS, SETUP_BOUND)
        # The creator's own context outlives the death: its block is still running.
        result["own_context_kept"] = not _context_gone(ctx, context_id)
    result["own_context_released_on_exit"] = _context_gone(ctx, context_id)
    result["count_after_exit"] = _context_count(ctx) - baseline
    rpc.shutdown(graceful=False)
    return result


def _check_released(what: str, got: dict[str, Any]) -> None:
    print(f"{what}: context released after {got['released_after']} s")
    assert got["joined"] and got["count_while_alive"] == 1, (what, got)
    assert got["released_after"] is not None, f"{what} still holds the dead worker's context: {got}"
    assert got["count_after"] == 0, (what, got)
    assert "Could not find autograd context with id" in (got["retrieve"] or ""), (what, got)


@pytest.mark.spec("DAG-18", "DAG-10")
def test_contexts_created_by_a_dead_worker_are_released_on_every_survivor(world: Any) -> None:
    token = uuid.uuid4().hex
    results = world.spawn(_contexts_of_a_dead_creator, token, world_size=3, expect_dead=[2])
    assert results[2] is None
    for rank in (0, 1):
        _check_released(f"worker{rank}", results[rank])


@pytest.mark.spec("DAG-18", "DAG-10")
def test_a_context_reached_only_through_a_dead_worker_is_released_and_the_creator_keeps_its_own(
    world: Any,
) -> None:
    token = uuid.uuid4().hex
    results = world.spawn(_contexts_through_a_dead_worker, token, world_size=3, expect_dead=[2])
    assert results[2] is None
    _check_released("worker1", results[1])
    root = results[0]
    assert root["value"] == [6.0, 6.0], root
    assert root["own_context_kept"], root
    assert root["own_context_released_on_exit"] and root["count_after_exit"] == 0, root


# ---------------------------------------------------------------------------------------------------
# RREF-14: RRefs owned by a dead worker fail promptly
# ---------------------------------------------------------------------------------------------------
def _rrefs_of_a_dead_owner(ctx: Any, token: str) -> Any:
    """Rank 0 holds RRefs owned by rank 1: one created, one whose creation runs when rank 1 dies."""
    ctx.init_rpc()
    rpc, backend = ctx.rpc, ctx.backend
    if ctx.rank == 1:
        _wait_for(ctx, lambda: (token, "ready") in _MARKS, SETUP_BOUND)
        ctx.sleep(1.0)  # rank 0 waits in to_here() on the slow creation by now
        ctx.crash()
    made = rpc.remote("worker1", _make_box, args=([1, 2, 3],))
    made.to_here()
    typed = rpc.remote("worker1", _make_box, args=([4],))
    typed.to_here()
    slow = rpc.remote("worker1", _slow_box, args=(backend, 30.0, [9]), timeout=0)
    rpc.rpc_sync("worker1", _mark, args=(token, "ready"))
    result = {
        "pending_to_here": timed(backend, lambda: slow.to_here(timeout=0)),
        "to_here": timed(backend, made.to_here),
        "rpc_sync_proxy": timed(backend, lambda: made.rpc_sync().total()),
        "rpc_async_proxy": timed(backend, lambda: made.rpc_async().total().wait()),
        "remote_proxy": timed(backend, lambda: made.remote().total().to_here()),
        "get_type": timed(backend, typed._get_type),
        "own_rref": timed(backend, lambda: rpc.RRef(Box([5])).to_here().total()),
        "self_call": timed(backend, lambda: rpc.rpc_sync("worker0", operator.add, args=(1, 2))),
    }
    result["local_shutdown"] = timed(backend, lambda: rpc.shutdown(graceful=False))
    return result


_DEAD_OWNER_USES = (
    "pending_to_here",
    "to_here",
    "rpc_sync_proxy",
    "rpc_async_proxy",
    "remote_proxy",
    "get_type",
)


@pytest.mark.spec("RREF-14", "ERR-7")
def test_uses_of_rrefs_owned_by_a_dead_worker_fail_promptly(world: Any) -> None:
    token = uuid.uuid4().hex
    results = world.spawn(_rrefs_of_a_dead_owner, token, world_size=2, expect_dead=[1])
    assert results[1] is None
    got = results[0]
    for what in _DEAD_OWNER_USES:
        use = got[what]
        print(f"{what}: {use.get('raised')} after {use['elapsed']:.3f} s")
        assert use["raised"] is not None, f"{what} returned {use.get('value')!r} instead of failing"
        assert use["runtime_error"], f"{what} raised {use['raised']}, not a RuntimeError: {use['message']}"
        assert use["elapsed"] < BOUND, f"{what} took {use['elapsed']:.2f} s to fail (bound {BOUND} s)"
    assert got["own_rref"]["raised"] is None and got["own_rref"]["value"] == 5, got["own_rref"]
    assert got["self_call"]["raised"] is None and got["self_call"]["value"] == 3, got["self_call"]
    assert got["local_shutdown"]["raised"] is None, got["local_shutdown"]


@pytest.mark.spec("RREF-14", "ERR-7")
@pytest.mark.backends("sim", "gloo")
def test_uses_of_rrefs_owned_by_a_dead_worker_raise_worker_unavailable_naming_it(world: Any) -> None:
    """PyTorch's error text is transport text ("eof ..."): the class and wording are twinrpc's (ERR-7)."""
    token = uuid.uuid4().hex
    got = world.spawn(_rrefs_of_a_dead_owner, token, world_size=2, expect_dead=[1])[0]
    for what in _DEAD_OWNER_USES:
        assert got[what]["raised"] == "WorkerUnavailableError", (what, got[what])
        assert "'worker1'" in got[what]["message"], (what, got[what]["message"])
        assert "is unavailable" in got[what]["message"], (what, got[what]["message"])


# ---------------------------------------------------------------------------------------------------
# ERR-5: an RRef whose creation timed out raises on use
# ---------------------------------------------------------------------------------------------------
_CREATION_TIMED_OUT = "RRef creation via rpc.remote() timed out"


def _uses_after_a_creation_timeout(ctx: Any) -> dict[str, Any]:
    rpc, backend = ctx.rpc, ctx.backend
    rref = rpc.remote("worker1", _slow_box, args=(backend, 3.0, [7]), timeout=0.2)
    ctx.sleep(1.5)  # the creation has timed out by now (marked asynchronously); nothing waited on it
    out: dict[str, Any] = {}
    for name, thunk in (
        ("to_here", rref.to_here),
        ("get_type", rref._get_type),
        ("rpc_sync_proxy", lambda: rref.rpc_sync().total()),
        ("local_value", rref.local_value),
    ):
        try:
            out[name] = ("returned", repr(thunk()))
        except RuntimeError as exc:
            out[name] = ("raised", str(exc))
    ctx.sleep(2.0)  # let the slow creation finish before the next test uses worker1
    return out


@pytest.mark.spec("ERR-5", "RREF-5", "RREF-7")
def test_an_rref_whose_creation_timed_out_raises_on_every_use(world: Any) -> None:
    out = world.run_on(0, _uses_after_a_creation_timeout, world_size=2)
    for use in ("to_here", "get_type", "rpc_sync_proxy"):
        assert out[use][0] == "raised" and _CREATION_TIMED_OUT in out[use][1], (use, out[use])
    # local_value() never reaches the owner: a user RRef raises as RREF-5 says, timed out or not
    assert out["local_value"][0] == "raised", out["local_value"]
    assert "can't call localValue() on user" in out["local_value"][1], out["local_value"]
