"""A parameter server that unpickles only what its allowlist names: the trainer's allowed call runs,
a call of anything else is refused before it runs, and the next allowed call works.

Run it: ``python docs/examples/restrict_unpickling.py`` (in the simulator; the gloo world behaves the
same, tests/security/test_unpickle_allow.py runs both).
"""

from __future__ import annotations

import torch
from twinrpc.simulator import Simulation

import twinrpc.rpc as rpc


def step(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def evil() -> None:
    """Stands for anything the parameter server should never run for a peer."""
    raise AssertionError("a refused call ran")


# -- program --
def worker(rank: int) -> None:
    # The allowlist is the receiving worker's: here only the parameter server has one.
    allow = ["__main__.step", "torch.add"] if rank == 1 else None
    options = rpc.RpcBackendOptions(unpickle_allow=allow)
    rpc.init_rpc(["trainer", "ps"][rank], rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        print("step:", rpc.rpc_sync("ps", step, args=(torch.ones(2),)))
        try:
            rpc.rpc_sync("ps", evil)
        except rpc.SerializationError as exc:
            print("evil refused:", "__main__.evil" in str(exc), "| nothing ran:", "nothing" in str(exc))
        print("add:", rpc.rpc_sync("ps", torch.add, args=(torch.ones(2), 1)))
    rpc.shutdown()


# -- end program --

if __name__ == "__main__":
    Simulation(world_size=2, seed=0).run(worker)
