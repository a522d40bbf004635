"""What RPC delivery does and does not promise: when arguments are captured, no ordering, no retries of
user calls, CPU-only tensors, remote() to oneself, init as a barrier, and retried RRef control messages.

RPC-10, RPC-11, RPC-12, RPC-16, RREF-2, RREF-13, LIFE-4, LIFE-5.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from conformance._support import outcome

# -- UDFs (run on the callee) ------------------------------------------------------------------------

_CALLS: dict[str, int] = {}


def _count_then_fail(key: str) -> None:
    _CALLS[key] = _CALLS.get(key, 0) + 1
    raise ValueError(f"failing call {key}")


def _calls(key: str) -> int:
    return _CALLS.get(key, 0)


def _first_item(t: torch.Tensor) -> float:
    return float(t[0])


def _echo(x: Any) -> Any:
    return x


# -- programs ---------------------------------------------------------------------------------------


def _prog_user_call_runs_once(ctx: Any, key: str) -> tuple[Any, int]:
    failed = outcome(lambda: ctx.rpc.rpc_sync("worker1", _count_then_fail, args=(key,)))
    return failed[0], ctx.rpc.rpc_sync("worker1", _calls, args=(key,))


def _prog_remote_to_self(ctx: Any) -> dict[str, Any]:
    me = ctx.name(ctx.rank)
    rref = ctx.rpc.remote(me, torch.add, args=(torch.ones(2), 3))
    value = rref.to_here()
    return {
        "is_owner": rref.is_owner(),
        "owner": rref.owner_name(),
        "confirmed": rref.confirmed_by_owner(),
        "value": value.tolist(),
        "same_object": rref.local_value() is value,
        "repr": str(rref).split("(")[0],
    }


def _prog_init_blocks_until_all_joined(ctx: Any) -> list[str]:
    if ctx.rank == 2:
        ctx.sleep(0.5)  # the last worker joins late: the others' init_rpc must wait for it
    ctx.init_rpc()
    # init_rpc returned: every worker is known and reachable at once, with no retry.
    names = [ctx.rpc.get_worker_info(ctx.name(r)).name for r in range(ctx.world_size)]
    replies = [ctx.rpc.rpc_sync(ctx.name(r), _echo, args=(r,)) for r in range(ctx.world_size)]
    ctx.rpc.shutdown()
    return [*names, *map(str, replies)]


def _prog_arguments_captured_at_call(ctx: Any) -> float:
    t = torch.zeros(4)
    fut = ctx.rpc.rpc_async("worker1", _first_item, args=(t,))
    t.fill_(7.0)  # mutated after rpc_async returned: PyTorch leaves this undefined (RPC-10)
    return fut.wait()


def _prog_non_cpu_tensor(ctx: Any) -> tuple[Any, Any]:
    refused = outcome(lambda: ctx.rpc.rpc_sync("worker1", _echo, args=(torch.empty(2, device="meta"),)))
    still_works = ctx.rpc.rpc_sync("worker1", _echo, args=(torch.ones(1),)).tolist()
    return refused, still_works


# -- tests ------------------------------------------------------------------------------------------


@pytest.mark.spec("RPC-12", "ERR-1")
def test_a_failing_user_call_runs_exactly_once_and_is_not_retried(world: Any) -> None:
    kinds, calls = world.run_on(0, _prog_user_call_runs_once, uuid.uuid4().hex)
    assert "ValueError" in kinds  # the failure reached the caller (ERR-1)...
    assert calls == 1  # ...and the call ran once: user RPCs are never retried


@pytest.mark.spec("RREF-2", "RREF-4", "RREF-6")
def test_remote_to_self_makes_an_owner_rref_holding_the_value(world: Any) -> None:
    got = world.run_on(0, _prog_remote_to_self)
    assert got == {
        "is_owner": True,
        "owner": "worker0",
        "confirmed": True,
        "value": [4.0, 4.0],
        "same_object": True,
        "repr": "OwnerRRef",
    }


@pytest.mark.spec("LIFE-4", "LIFE-7")
def test_init_rpc_returns_only_when_every_worker_has_joined(world: Any) -> None:
    expected = ["worker0", "worker1", "worker2", "0", "1", "2"]
    assert world.spawn(_prog_init_blocks_until_all_joined, world_size=3) == [expected] * 3


@pytest.mark.spec("RPC-10")
@pytest.mark.backends("sim", "gloo")
def test_arguments_are_captured_when_rpc_async_returns(world: Any) -> None:
    """twinrpc's worlds pickle (and, on gloo, send) the arguments before rpc_async returns, so later
    mutation never reaches the callee; PyTorch leaves it undefined (its send may still read the tensor),
    so the torch backend cannot assert either outcome."""
    assert world.run_on(0, _prog_arguments_captured_at_call) == 0.0


@pytest.mark.spec("RPC-16", "ERR-9")
@pytest.mark.backends("sim", "gloo")
def test_a_non_cpu_tensor_is_refused_naming_its_device_and_the_world_keeps_working(world: Any) -> None:
    """Uses the meta device to exercise the device check without a GPU (CI has none); PyTorch's
    TensorPipe treats meta tensors differently from CUDA ones, so the torch backend has no equivalent."""
    (kinds, message), still_works = world.run_on(0, _prog_non_cpu_tensor)
    assert "RuntimeError" in kinds
    assert "only supports CPU tensors" in message and "meta" in message
    assert still_works == [1.0]


# -- simulator-only: schedules a real run cannot force -----------------------------------------------

_ARRIVALS: list[int] = []


def _arrive(i: int) -> None:
    _ARRIVALS.append(i)


def _sender(rank: int) -> None:
    import twinrpc.rpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        futs = [rpc.rpc_async("worker1", _arrive, args=(i,)) for i in range(20)]
        for f in futs:
            f.wait()
    rpc.shutdown()


@pytest.mark.spec("RPC-11", "SIM-2")
@pytest.mark.backends("sim")
def test_messages_between_one_pair_of_workers_may_overtake_each_other() -> None:
    """Simulator-only: it forces a network whose jitter exceeds the gap between sends, which a real
    run cannot; PyTorch promises no ordering (RPC-11), and twinrpc's simulator exercises that."""
    from twinrpc.simulator import NetworkModel, Simulation

    net = NetworkModel(latency=1e-4, jitter=1e-3)
    orders = set()
    for seed in range(5):
        _ARRIVALS.clear()
        Simulation(world_size=2, seed=seed, network=net).run(_sender).values()
        assert sorted(_ARRIVALS) == list(range(20))  # every call ran exactly once
        orders.add(tuple(_ARRIVALS))
    assert any(order != tuple(range(20)) for order in orders), "no call ever overtook an earlier one"


def _owner_forgets_after_lossy_delete(rank: int) -> Any:
    import twinrpc.rpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out = None
    if rank == 0:
        rref = rpc.remote("worker1", torch.ones, args=([3],))
        assert rref.to_here().tolist() == [1.0, 1.0, 1.0]
        del rref  # its RREF_USER_DELETE (and the retries) cross a lossy network
        from twinrpc.simulator import sleep

        sleep(120.0)  # virtual: resends back off exponentially from 1 s
        out = rpc.rpc_sync("worker1", _owner_count)
    rpc.shutdown()
    return out


def _owner_count() -> int:
    import twinrpc.rpc as rpc

    return int(rpc._get_debug_info()["num_owner_rrefs"])


@pytest.mark.spec("RREF-13", "RREF-D1")
@pytest.mark.backends("sim")
def test_rref_control_messages_are_retried_until_acknowledged_over_a_lossy_network() -> None:
    """Simulator-only: it drops every RRef control message and ack among the first messages sent, a
    loss a real run cannot be made to show; the owner must still hear of the deletion (G1)."""
    from twinrpc.simulator import Drop, FaultPlan, Simulation

    plan = FaultPlan(actions=(Drop("rref-control"),) * 12)
    result = Simulation(world_size=2, seed=0, faults=plan).run(_owner_forgets_after_lossy_delete)
    assert result.values()[0] == 0
    resends = [e for e in result.trace if "RREF_USER_DELETE" in e.detail and e.event == "send"]
    assert len(resends) >= 2, "the lost delete was never sent again"
