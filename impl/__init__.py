"""twinrpc.impl: the real multiprocess world over gloo process groups.

``init_rpc`` outside a simulation joins this world: rendezvous through a ``torch.distributed`` store
(``env://``, ``tcp://``, ``file://``, as PyTorch; see :mod:`._rendezvous`), one private gloo process
group per pair of workers, tensors sent as raw gloo buffers, a receiver thread per peer, a request pool
and a timer thread. Bad launch input raises :class:`LaunchError` before anything is opened.
"""

from __future__ import annotations

from typing import Any

from twinrpc._worker_info import WorkerInfo
from twinrpc.rpc.options import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_MISSES

from ._rendezvous import LaunchError, join
from ._world import GlooWorld

__all__ = ["GlooWorld", "LaunchError", "connect"]


def connect(
    *, name: str, rank: int, world_size: int | None, options: Any, generation: int
) -> tuple[GlooWorld, WorkerInfo, list[WorkerInfo]]:
    """Join the gloo world as ``name``; blocks until every worker has joined (at most ``rpc_timeout``).

    Raises:
        LaunchError: missing MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, a rank outside the world, an
            unknown or malformed ``init_method`` (a ValueError and a RuntimeError).
        RPCTimeoutError: not every worker joined in time; the message names the missing ranks.
    """
    joined = join(name, rank, world_size, options.init_method, options.rpc_timeout, generation)
    world = GlooWorld(
        joined,
        options.num_worker_threads,
        heartbeat_interval=getattr(options, "heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL),
        heartbeat_misses=getattr(options, "heartbeat_misses", DEFAULT_HEARTBEAT_MISSES),
        rpc_timeout=options.rpc_timeout,
    )
    return world, joined.workers[joined.rank], joined.workers
