"""A torch.distributed.rpc program ported to twinrpc by changing its imports, run in both worlds.

The worker function ``run_worker`` is written exactly as for PyTorch (``init_rpc`` ... ``shutdown``,
launched once per rank). Only the import differs.

Run it: ``python docs/examples/porting.py --world sim`` (one process, virtual time) or
``python docs/examples/porting.py --world gloo`` (one process per worker).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.multiprocessing as mp

# -- imports --
import twinrpc.rpc as rpc  # was: import torch.distributed.rpc as rpc
from twinrpc.rpc import RRef  # was: from torch.distributed.rpc import RRef

# -- end imports --


class Accumulator:
    """State that lives on its owner; other workers reach it through an RRef."""

    def __init__(self, size: int) -> None:
        self.total = torch.zeros(size)

    def add(self, t: torch.Tensor) -> torch.Tensor:
        self.total += t
        return self.total.clone()


def square(t: torch.Tensor) -> torch.Tensor:
    return t * t


def run_worker(rank: int, world_size: int, init_method: str | None) -> list[float] | None:
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=20)
    if init_method is not None:
        options.init_method = init_method
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    result = None
    if rank == 0:
        # a builtin operator and a Python function, sync and async
        three = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(3), 2))
        fut = rpc.rpc_async("worker1", square, args=(three,))
        # a remote object: created on worker1, called through its RRef
        acc: RRef[Accumulator] = rpc.remote("worker1", Accumulator, args=(3,))
        acc.rpc_sync().add(fut.wait())
        total = acc.rpc_sync().add(torch.ones(3))
        result = total.tolist()
    rpc.shutdown()  # graceful: waits for every worker and every outstanding call
    return result


def run_simulated(world_size: int = 2) -> list[float]:
    from twinrpc.simulator import Simulation

    result = Simulation(world_size=world_size, seed=0).run(run_worker, world_size, None)
    return result.values()[0]


def _spawned(rank: int, world_size: int, init_method: str, out: str) -> None:
    value = run_worker(rank, world_size, init_method)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(value, f)


def run_gloo(world_size: int = 2) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        out = os.path.join(tmp, "result")
        mp.spawn(_spawned, args=(world_size, init_method, out), nprocs=world_size, join=True)
        with open(out) as f:
            return json.load(f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", choices=("sim", "gloo"), default="sim")
    args = parser.parse_args()
    print(run_simulated() if args.world == "sim" else run_gloo())
