"""A small torch-style RPC program run on twinrpc's simulator: three workers, a few RPCs, a remote
reference, a remote error and a timeout, then the timeline of what happened.

Run it: ``python examples/hello_simulator.py [--seed N]``.
"""

from __future__ import annotations

import argparse

import torch
from twinrpc.simulator import Simulation, sleep

import twinrpc.rpc as rpc


def scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    return t * factor


def slow_echo(x: int) -> int:
    sleep(5.0)  # five seconds of virtual time: instant in wall time
    return x


def fail(msg: str) -> None:
    raise ValueError(msg)


def program(rank: int) -> str:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    report = ""
    if rank == 0:
        lines = []
        a = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        lines.append(f"rpc_sync torch.add on worker1          -> {a.tolist()}")
        futs = [rpc.rpc_async(f"worker{r}", scale, args=(torch.arange(3.0), r)) for r in (1, 2)]
        lines.append(f"rpc_async scale on worker1 and worker2 -> {[f.wait().tolist() for f in futs]}")
        rref = rpc.remote("worker2", scale, args=(torch.ones(2), 10.0))
        lines.append(
            f"remote on worker2, to_here              -> {rref.to_here().tolist()} (owner {rref.owner_name()})"
        )
        try:
            rpc.rpc_sync("worker1", fail, args=("bad input",))
        except ValueError as exc:
            lines.append(f"remote ValueError re-raised            -> {str(exc).splitlines()[0]} ...")
        try:
            rpc.rpc_sync("worker2", slow_echo, args=(1,), timeout=1.0)
        except RuntimeError as exc:
            lines.append(f"timeout after 1 s of virtual time      -> {str(exc)[:60]}...")
        report = "\n".join(lines)
    rpc.shutdown()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeline", type=int, default=20, help="trace lines to print")
    args = parser.parse_args()
    result = Simulation(world_size=3, seed=args.seed).run(program)
    print(result.values()[0])
    print(
        f"\nvirtual time {result.virtual_time:.6f} s, {len(result.trace)} trace events, "
        f"digest {result.digest[:16]}"
    )
    print(f"first {args.timeline} events:")
    print(result.trace.text(args.timeline), end="")


if __name__ == "__main__":
    main()
