"""Fault plans: a held link makes an RPC time out; a delayed message reorders two calls.

Run it: ``python docs/examples/fault_plan.py``.
"""

from __future__ import annotations

from twinrpc.simulator import Delay, Deliver, FaultPlan, Hold, Simulation

import twinrpc.rpc as rpc


def echo(x: int) -> int:
    return x


arrivals: list[int] = []


def record(x: int) -> None:
    arrivals.append(x)


# -- 1. a one-way partition that heals -------------------------------------------------------------------
def timeout_program(rank: int) -> str | None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    outcome = None
    if rank == 0:
        try:
            rpc.rpc_sync("worker1", echo, args=(1,), timeout=1.0)
            outcome = "returned"
        except RuntimeError as exc:  # twinrpc.rpc.RPCTimeoutError, a RuntimeError as in PyTorch
            outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    rpc.shutdown()
    return outcome


def held_link() -> None:
    # Everything worker 0 sends to worker 1 between t=0 and t=5 s is held and released at t=5 s.
    plan = FaultPlan(holds=(Hold(src=0, dst=1, start=0.0, end=5.0),))
    result = Simulation(world_size=2, seed=0, faults=plan).run(timeout_program)
    print("held link:", result.values()[0])
    print(f"  virtual time {result.virtual_time:.3f} s")
    print("  " + "\n  ".join(e.line() for e in result.trace if e.event == "hold"))


# -- 2. a delay that reorders two rpc_async calls ---------------------------------------------------------
def order_program(rank: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        first = rpc.rpc_async("worker1", record, args=(1,))
        second = rpc.rpc_async("worker1", record, args=(2,))
        first.wait()
        second.wait()
    rpc.shutdown()


def arrival_order(plan: FaultPlan) -> list[int]:
    arrivals.clear()
    Simulation(world_size=2, seed=0, faults=plan).run(order_program).values()
    return list(arrivals)


def reordered() -> None:
    print("no faults:          ", arrival_order(FaultPlan()))
    # The i-th action applies to the i-th message the whole simulation sends, which is the i-th "send"
    # event of the trace. Read the index of the first call off a fault-free run with the same seed.
    baseline = Simulation(world_size=2, seed=0).run(order_program)
    sends = [e for e in baseline.trace if e.event == "send"]
    index = next(i for i, e in enumerate(sends) if e.detail.startswith("CALL#0 0->1"))
    plan = FaultPlan(actions=(Deliver(),) * index + (Delay(extra=0.01),))
    print("first call delayed: ", arrival_order(plan), "-", plan.describe())


if __name__ == "__main__":
    held_link()
    reordered()
