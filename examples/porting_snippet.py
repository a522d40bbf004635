import torch
from twinrpc.simulator import Simulation

import twinrpc.rpc as rpc  # was: import torch.distributed.rpc as rpc


def program(rank):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        print(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)))
    rpc.shutdown()


result = Simulation(world_size=2, seed=7).run(program)  # program(rank) on each simulated worker
print(result.trace.text(6))  # what happened, in virtual time
