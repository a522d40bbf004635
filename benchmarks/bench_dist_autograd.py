"""Distributed forward + backward + optimizer step per second, twinrpc (gloo world) vs PyTorch (TensorPipe).

Two processes: worker1 owns a 256x256 weight (held in an RRef); worker0 sends a 256x256 input, worker1
multiplies (the matmul crosses the boundary both ways: input out, result back), worker0 takes the loss,
runs the distributed backward (gradients return to worker1) and steps a DistributedOptimizer (SGD).

    python benchmarks/bench_dist_autograd.py [--iters 300] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

SYSTEMS = {
    "twinrpc": ("twinrpc.rpc", "twinrpc.autograd", "twinrpc.optim"),
    "torch": ("torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim"),
}
_W: dict[str, Any] = {}


def _weight() -> torch.Tensor:
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).requires_grad_()


def _mm(w: Any, x: torch.Tensor) -> torch.Tensor:
    return x @ w.local_value()


def _worker(rank: int, system: str, init: str, iters: int, repeat: int, out: Any) -> None:
    torch.set_num_threads(1)
    rpc, dist_autograd, optim = (importlib.import_module(m) for m in SYSTEMS[system])
    if system == "torch":
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, num_worker_threads=8)
    else:
        opts = rpc.RpcBackendOptions(init_method=init)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        w = rpc.remote("worker1", _weight)
        opt = optim.DistributedOptimizer(torch.optim.SGD, [w], lr=1e-6)
        x = torch.randn(256, 256)
        rates = []
        for r in range(repeat + 1):
            t0 = time.perf_counter()
            for _ in range(iters):
                with dist_autograd.context() as cid:
                    loss = rpc.rpc_sync("worker1", _mm, args=(w, x)).sum()
                    dist_autograd.backward(cid, [loss])
                    opt.step(cid)
            if r:  # the first round warms up
                rates.append(iters / (time.perf_counter() - t0))
        out.put((system, rates))
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results: dict[str, list[float]] = {}
    for system in SYSTEMS:
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            mp.start_processes(
                _worker,
                args=(system, f"file://{d}/rdv", args.iters, args.repeat, q),
                nprocs=2,
                start_method="spawn",
            )
        name, rates = q.get()
        results[name] = rates
    print("distributed forward+backward+step, 2 workers, 256x256 matmul across the boundary (it/s)")
    for name, rates in results.items():
        print(
            f"  {name:<8} median {statistics.median(rates):8.1f}  (min {min(rates):.1f}, max {max(rates):.1f})"
        )
    ratio = statistics.median(results["twinrpc"]) / statistics.median(results["torch"])
    print(f"  twinrpc / torch: {ratio:.2f}x (target >= 0.8x)")


if __name__ == "__main__":
    main()
