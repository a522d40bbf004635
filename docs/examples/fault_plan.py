"""Fault plans in the RPC's words: holds, delays, lost replies, partitions, files and swarms.

Run it: ``python docs/examples/fault_plan.py``.
"""

from __future__ import annotations

import operator
from pathlib import Path

from twinrpc.simulator import Delay, Drop, FaultPlan, Hold, Simulation, Swarm, now, sleep

import twinrpc.rpc as rpc

HERE = Path(__file__).resolve().parent


def echo(x: int) -> int:
    return x


arrivals: list[int] = []


def record(x: int) -> None:
    arrivals.append(x)


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"


# -- 1. a one-way partition that heals ------------------------------------------------------------------
def timeout_program(rank: int) -> str | None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    outcome = None
    if rank == 0:
        try:
            rpc.rpc_sync("worker1", echo, args=(1,), timeout=1.0)
            outcome = "returned"
        except RuntimeError as exc:  # twinrpc.rpc.RPCTimeoutError, a RuntimeError as in PyTorch
            outcome = first_line(exc)
    rpc.shutdown()
    return outcome


def held_link() -> None:
    # Everything worker 0 sends to worker 1 between t=0 and t=5 s is held and released at t=5 s.
    plan = FaultPlan([Hold(src=0, dst=1, start=0.0, end=5.0)])
    result = Simulation(world_size=2, seed=0, faults=plan).run(timeout_program)
    print("held link:", result.values()[0])
    print(f"  virtual time {result.virtual_time:.3f} s")
    print("  " + "\n  ".join(e.line() for e in result.trace if e.event == "fault"))


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
    Simulation(world_size=2, seed=2, faults=plan).run(order_program).values()
    return list(arrivals)


def reordered() -> None:
    print("no faults:          ", arrival_order(FaultPlan()))
    # The 1st request worker 0 sends to worker 1 arrives 10 ms late: the second call overtakes it.
    plan = FaultPlan([Delay(0.01, "request", src=0, dst=1, nth=1)])
    print("first call delayed: ", arrival_order(plan), "-", plan.describe())


# -- 3. a lost reply --------------------------------------------------------------------------------------
def lost_reply() -> None:
    # The reply from worker 1 to worker 0 is lost: the caller sees PyTorch's timeout error.
    plan = FaultPlan([Drop("response", src=1, dst=0)])
    result = Simulation(world_size=2, seed=0, faults=plan).run(timeout_program)
    print("lost reply:", result.values()[0])


# -- 4. fault verbs inside a running program ----------------------------------------------------------------
def partition_program(rank: int, sim: Simulation) -> str | None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    outcome = None
    if rank == 0:
        sim.partition(0)  # worker 0 against everyone else, both ways; messages are held
        start = now()
        fut = rpc.rpc_async("worker1", operator.add, args=(1, 2))
        sleep(2.0)
        sim.heal()  # what was held is delivered now
        outcome = f"{fut.wait()} after {now() - start:.3f} s"
    rpc.shutdown()
    return outcome


def verbs() -> None:
    sim = Simulation(world_size=3, seed=0)
    print("partition healed:", sim.run(partition_program, sim).values()[0])


# -- 5. a plan from a file ----------------------------------------------------------------------------------
def from_file() -> None:
    plan = FaultPlan.load(HERE / "faults.toml")
    print("from faults.toml:", plan.describe())
    result = Simulation(world_size=2, seed=0, faults=plan).run(timeout_program)
    print("  ", result.values()[0])


# -- 6. swarm: the faults themselves drawn from the seed ------------------------------------------------------
def swarm() -> None:
    swarm = Swarm(duration=0.5)
    for seed in (1, 2):
        print(f"swarm seed {seed}:", swarm.plan(seed, world_size=3).describe())


if __name__ == "__main__":
    held_link()
    reordered()
    lost_reply()
    verbs()
    from_file()
    swarm()
