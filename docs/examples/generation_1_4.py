"""The examples of PyTorch 1.4's RPC documentation, written as they are there, in both worlds.

PyTorch 1.4's forms: ``init_rpc`` without options (its default backend was ``PROCESS_GROUP``, its
rendezvous ``env://``), ``dist_autograd.backward(roots)`` and ``DistributedOptimizer.step()`` without a
context id (they use the current context). Only the imports differ from the 1.4 documentation.

Run it: ``python docs/examples/generation_1_4.py --world sim`` (one process, virtual time) or
``--world gloo`` (one process per worker, rendezvous through MASTER_ADDR and MASTER_PORT).
"""

from __future__ import annotations

import torch
from _two_worlds import chosen_world, run_processes, run_simulated
from torch import optim

# -- imports --
import twinrpc.autograd as dist_autograd  # was: import torch.distributed.autograd as dist_autograd
import twinrpc.rpc as rpc  # was: import torch.distributed.rpc as rpc
from twinrpc.optim import DistributedOptimizer  # was: from torch.distributed.optim import ...

# -- end imports --


def parameter(t: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.add(t, k)`` as a leaf that requires grad, so an optimizer can own it (see the page)."""
    return torch.add(t, k).requires_grad_()


# -- worker --
def run_worker(rank: int, world_size: int) -> dict[str, object] | None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    out = None
    if rank == 0:
        # rpc_sync, rpc_async and remote
        ret = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        fut1 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        fut2 = rpc.rpc_async("worker1", min, args=(1, 2))
        result = fut1.wait() + fut2.wait()
        rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        x = rref1.to_here() + rref2.to_here()

        # distributed autograd: backward(roots) runs in the current context
        with dist_autograd.context() as context_id:
            t1 = torch.rand((3, 3), requires_grad=True)
            t2 = torch.rand((3, 3), requires_grad=True)
            loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
            dist_autograd.backward([loss])
            grads = dist_autograd.get_gradients(context_id)

        # the distributed optimizer: step() uses the current context too
        with dist_autograd.context() as context_id:
            # Forward pass.
            rref1 = rpc.remote("worker1", parameter, args=(torch.ones(2), 3))
            rref2 = rpc.remote("worker1", parameter, args=(torch.ones(2), 1))
            loss = rref1.to_here() + rref2.to_here()

            # Backward pass.
            dist_autograd.backward([loss.sum()])

            # Optimizer.
            dist_optim = DistributedOptimizer(
                optim.SGD,
                [rref1, rref2],
                lr=0.05,
            )
            dist_optim.step()

        out = {
            "rpc_sync": ret.tolist(),
            "rpc_async": result.tolist(),
            "remote": x.tolist(),
            "gradients": [grads[t1].sum().item(), grads[t2].sum().item()],
            "after step": [[round(v, 4) for v in r.to_here().tolist()] for r in (rref1, rref2)],
            "worker": rpc.get_worker_info("worker1").id,
        }
    rpc.shutdown()
    return out


# -- end worker --


if __name__ == "__main__":
    world = chosen_world()
    run = run_simulated if world == "sim" else run_processes
    for key, value in run(run_worker, 2, 0).items():
        print(f"{key}: {value}")
