"""Runs a docs example's ``run_worker(rank, world_size, *args)`` in either of twinrpc's worlds.

Every example program under ``docs/examples`` that runs in both worlds ends the same way: one
``python <example>.py --world sim|gloo`` prints what one rank returned. This module is that ending,
so each example file holds only its program.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

Worker = Callable[..., Any]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_simulated(run_worker: Worker, world_size: int, rank: int, *args: Any) -> Any:
    """``run_worker`` on every worker of a simulation (seed 0); ``rank``'s value."""
    from twinrpc.simulator import Simulation

    return Simulation(world_size=world_size, seed=0).run(run_worker, world_size, *args).values()[rank]


def _spawned(
    rank: int, run_worker: Worker, world_size: int, keep: int, out: str, args: tuple[Any, ...]
) -> None:
    value = run_worker(rank, world_size, *args)
    if rank == keep:
        with open(out, "w") as f:
            json.dump(value, f)


def run_processes(run_worker: Worker, world_size: int, rank: int, *args: Any) -> Any:
    """``run_worker`` in ``world_size`` processes, rendezvous through ``env://`` (``MASTER_ADDR`` and
    ``MASTER_PORT`` as PyTorch's tutorials set them); ``rank``'s value, which must be JSON."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_spawned, args=(run_worker, world_size, rank, out, args), nprocs=world_size, join=True)
        with open(out) as f:
            return json.load(f)


def chosen_world() -> str:
    """The ``--world`` of the command line: ``sim`` (default) or ``gloo``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", choices=("sim", "gloo"), default="sim")
    return str(parser.parse_args().world)
