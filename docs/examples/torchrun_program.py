"""An RPC program for torchrun: rank, world size and the rendezvous come from the environment.

Run it: ``torchrun --nproc-per-node 2 docs/examples/torchrun_program.py`` (one machine), or on each
of several machines ``torchrun --nnodes 2 --nproc-per-node 1 --node-rank <0|1>
--master-addr <host of node 0> --master-port 29500 docs/examples/torchrun_program.py``.
"""

from __future__ import annotations

import os

import torch

import twinrpc.rpc as rpc


def hostname() -> str:
    return f"{os.uname().nodename} (pid {os.getpid()})"


def main() -> None:
    rank = int(os.environ["RANK"])
    # No rank or init_method: init_rpc reads RANK, and the default init_method "env://" reads
    # MASTER_ADDR and MASTER_PORT, all set by torchrun. world_size makes the group static (without it,
    # as in PyTorch, workers would join a dynamic group one by one).
    rpc.init_rpc(f"worker{rank}", world_size=int(os.environ["WORLD_SIZE"]))
    peer = (rank + 1) % len(rpc.get_worker_infos())
    where = rpc.rpc_sync(peer, hostname)
    total = rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), rank))
    print(f"worker{rank}: worker{peer} runs on {where}, returned {total.tolist()}", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
