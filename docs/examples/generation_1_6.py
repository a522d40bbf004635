"""A program in PyTorch 1.6's RPC API, as its documentation writes it, in both worlds.

PyTorch 1.6's forms: ``BackendType.PROCESS_GROUP`` with ``ProcessGroupRpcBackendOptions``
(``num_send_recv_threads``, ``rpc_timeout`` in seconds, ``init_method``), ``@rpc.functions.async_execution``,
``dist_autograd.backward(context_id, roots)`` and ``DistributedOptimizer.step(context_id)``. Only the
imports differ from the 1.6 documentation.

Run it: ``python docs/examples/generation_1_6.py --world sim`` or ``--world gloo``.
"""

from __future__ import annotations

import os
import tempfile

import torch
from _two_worlds import chosen_world, run_processes, run_simulated
from torch import optim

# -- imports --
import twinrpc.autograd as dist_autograd  # was: import torch.distributed.autograd as dist_autograd
import twinrpc.rpc as rpc  # was: import torch.distributed.rpc as rpc
from twinrpc.optim import DistributedOptimizer  # was: from torch.distributed.optim import ...

# -- end imports --


@rpc.functions.async_execution
def async_add_chained(to, x, y, z):  # as PyTorch 1.6's documentation writes it
    # This function runs on "worker1" and returns immediately when
    # the callback is installed through the `then(cb)` API. In the
    # mean time, the `rpc_async` to "worker2" can run concurrently.
    # When the return value of that `rpc_async` arrives at
    # "worker1", "worker1" will run the lambda function accordingly
    # and set the value for the previously returned `Future`, which
    # will then trigger RPC to send the result back to "worker0".
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


def parameter(seed: int) -> torch.Tensor:
    return torch.rand(3, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def scaled(rref: rpc.RRef[torch.Tensor], k: float) -> torch.Tensor:
    return rref.local_value() * k


# -- worker --
def run_worker(rank: int, world_size: int, init_method: str) -> dict[str, object] | None:
    rpc.init_rpc(
        f"worker{rank}",
        backend=rpc.BackendType.PROCESS_GROUP,
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc.ProcessGroupRpcBackendOptions(
            num_send_recv_threads=16,
            rpc_timeout=20,  # 20 second timeout
            init_method=init_method,
        ),
    )
    out = None
    if rank == 0:
        ret = rpc.rpc_sync("worker1", async_add_chained, args=("worker2", torch.ones(2), 1, 1))

        p1 = rpc.remote("worker1", parameter, args=(1,))
        p2 = rpc.remote("worker2", parameter, args=(2,))
        dist_optim = DistributedOptimizer(optim.SGD, [p1, p2], lr=0.05)
        with dist_autograd.context() as context_id:
            # Forward pass.
            loss = rpc.rpc_sync("worker1", scaled, args=(p1, 2.0)) + rpc.rpc_sync(
                "worker2", scaled, args=(p2, 3.0)
            )
            # Backward pass.
            dist_autograd.backward(context_id, [loss.sum()])
            # Optimizer.
            dist_optim.step(context_id)

        before = [parameter(1).detach(), parameter(2).detach()]
        after = [p1.to_here().detach(), p2.to_here().detach()]
        out = {
            "async_add_chained": ret.tolist(),
            "moved by": [round(float((b - a).mean()), 4) for a, b in zip(after, before, strict=True)],
            "num_send_recv_threads": rpc.ProcessGroupRpcBackendOptions().num_send_recv_threads,
            "rpc_timeout": rpc.get_rpc_timeout(),
        }
    rpc.shutdown()
    return out


# -- end worker --


if __name__ == "__main__":
    if chosen_world() == "sim":
        result = run_simulated(run_worker, 3, 0, "env://")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_processes(run_worker, 3, 0, f"file://{os.path.join(tmp, 'rendezvous')}")
    for key, value in result.items():
        print(f"{key}: {value}")
