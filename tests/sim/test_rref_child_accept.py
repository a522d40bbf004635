"""How the owner lets a user drop an RRef it passed along (G2), on the simulator.

A user that passes an RRef to another worker keeps it alive until the owner has accepted the child.
When the RRef goes to its owner inside a request, the owner's reply to that request is the accept: the
owner unpickles the request (so rebuilds the RRef) before it replies, whether the handler succeeds,
fails or the rest of the request cannot be unpickled, and a late reply (after the caller timed out)
says it as well. No RREF_CHILD_ACCEPT travels for it (PyTorch sends one, with its ack: in a
parameter-server loop, which passes an RRef to its owner twice per batch, they were a third of the
messages). An RRef that reaches its owner inside a *reply* still gets an RREF_CHILD_ACCEPT.
"""

from __future__ import annotations

from typing import Any

import torch
from twinrpc.simulator import Delay, Drop, FaultPlan, Simulation, now, sleep

import twinrpc.rpc as rpc

RPC_TIMEOUT = 0.5  # virtual seconds


def _make() -> torch.Tensor:
    return torch.ones(2)


def _first(rref: Any, x: int) -> int:
    return x + 1


def _fail(rref: Any) -> None:
    raise ValueError("handler failed")


def _explode() -> None:
    raise RuntimeError("cannot be rebuilt here")


class _BreaksOnArrival:
    """Pickles fine on the caller; unpickling it on the callee raises."""

    def __reduce__(self) -> Any:
        return (_explode, ())


def _pending_children() -> str:
    return str(rpc._get_debug_info()["num_pending_children"])


def _program(rank: int, mode: str) -> Any:
    """Worker 0 passes an RRef owned by worker 1 back to worker 1 and reports what it got and how
    many children were still pending right after the call returned, then after a pause."""
    options = rpc.RpcBackendOptions(rpc_timeout=RPC_TIMEOUT)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    result: Any = None
    if rank == 0:
        rref = rpc.remote("worker1", _make)
        rref.to_here()
        try:
            if mode in ("ok", "late", "lost"):
                result = rpc.rpc_sync("worker1", _first, args=(rref, 1))
            elif mode == "handler_fails":
                rpc.rpc_sync("worker1", _fail, args=(rref,))
            else:  # the request cannot be unpickled after the RRef in it was rebuilt
                rpc.rpc_sync("worker1", _first, args=(rref, _BreaksOnArrival()))
        except Exception as exc:
            result = type(exc).__name__
        right_after = _pending_children()
        sleep(10 * RPC_TIMEOUT)
        result = (result, right_after, _pending_children())
        del rref
    rpc.shutdown()
    return result


def _kinds_sent(result: Any) -> list[str]:
    return [e.detail.split("#")[0] for e in result.trace if e.event == "send"]


def test_the_reply_to_a_request_that_passed_an_rref_to_its_owner_accepts_it() -> None:
    result = Simulation(2, seed=3).run(_program, "ok")
    assert result.values()[0] == (2, "0", "0")
    assert "RREF_CHILD_ACCEPT" not in _kinds_sent(result)


def test_an_error_reply_accepts_it_too() -> None:
    for mode, error in (("handler_fails", "ValueError"), ("unpickling_fails", "SerializationError")):
        result = Simulation(2, seed=3).run(_program, mode)
        assert result.values()[0] == (error, "0", "0"), mode
        assert "RREF_CHILD_ACCEPT" not in _kinds_sent(result), mode


def test_a_reply_that_arrives_after_the_timeout_still_accepts_it() -> None:
    late = FaultPlan((Delay(2 * RPC_TIMEOUT, kind="CALL", src=0, dst=1),))
    result = Simulation(2, seed=3, faults=late).run(_program, "late")
    assert result.values()[0] == ("RPCTimeoutError", "1", "0")


def test_a_lost_reply_leaves_the_child_pending_until_shutdown() -> None:
    # Nothing else tells the caller that the owner has the RRef: the parent stays alive (safe), and
    # graceful shutdown still ends (its wait for pending children is bounded).
    # The replies to remote() and to_here() are the 1st and 2nd.
    lost = FaultPlan((Drop(kind="response", src=1, dst=0, nth=3),))
    result = Simulation(2, seed=3, faults=lost).run(_program, "lost")
    assert result.values()[0] == ("RPCTimeoutError", "1", "1")


def _rref_of(owner_name: str) -> Any:
    return rpc.remote(owner_name, _make)


def _hold(rref: Any) -> None:
    _HELD.append(rref)


def _give_back() -> Any:
    return _HELD.pop()


_HELD: list[Any] = []


def _reply_program(rank: int) -> Any:
    """Worker 1 holds a user RRef owned by worker 0 and returns it to worker 0 in a reply."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    result: Any = None
    if rank == 0:
        rref = rpc.RRef(torch.ones(2))
        rpc.rpc_sync("worker1", _hold, args=(rref,))
        back = rpc.rpc_sync("worker1", _give_back)
        result = (back.is_owner(), back.local_value().tolist())
        del back, rref
    rpc.shutdown()
    return result


def test_an_rref_returned_to_its_owner_in_a_reply_gets_a_child_accept() -> None:
    result = Simulation(2, seed=3).run(_reply_program)
    assert result.values()[0] == (True, [1.0, 1.0])
    sends = [e.detail for e in result.trace if e.event == "send"]
    assert any(d.startswith("RREF_CHILD_ACCEPT#") and " 0->1 " in d for d in sends)
    assert result.values()[1] is None


def _unpicklable_program(rank: int, who: str) -> Any:
    """Worker 0 passes an RRef (a user of worker 1's value, or its own value) together with a lambda,
    which cannot be pickled, to worker 1."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    result: Any = None
    if rank == 0:
        rref = rpc.remote("worker1", _make) if who == "user" else rpc.RRef(torch.ones(2))
        rref.to_here()
        try:
            rpc.rpc_sync("worker1", _first, args=(rref, lambda: 0))
        except Exception as exc:
            result = type(exc).__name__
        info = rpc._get_debug_info()
        result = (result, info["num_pending_children"], info["num_forks"], info["num_owner_rrefs"])
        del rref
    rpc.shutdown()
    return result, now()


def test_a_request_that_cannot_be_pickled_leaves_no_fork_behind() -> None:
    # Before the fix the user's child stayed pending: graceful shutdown waited 100 s for its accept,
    # then the G2 monitor failed the run; the owner's fork pinned its value (a leak at shutdown).
    for who in ("user", "owner"):
        result = Simulation(2, seed=3).run(_unpicklable_program, who)
        (error, pending, forks, owned), ended = result.values()[0]
        assert error.startswith("SerializationError"), who
        assert (pending, forks, owned) == ("0", "0", "0"), who
        assert ended < 1.0, who  # virtual seconds: shutdown did not wait for an accept
