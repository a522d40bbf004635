"""twinrpc.impl: the real multiprocess world over gloo process groups.

``init_rpc`` outside a simulation joins this world: rendezvous through a ``torch.distributed`` store
(``env://``, ``tcp://``, ``file://``, as PyTorch; see :mod:`._rendezvous`), one private gloo process
group per pair of workers, tensors sent as raw gloo buffers, a receiver thread per peer, a request pool
and a timer thread. Bad launch input raises :class:`LaunchError` before anything is opened.
"""

from __future__ import annotations

from twinrpc._world import Connection, JoinOptions

from ._auth import JobAuth
from ._exposure import raise_open_file_limit, warn_if_keyless_and_reachable
from ._rendezvous import LaunchError, join, join_dynamic, store_endpoint
from ._world import GlooWorld

__all__ = ["GlooWorld", "LaunchError", "connect"]


def connect(
    *, name: str, rank: int, world_size: int | None, options: JoinOptions, generation: int
) -> Connection:
    """The gloo world's ``twinrpc._world.Connect`` (installed as the ``gloo`` world in pyproject.toml):
    join the gloo world as ``name``: a static group of ``world_size`` workers (blocks until every
    worker has joined, at most ``rpc_timeout``), or without ``world_size`` a dynamic group (LIFE-5:
    returns connected to every current member, holding the group's membership token).

    Raises:
        LaunchError: missing MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, a rank outside the world, an
            unknown or malformed ``init_method`` (a ValueError and a RuntimeError).
        RPCTimeoutError: not every worker joined in time; the message names the missing ranks.
        AuthenticationError: the workers were not all started with the same key (``auth_key`` or
            ``TWINRPC_AUTH_KEY``; see impl/_auth.py).
    """
    auth = JobAuth(options.auth_key) if options.auth_key is not None else None
    raise_open_file_limit()
    # a live worker answers at once; the bound is the one a silent peer gets (or the rpc timeout)
    silence = options.heartbeat_interval * options.heartbeat_misses
    answer_wait = silence if silence > 0 else options.rpc_timeout if options.rpc_timeout > 0 else 60.0
    if world_size:
        joined = join(
            name, rank, world_size, options.init_method, options.rpc_timeout, generation, auth, answer_wait
        )
    else:
        joined = join_dynamic(
            name, rank, options.init_method, options.rpc_timeout, generation, auth, answer_wait
        )
    try:
        world = GlooWorld(
            joined,
            options.num_worker_threads,
            heartbeat_interval=options.heartbeat_interval,
            heartbeat_misses=options.heartbeat_misses,
            rpc_timeout=options.rpc_timeout,
        )
    except BaseException:
        if joined.group is not None:  # could not connect to every member: leave the list again
            joined.group.remove()
            joined.group.unlock()
        raise
    endpoint = store_endpoint(options.init_method)
    warn_if_keyless_and_reachable(None if endpoint is None else endpoint[0], auth is not None)
    me = next(w for w in joined.workers if w.id == joined.rank)
    return Connection(world, me, joined.workers)
