"""Simulator speed: rpc_sync round trips per wall-clock second (two workers, small arguments).

People explore thousands of schedules with the simulator, so its per-message cost matters. Prints the
median of several runs, with the trace on (the default) and off.

Run: ``nox -s bench`` or ``python benchmarks/bench_simulator.py [--calls N] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from twinrpc.simulator import Simulation

import twinrpc.rpc as rpc


def identity(x: int) -> int:
    return x


def _program(rank: int, calls: int) -> float:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    elapsed = 0.0
    if rank == 0:
        start = time.perf_counter()  # wall time on purpose: this measures the simulator itself
        for i in range(calls):
            rpc.rpc_sync("worker1", identity, args=(i,))
        elapsed = time.perf_counter() - start
    rpc.shutdown()
    return elapsed


def round_trips_per_second(calls: int, trace: bool, seed: int) -> float:
    elapsed = Simulation(world_size=2, seed=seed, trace=trace).run(_program, calls).values()[0]
    return calls / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(
        f"simulator: rpc_sync round trips per wall-clock second, 2 workers, {args.calls} calls, "
        f"median of {args.repeat}"
    )
    for trace in (True, False):
        rates = [round_trips_per_second(args.calls, trace, seed) for seed in range(args.repeat)]
        label = "trace on " if trace else "trace off"
        print(
            f"  {label}: {statistics.median(rates):>9,.0f} round trips/s "
            f"(min {min(rates):,.0f}, max {max(rates):,.0f})"
        )


if __name__ == "__main__":
    main()
