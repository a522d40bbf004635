"""Joining the world: rank and world size, the store, and the worker names.

``init_method`` is PyTorch's: ``env://`` (MASTER_ADDR, MASTER_PORT, and RANK/WORLD_SIZE as torchrun
sets them when not passed), ``tcp://host:port`` or ``file://path``; ``rank`` and ``world_size`` may
also come from the URL's query (``tcp://h:p?rank=0&world_size=2``), as in ``init_process_group``.

Every key twinrpc writes lives under ``twinrpc/<generation>/``, so a user's own ``init_process_group``
on the same store or file coexists, in either order:

* ``file://``: both sides open the same file; FileStore counts its users and deletes the file when the
  last one closes, so neither side's keys disappear under the other.
* ``env://`` / ``tcp://`` on the same host:port: PyTorch's rendezvous creates multi-tenant TCPStores, so
  a second store on that port in rank 0's process shares the first one's server. When the user built the
  default group over a TCPStore of their own (not multi-tenant, so a second server cannot bind: PyTorch's
  RPC fails there with EADDRINUSE, pytorch/pytorch#41614), twinrpc reuses that store instead of binding.

Bad launch input raises :class:`LaunchError` naming what is wrong and how to fix it, before any
network or file is touched (PyTorch would hang for ever on a ``file://`` path in a missing directory).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

import torch.distributed as dist

from twinrpc._errors import AUTH_KEY_HINT, RPCError, RPCTimeoutError
from twinrpc._worker_info import WorkerInfo

from ._auth import AuthenticationError, JobAuth, refuse_marked
from ._dynamic_group import StoreGroup
from ._group_kind import StaleKindEntry, live_dynamic_group, live_static_group, mark_kind

#: how long init waits for the other workers when rpc_timeout is 0 ("never")
_DEFAULT_STORE_TIMEOUT = 1800.0

_SCHEMES = "env:// (with MASTER_ADDR and MASTER_PORT set), tcp://host:port or file:///path/to/file"


class LaunchError(RPCError, ValueError):
    """Bad launch input to ``init_rpc``: a missing variable, a bad rank or world size, a bad init_method.

    Both a ``ValueError`` (what PyTorch raises for a missing MASTER_ADDR or RANK) and a ``RuntimeError``
    (what it raises for an unknown scheme or a rank outside the world), so either ``except`` catches it.
    """


@dataclass(frozen=True, slots=True)
class Joined:
    store: Any
    rank: int
    world_size: int
    workers: list[WorkerInfo]
    timeout: timedelta
    #: True when ``store`` is (a prefix of) the user's default group's own TCPStore
    shares_user_store: bool = False
    #: where this worker's gloo pairs meet (``store`` in a static group; per join in a dynamic one)
    pair_store: Any = None
    #: the dynamic group's keys, holding its membership token (LIFE-5); None in a static group
    group: StoreGroup | None = None
    #: members whose world stopped without leaving the group: listed, but not connected to
    stopped: frozenset[int] = frozenset()
    #: the job key (impl/_auth.py): ``store`` authenticates every value; None: no key
    auth: JobAuth | None = None
    #: ``store`` bound to this run of a static group (with a key, MACed under the run key): where
    #: links are asked for when first used (impl/_link_table.py); None in a dynamic group
    run_store: Any = None


def _int_from(value: str, what: str, fix: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"init_rpc: {what} must be an integer, got {value!r}; {fix}") from None


def _split_query(init_method: str) -> tuple[str, dict[str, str]]:
    """``init_method`` without its ``rank``/``world_size`` query parameters, and those parameters."""
    url = urlparse(init_method)
    query = dict(parse_qsl(url.query))
    found: dict[str, str] = {k: query.pop(k) for k in ("rank", "world_size") if k in query}
    if not found:
        return init_method, found  # untouched: urlunparse would turn "env://" into "env:"
    return urlunparse(url._replace(query=urlencode(query))), found


def _resolve_rank(rank: int, query: dict[str, str]) -> int:
    if rank < 0:
        if "rank" in query:
            rank = _int_from(query["rank"], "the init_method's rank=", "fix the URL")
        elif "RANK" in os.environ:
            rank = _int_from(os.environ["RANK"], "RANK", "fix the environment variable RANK")
        else:
            raise LaunchError(
                "init_rpc needs this worker's rank: pass rank=... or set RANK in the environment "
                "(torchrun and torch.distributed.run set it for each worker)"
            )
    return rank


def _resolve_rank_and_size(rank: int, world_size: int, query: dict[str, str]) -> tuple[int, int]:
    """A static group's rank and size: ``world_size`` from init_rpc, or the URL's ``world_size=``."""
    rank = _resolve_rank(rank, query)
    if "world_size" in query:
        world_size = _int_from(query["world_size"], "the init_method's world_size=", "fix the URL")
    if world_size < 1:
        raise LaunchError(f"init_rpc: world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise LaunchError(
            f"init_rpc: rank {rank} is outside the world of size {world_size}; ranks run from 0 to "
            f"{world_size - 1}, one per worker: check rank= (or RANK) and world_size= (or WORLD_SIZE)"
        )
    return rank, world_size


def store_endpoint(init_method: str) -> tuple[str, int] | None:
    """The TCP host and port the store lives at (``env://``, ``tcp://``), after checking the input.

    Raises:
        LaunchError: the scheme is unknown, or what it needs is missing or malformed.
    """
    url = urlparse(init_method)
    if url.scheme == "env":
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise LaunchError(
                f"init_rpc with init_method='env://' needs {' and '.join(missing)} in the environment: "
                "set MASTER_ADDR to an address of the rank-0 worker's machine that every worker can reach "
                "and MASTER_PORT to a free port there (torchrun sets both), or pass "
                "init_method='tcp://host:port'"
            )
        port = _int_from(os.environ["MASTER_PORT"], "MASTER_PORT", "set it to a free TCP port (1-65535)")
        host = os.environ["MASTER_ADDR"]
    elif url.scheme == "tcp":
        try:
            port_or_none = url.port
        except ValueError:
            port_or_none = -1
        if not url.hostname or port_or_none is None or port_or_none < 0:
            raise LaunchError(
                f"init_rpc: init_method {init_method!r} needs a host and a port, as in "
                "'tcp://10.0.0.1:29500' (the rank-0 worker's address and a free port there)"
            )
        host, port = url.hostname, port_or_none
    elif url.scheme == "file":
        path = url.path
        if not path:
            raise LaunchError(
                f"init_rpc: init_method {init_method!r} has no path; use an absolute path, as in "
                "'file:///tmp/rendezvous' (three slashes), on a file system every worker can see"
            )
        directory = os.path.dirname(path) or "."
        if not os.path.isdir(directory):
            raise LaunchError(
                f"init_rpc: the directory {directory!r} of init_method {init_method!r} does not exist; "
                "create it first (every worker must see the same file)"
            )
        return None
    else:
        raise LaunchError(f"init_rpc: unknown init_method {init_method!r}; use {_SCHEMES}")
    if not 0 < port < 2**16:
        raise LaunchError(f"init_rpc: port {port} of {init_method!r} is not a TCP port (1-65535)")
    return host, port


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except OSError:
        return False


def _user_store_at(endpoint: tuple[str, int]) -> Any:
    """The TCPStore under the user's default process group, if it serves ``endpoint``; else None."""
    if not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, dist.PrefixStore):  # type: ignore[attr-defined]
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):  # type: ignore[attr-defined]
        return None
    host, port = endpoint
    return store if store.port == port and _same_host(store.host, host) else None


def _open_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> tuple[Any, bool]:
    """The rendezvous store, and whether it is the user's default group's own store."""
    endpoint = store_endpoint(init_method)
    shared = _user_store_at(endpoint) if endpoint is not None else None
    if shared is not None:
        # The user's store serves this port. Use it as it is, never changing its timeout (every wait
        # of ours passes its own); our reference keeps its server alive after the user's group goes.
        return shared, True
    try:
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))  # type: ignore[attr-defined]
    except (RuntimeError, ValueError) as exc:
        where = (
            f"{endpoint[0]}:{endpoint[1]}" if endpoint is not None else init_method.removeprefix("file://")
        )
        hint = (
            "rank 0 hosts the store there: check that it is running, that this address is reachable "
            "from this machine and that nothing else listens on that port"
            if endpoint is not None
            else "check that every worker sees the same file"
        )
        cls = RPCTimeoutError if "timed out" in str(exc).lower() else RPCError
        raise cls(
            f"init_rpc (rank {rank} of {world_size}) could not open the rendezvous store at {where} "
            f"(init_method={init_method!r}): {exc}; {hint}"
        ) from exc
    store.set_timeout(timeout)
    return store, False


def join(
    name: str,
    rank: int,
    world_size: int,
    init_method: str,
    rpc_timeout: float,
    generation: int,
    auth: JobAuth | None = None,
    answer_wait: float = 10.0,
) -> Joined:
    """Rendezvous as a member of a static group, exchange names (refusing duplicates) and return the
    world's workers. With ``auth`` every entry is authenticated with the job key, and the names are
    bound to this run (every rank posts a fresh nonce first: JobAuth.run).

    ``answer_wait``: with a key, how long a live worker of the other kind has to answer before the
    group's ``kind`` entry is refused as stale (impl/_group_kind.py).

    Blocks until every worker has joined, for at most ``rpc_timeout`` seconds (0: half an hour). A
    worker whose key differs from another's (or who has none while another has one) still posts its
    nonce, so that every worker finds the mismatch once all have posted theirs, rather than waiting.

    Raises:
        LaunchError: bad launch input (see the module docstring); nothing was opened.
        RPCTimeoutError: the other workers did not all join in time (says which ranks are missing).
        RPCError: the store could not be opened (unreachable MASTER_ADDR, port taken).
        AuthenticationError: another worker's entries are not authenticated with this worker's key.
    """
    init_method, query = _split_query(init_method)
    rank, world_size = _resolve_rank_and_size(rank, world_size, query)
    seconds = rpc_timeout if rpc_timeout > 0 else _DEFAULT_STORE_TIMEOUT
    timeout = timedelta(seconds=seconds)
    root, shared = _open_store(init_method, rank, world_size, timeout)
    store = dist.PrefixStore(f"twinrpc/{generation}", root if auth is None else auth.wrap(root))  # type: ignore[attr-defined]
    mine = f"name/{rank}"
    try:
        vouch = None if auth is None else (lambda found: live_dynamic_group(store, answer_wait))
        mark_kind(store, "static", vouch)
    except AuthenticationError as exc:
        # the others find the mismatch in our nonce instead of waiting for it
        store.set(f"nonce/{rank}", os.urandom(16).hex())
        raise _auth_failed(name, rank, init_method, exc) from exc
    if store.check([mine]):
        # Only this process writes its own name key, so it is left over from an earlier run.
        raise LaunchError(
            f"init_rpc: the rendezvous store of {init_method!r} already holds rank {rank}'s name from an "
            "earlier run (a FileStore file is deleted only when every process that opened it has closed "
            "it, which RPC's shutdown does not promise; PyTorch leaves it behind too); delete the file or "
            "use a new init_method for each run"
        )

    # Every rank posts a fresh nonce first: with a key, the names are MACed under a key hashed from
    # all of them, so an entry of an earlier run fails (impl/_auth.py, JobAuth.run); without one the
    # nonces are only waited for, so that a keyed peer finds this worker as soon as the others.
    nonces = [f"nonce/{r}" for r in range(world_size)]
    keys = [f"name/{r}" for r in range(world_size)]
    waiting = nonces
    names_store: Any = store
    try:
        if auth is None:
            store.set(nonces[rank], os.urandom(16).hex())
            store.wait(nonces, timeout)
            for r, k in enumerate(nonces):
                refuse_marked(store.get(k), f"rank {r}'s nonce")
        else:
            names_store = auth.run(store, rank, world_size, timeout)
        names_store.set(mine, name)
        waiting = keys
        store.wait(keys, timeout)
    except AuthenticationError as exc:
        raise _auth_failed(name, rank, init_method, exc) from exc
    except RuntimeError as exc:
        missing = [r for r, k in enumerate(waiting) if not store.check([k])]
        # so that a later attempt on the same store is not taken for stale
        store.delete_key(mine)
        store.delete_key(nonces[rank])
        # Drop our store now, not when the traceback goes: a FileStore deletes its file when its
        # last user closes it, so a failed attempt does not leave a stale file behind.
        del store, root, names_store
        raise RPCTimeoutError(
            f"init_rpc as '{name}' (rank {rank}) timed out after {seconds:g} s waiting for rank(s) "
            f"{missing} of a world of {world_size} to join at {init_method!r}; start every worker with "
            "the same init_method and world_size, or raise rpc_timeout"
        ) from exc
    names = []
    for r, k in enumerate(keys):
        try:
            raw = names_store.get(k)
            if auth is None:
                refuse_marked(raw, f"rank {r}'s name")
        except AuthenticationError as exc:
            raise _auth_failed(name, rank, init_method, exc) from exc
        names.append(raw.decode())
    seen: dict[str, int] = {}
    for r, n in enumerate(names):
        if n in seen:
            raise RuntimeError(
                f"RPC worker name {n} is not unique. Workers {seen[n]} and {r} share the same name."
            )
        seen[n] = r
    return Joined(
        store,
        rank,
        world_size,
        [WorkerInfo(n, r) for r, n in enumerate(names)],
        timeout,
        shared,
        auth=auth,
        run_store=names_store,
    )


def _auth_failed(name: str, rank: int, init_method: str, exc: AuthenticationError) -> AuthenticationError:
    hint = "" if isinstance(exc, StaleKindEntry) else f" {AUTH_KEY_HINT}"  # the keys agree there
    return AuthenticationError(f"init_rpc as '{name}' (rank {rank}) at {init_method!r}: {exc}.{hint}")


def join_dynamic(
    name: str,
    rank: int,
    init_method: str,
    rpc_timeout: float,
    generation: int,
    auth: JobAuth | None = None,
    answer_wait: float = 10.0,
) -> Joined:
    """Join (or start) a dynamic group (LIFE-5): take the membership token, check the name and rank
    are free, list this worker and post a join notice to every member. Returns holding the token,
    which ``init_rpc`` gives back once every member knows this worker (twinrpc._membership).
    ``answer_wait``: as ``join``'s.

    Raises:
        LaunchError: bad launch input, as ``join``; also ``world_size=`` in the init_method's query.
        RuntimeError: PyTorch's errors for a static group on this store, a taken name or rank.
        AuthenticationError: the group's entries are not authenticated with this worker's key.
    """
    init_method, query = _split_query(init_method)
    if "world_size" in query:
        raise LaunchError(
            f"init_rpc: init_method {init_method!r} has world_size= in its query but init_rpc got no "
            "world_size: pass world_size to init_rpc for a static group, or drop it from the URL for a "
            "dynamic one"
        )
    rank = _resolve_rank(rank, query)
    seconds = rpc_timeout if rpc_timeout > 0 else _DEFAULT_STORE_TIMEOUT
    timeout = timedelta(seconds=seconds)
    endpoint = store_endpoint(init_method)
    from torch.distributed.rendezvous import _rendezvous_helper  # what PyTorch's RPC uses here

    try:
        root, _, _ = next(_rendezvous_helper(init_method, rank, None, timeout=timeout))
    except (RuntimeError, ValueError) as exc:
        where = f"{endpoint[0]}:{endpoint[1]}" if endpoint is not None else init_method
        raise RPCError(
            f"init_rpc (rank {rank}, dynamic group) could not open the rendezvous store at {where}: {exc}"
        ) from exc
    root.set_timeout(timeout)
    store = dist.PrefixStore(f"twinrpc/{generation}", root if auth is None else auth.wrap(root))  # type: ignore[attr-defined]
    try:
        vouch = None if auth is None else (lambda found: live_static_group(store, auth, answer_wait))
        mark_kind(store, "dynamic", vouch)
        group = StoreGroup(store, WorkerInfo(name, rank), timeout, keyed=auth is not None)
        group.lock()
    except AuthenticationError as exc:
        raise _auth_failed(name, rank, init_method, exc) from exc
    try:
        others = group.add_me()
    except AuthenticationError as exc:
        group.unlock()
        raise _auth_failed(name, rank, init_method, exc) from exc
    except BaseException:
        group.unlock()
        raise
    workers = sorted([m.info for m in others] + [group.me.info], key=lambda w: w.id)
    return Joined(
        store,
        rank,
        len(workers),
        workers,
        timeout,
        pair_store=group.pair_store(group.me.uid),
        group=group,
        stopped=frozenset(m.info.id for m in others if m.stopped),
        auth=auth,
    )
