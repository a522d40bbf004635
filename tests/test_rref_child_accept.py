"""When an owner tells a user that the RRef it passed along arrived (RREF_CHILD_ACCEPT), on the simulator.

A user that passes an RRef to its owner keeps it alive until the owner's child accept arrives (G2). The
accept only lets the user drop a reference, so the owner sends it after it has handled the request that
carried the RRef: the caller's reply is not delayed by it (the parameter-server training loop passes an
RRef to its owner twice per batch). It must still be sent when handling fails, or the user would hold
the reference until shutdown.
"""

from __future__ import annotations

from typing import Any

import torch
from twinrpc.simulator import Simulation

import twinrpc.rpc as rpc


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


def _program(rank: int, mode: str) -> Any:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    result: Any = None
    if rank == 0:
        rref = rpc.remote("worker1", _make)
        rref.to_here()
        try:
            if mode == "ok":
                result = rpc.rpc_sync("worker1", _first, args=(rref, 1))
            elif mode == "handler_fails":
                rpc.rpc_sync("worker1", _fail, args=(rref,))
            else:  # the request cannot be unpickled after the RRef in it was rebuilt
                rpc.rpc_sync("worker1", _first, args=(rref, _BreaksOnArrival()))
        except Exception as exc:
            result = type(exc).__name__
        for _ in range(100):  # settle (bounded): the accept is on its way
            if rpc._get_debug_info()["num_pending_children"] == "0":
                break
            rpc.rpc_sync("worker1", _make)
        result = (result, rpc._get_debug_info()["num_pending_children"])
        del rref
    rpc.shutdown()
    return result


def _sends(result: Any) -> list[str]:
    return [e.detail for e in result.trace if e.event == "send"]


def test_the_owner_replies_before_it_sends_the_child_accept() -> None:
    result = Simulation(2, seed=3).run(_program, "ok")
    assert result.values()[0] == (2, "0")
    sends = _sends(result)
    accept = next(i for i, d in enumerate(sends) if d.startswith("RREF_CHILD_ACCEPT#") and " 1->0 " in d)
    call_id = next(d.split()[0].split("#")[1] for d in sends if d.startswith("CALL#") and " 0->1 " in d)
    reply = next(i for i, d in enumerate(sends) if d.startswith(f"RESPONSE#{call_id} 1->0 "))
    assert reply < accept


def test_the_child_accept_is_sent_when_the_request_fails() -> None:
    for mode, error in (("handler_fails", "ValueError"), ("unpickling_fails", "SerializationError")):
        result = Simulation(2, seed=3).run(_program, mode)
        assert result.values()[0] == (error, "0"), mode
