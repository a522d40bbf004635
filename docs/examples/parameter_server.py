"""A parameter server trained over RPC, on the simulator and on gloo, with RPCs and RRefs only.

Worker 0 owns a linear model in a ``ParameterServer`` object; the trainers (workers 1..N-1) hold an
RRef to it. Each step, a trainer fetches the weights, computes the gradient of its own batch with
*local* autograd, and sends it to the server, which applies it under a lock. (The version with
distributed autograd and ``DistributedOptimizer``, where the forward pass itself crosses workers, is
``examples/parameter_server.py``.)

Run it: ``python docs/examples/parameter_server.py --world sim`` or ``--world gloo``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading

import torch
import torch.multiprocessing as mp

import twinrpc.rpc as rpc

TRUE_W = torch.tensor([2.0, -3.0, 0.5])
STEPS = 30
LR = 0.1


class ParameterServer:
    def __init__(self) -> None:
        self.weights = torch.zeros(3)
        self.lock = threading.Lock()  # requests are served concurrently (a pool of worker threads)
        self.updates = 0

    def get_weights(self) -> torch.Tensor:
        with self.lock:
            return self.weights.clone()

    def apply_gradient(self, grad: torch.Tensor) -> int:
        with self.lock:
            self.weights -= LR * grad
            self.updates += 1
            return self.updates


def train(ps: rpc.RRef[ParameterServer], rank: int) -> float:
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(32, 3, generator=gen)
        y = x @ TRUE_W
        w = ps.rpc_sync().get_weights().requires_grad_()
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()  # local autograd: the gradient of this trainer's batch
        ps.rpc_sync().apply_gradient(w.grad)
    return loss.item()


def run_worker(rank: int, world_size: int, init_method: str | None) -> dict[str, object] | None:
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=30)
    if init_method is not None:
        options.init_method = init_method
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    report = None
    if rank == 0:
        ps = rpc.RRef(ParameterServer())  # owned here; forked to each trainer by the calls below
        futs = [rpc.rpc_async(r, train, args=(ps, r)) for r in range(1, world_size)]
        losses = [f.wait() for f in futs]
        server = ps.local_value()
        report = {"weights": server.weights.tolist(), "updates": server.updates, "losses": losses}
        del ps, server
    rpc.shutdown()
    return report


def run_simulated(world_size: int = 3) -> dict[str, object]:
    from twinrpc.simulator import Simulation

    return Simulation(world_size=world_size, seed=0).run(run_worker, world_size, None).values()[0]


def _spawned(rank: int, world_size: int, init_method: str, out: str) -> None:
    report = run_worker(rank, world_size, init_method)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)


def run_gloo(world_size: int = 3) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_spawned, args=(world_size, init_method, out), nprocs=world_size, join=True)
        with open(out) as f:
            return json.load(f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", choices=("sim", "gloo"), default="sim")
    args = parser.parse_args()
    report = run_simulated() if args.world == "sim" else run_gloo()
    print(f"{report['updates']} updates, weights {[round(w, 3) for w in report['weights']]}")
    print(f"final batch losses per trainer: {[format(loss, '.2e') for loss in report['losses']]}")
