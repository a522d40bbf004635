"""Joining the world: rank and world size, the store, and the worker names.

``init_method`` is PyTorch's: ``env://`` (MASTER_ADDR, MASTER_PORT, and RANK/WORLD_SIZE as torchrun
sets them when not passed), ``tcp://host:port`` or ``file://path``. Every key twinrpc writes lives under
``twinrpc/<generation>/``, so a user's own ``init_process_group`` on the same store or file coexists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from twinrpc._worker_info import WorkerInfo

#: how long init waits for the other workers when rpc_timeout is 0 ("never")
_DEFAULT_STORE_TIMEOUT = 1800.0


@dataclass(frozen=True, slots=True)
class Joined:
    store: Any
    rank: int
    world_size: int
    workers: list[WorkerInfo]
    timeout: timedelta


def _resolve_rank_and_size(init_method: str, rank: int, world_size: int | None) -> tuple[int, int]:
    if rank < 0:
        env = os.environ.get("RANK")
        if env is None:
            raise ValueError(
                "init_rpc needs a rank: pass rank=... or set RANK in the environment (torchrun sets it)"
            )
        rank = int(env)
    if world_size is None or world_size == 0:
        env = os.environ.get("WORLD_SIZE")
        if env is None:
            raise ValueError(
                "init_rpc needs a world size: pass world_size=... or set WORLD_SIZE in the environment "
                "(torchrun sets it); twinrpc does not support dynamic groups (world_size=None)"
            )
        world_size = int(env)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size}")
    return rank, world_size


def join(
    name: str, rank: int, world_size: int | None, init_method: str, rpc_timeout: float, generation: int
) -> Joined:
    """Rendezvous, exchange names (refusing duplicates) and return the world's workers."""
    rank, world_size = _resolve_rank_and_size(init_method, rank, world_size)
    timeout = timedelta(seconds=rpc_timeout if rpc_timeout > 0 else _DEFAULT_STORE_TIMEOUT)
    store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))  # type: ignore[attr-defined]
    store.set_timeout(timeout)
    store = dist.PrefixStore(f"twinrpc/{generation}", store)  # type: ignore[attr-defined]
    store.set(f"name/{rank}", name)
    keys = [f"name/{r}" for r in range(world_size)]
    store.wait(keys)
    names = [store.get(k).decode() for k in keys]
    seen: dict[str, int] = {}
    for r, n in enumerate(names):
        if n in seen:
            raise RuntimeError(
                f"RPC worker name {n} is not unique. Workers {seen[n]} and {r} share the same name."
            )
        seen[n] = r
    return Joined(store, rank, world_size, [WorkerInfo(n, r) for r, n in enumerate(names)], timeout)
