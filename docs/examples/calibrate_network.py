"""Fit the simulator's network model to round trips measured in a world, and save it.

    python docs/examples/calibrate_network.py --world gloo --out network.toml   # this machine
    python docs/examples/calibrate_network.py --world sim                       # a self-check

``--world gloo`` measures two twinrpc processes on this machine. ``--world sim`` measures a
simulation whose model is known (80 us latency, 1.5 GB/s, 30 us per message and end) and fits it
back: what the fit recovers is how much to trust it.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch.multiprocessing as mp
from twinrpc.simulator import NetworkModel, Simulation
from twinrpc.simulator.calibration import Pipelined, RoundTrip, fit_network_model, measure

import twinrpc.rpc as rpc

KNOWN = NetworkModel(latency=80e-6, jitter=0.0, bandwidth=1.5e9, message_cost=30e-6)


def worker(rank: int, quick: bool, options: Any = None) -> Any:
    """Both worlds run this: worker0 measures its round trips to worker1."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    samples = None
    if rank == 0:
        sizes = (0, 1024, 64 * 1024, 1024 * 1024) if quick else (0, 1024, 64 * 1024, 1 << 20, 16 << 20)
        samples = measure("worker1", sizes=sizes, calls=30 if quick else 200, pipelined_calls=500)
    rpc.shutdown()
    return samples


def _gloo_child(rank: int, quick: bool, init_method: str, queue: Any) -> None:
    samples = worker(rank, quick, rpc.RpcBackendOptions(init_method=init_method))
    if samples is not None:
        queue.put(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", choices=["sim", "gloo"], default="sim")
    parser.add_argument("--out", default=None, help="write the fitted model (.toml or .json)")
    parser.add_argument("--quick", action="store_true", help="sizes up to 1 MiB, fewer calls")
    args = parser.parse_args()
    if args.world == "sim":
        samples = Simulation(2, network=KNOWN).run(worker, args.quick).values()[0]
    else:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_gloo_child, args=(args.quick, f"file://{tmp}/rendezvous", queue), nprocs=2)
        samples = queue.get()
    fit = fit_network_model(
        [s for s in samples if isinstance(s, RoundTrip)], [s for s in samples if isinstance(s, Pipelined)]
    )
    print(fit.describe())
    if args.out:
        fit.model.dump(args.out)
        print(f"saved {args.out}: Simulation(network=NetworkModel.load({args.out!r}))")


if __name__ == "__main__":
    main()
