"""Programs the trace tests run on the simulator (and, for the gloo recorder, in real processes)."""

from __future__ import annotations

import os
import random
import sys
import time

import torch
from twinrpc.simulator import sleep

import twinrpc.autograd as dist_autograd
import twinrpc.rpc as rpc


def add1(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def rpc_calls(rank: int, world_size: int = 2, calls: int = 3) -> None:
    """Rank 0 makes ``calls`` rpc_sync calls to worker1; everyone shuts down."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        for i in range(calls):
            rpc.rpc_sync("worker1", add1, args=(torch.ones(2) * i,))
    rpc.shutdown()


def rich(rank: int) -> float | None:
    """Three workers: calls, a remote() whose RRef is shared with a third worker and fetched there, and
    a distributed forward/backward through worker1."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    out = None
    if rank == 0:
        rpc.rpc_sync("worker2", add1, args=(torch.zeros(1),))
        rref = rpc.remote("worker1", double, args=(torch.ones(2),))
        rpc.rpc_sync("worker2", _fetch, args=(rref,))
        del rref
        with dist_autograd.context() as context_id:
            t = torch.ones(2, requires_grad=True)
            y = rpc.rpc_sync("worker1", double, args=(t,))
            dist_autograd.backward(context_id, [y.sum()])
            out = float(dist_autograd.get_gradients(context_id)[t].sum())
    rpc.shutdown()
    return out


def _fetch(rref: rpc.RRef) -> float:
    return float(rref.to_here().sum())


def wall_clock_backoff(rank: int) -> None:
    """Nondeterministic on purpose: rank 0 waits a wall-clock-derived backoff (in virtual time)
    before each of two calls, so the calls leave at different virtual times from run to run."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        rpc.rpc_sync("worker1", add1, args=(torch.ones(1),))  # makes the link before any backoff
        for _ in range(2):
            sleep((time.perf_counter_ns() % 1_000_000) * 1e-9)
            rpc.rpc_sync("worker1", add1, args=(torch.ones(1),))
    rpc.shutdown()


def unseeded_random_payload(rank: int) -> None:
    """Nondeterministic on purpose: two payloads whose sizes come from an unseeded generator."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        rng = random.SystemRandom()
        for _ in range(2):
            rpc.rpc_sync("worker1", len, args=(bytes(rng.randrange(1, 1 << 16)),))
    rpc.shutdown()


if __name__ == "__main__":  # a real process of a gloo run: RANK, WORLD_SIZE, MASTER_* from the test
    rpc_calls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(sys.argv[1]))
