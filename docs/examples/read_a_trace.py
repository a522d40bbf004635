"""Read a trace: print it, save and load it, compare two runs, check that a scenario is deterministic.

Run it: ``python docs/examples/read_a_trace.py`` (the how-to "Read a trace" shows its output).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from twinrpc.simulator import RunResult, Simulation, Trace, check_determinism, diff_traces

import twinrpc.rpc as rpc


def add1(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def program(rank: int) -> None:
    """worker0 calls worker1 once, then both shut down."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        rpc.rpc_sync("worker1", add1, args=(torch.ones(2),))
    rpc.shutdown()


def save_and_load(result: RunResult, path: Path) -> Trace:
    result.trace.save(path)  # JSON lines: a header, then one event a line
    trace = Trace.load(path)
    assert trace.digest() == result.digest
    return trace


def compare(run_a: RunResult, run_b: RunResult) -> None:
    divergence = diff_traces(run_a.trace, run_b.trace)
    if divergence is not None:
        print(divergence.describe())


def main() -> None:
    result = Simulation(2, seed=4).run(program)
    print(result.trace.text(14), end="")  # text() ends with a newline
    with tempfile.TemporaryDirectory() as tmp:
        trace = save_and_load(result, Path(tmp) / "run.jsonl")
        print(f"saved and loaded: {len(trace.events())} events, digest {trace.digest()[:16]}")
    compare(result, Simulation(2, seed=5).run(program))
    check_determinism(program, world_size=2, seed=7)  # returns the first run's RunResult
    print("check_determinism: seed 7 twice, the same trace")


if __name__ == "__main__":
    main()
