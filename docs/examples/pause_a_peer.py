"""A program that puts a fault on its own simulated run: rank 0 pauses rank 1, then calls it.

Run it: ``python -m twinrpc.simulator run --nproc-per-node 2 docs/examples/pause_a_peer.py``. Under
torchrun (the gloo world) ``current()`` is ``None`` and nothing is paused.
"""

from __future__ import annotations

import os
import time

import torch.distributed.rpc as rpc
import twinrpc.simulator


def echo(x: int) -> int:
    return x


def main() -> None:
    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    if rank == 0:
        sim = twinrpc.simulator.current()
        if sim is not None:  # simulated: worker 1 stops for 5 s of virtual time, from here
            sim.pause(1, 5.0)
        start = time.time()
        rpc.rpc_sync("worker1", echo, args=(1,))
        print(f"worker1 answered after {time.time() - start:.1f} s")
    rpc.shutdown()


if __name__ == "__main__":
    main()
