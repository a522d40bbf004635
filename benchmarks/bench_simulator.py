"""Simulator speed: rpc_sync round trips per wall-clock second (two workers, small arguments).

People explore thousands of schedules with the simulator, so its per-message cost matters. Prints the
median of several runs, with the trace on (the default) and off, and with each worker a simulated
process of its own as ``python -m twinrpc.simulator run`` makes them (its own modules, environment
and output, swapped in on every switch between workers; virtual time), as a ratio to the plain run
measured in the same invocation.

Run: ``nox -s bench`` or ``python benchmarks/bench_simulator.py [--calls N] [--repeat R]``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator

import _cli  # benchmarks/_cli.py (the script's directory is on sys.path)
from twinrpc.simulator import Simulation, SimulationWarning
from twinrpc.simulator._kernel._virtual_time import simulated_time
from twinrpc.simulator._launch._program import ProcessImage, ProcessImages

import twinrpc.rpc as rpc


def identity(x: int) -> int:
    return x


_wall = time.perf_counter  # the real clock, whatever a run installs


def _program(rank: int, calls: int) -> float:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    elapsed = 0.0
    if rank == 0:
        start = _wall()  # wall time on purpose: this measures the simulator itself
        for i in range(calls):
            rpc.rpc_sync("worker1", identity, args=(i,))
        elapsed = _wall() - start
    rpc.shutdown()
    return elapsed


@contextlib.contextmanager
def _as_processes(sim: Simulation) -> Iterator[None]:
    """Each worker a simulated process with its own image, as the ``run`` command sets them up."""
    from twinrpc.simulator._launch._program import IMAGE

    images = ProcessImages(os.path.dirname(os.path.abspath(__file__)))
    for worker in sim.workers:
        image = ProcessImage(
            pid=images.new_pid(),
            rank=worker.rank,
            local_rank=worker.rank,
            environ=dict(os.environ._data),  # type: ignore[attr-defined]
            argv=list(sys.argv),
            stdout=sys.stdout,
            stderr=sys.stderr,
            modules={"__main__": sys.modules["__main__"]},  # this script, as each worker's program
        )
        worker.context.run(IMAGE.set, image)
    with simulated_time(virtual=True), images:
        yield


def round_trips_per_second(calls: int, trace: bool, seed: int, processes: bool = False) -> float:
    sim = Simulation(world_size=2, seed=seed, trace=trace)
    # The program reads the wall clock on purpose; as processes, it reads the real one directly.
    with warnings.catch_warnings(), _as_processes(sim) if processes else contextlib.nullcontext():
        warnings.simplefilter("ignore", SimulationWarning)
        elapsed = sim.run(_program, calls).values()[0]
    return calls / elapsed


def main() -> None:
    parser = _cli.parser(__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(
        f"simulator: rpc_sync round trips per wall-clock second, 2 workers, {args.calls} calls, "
        f"median of {args.repeat}"
    )
    for label, trace in (("trace on ", True), ("trace off", False)):
        rates = [round_trips_per_second(args.calls, trace, seed) for seed in range(args.repeat)]
        print(
            f"  {label}: {statistics.median(rates):>9,.0f} round trips/s "
            f"(min {min(rates):,.0f}, max {max(rates):,.0f})"
        )

    # Pairs measured back to back, in CPU time (less disturbed by other processes than wall time).
    def cpu_per_call(processes: bool, seed: int) -> float:
        start = time.process_time()
        round_trips_per_second(args.calls, True, seed, processes)
        return (time.process_time() - start) / args.calls

    pairs = [(cpu_per_call(False, seed), cpu_per_call(True, seed)) for seed in range(args.repeat)]
    ratios = [p / plain for plain, p in pairs]
    print(
        "  trace on, a process per worker (the run command): "
        f"{statistics.median(p for _, p in pairs) * 1e6:.1f} us CPU per round trip vs "
        f"{statistics.median(plain for plain, _ in pairs) * 1e6:.1f} us plain: "
        f"{statistics.median(ratios):.2f}x (pairs: min {min(ratios):.2f}x, max {max(ratios):.2f}x)"
    )


if __name__ == "__main__":
    main()
