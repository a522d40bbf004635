"""The RPC API, with ``torch.distributed.rpc``'s names, signatures and defaults.

Every function finds this worker's agent through :mod:`twinrpc._current`, so the same program runs in
the simulator (many workers in one process) and in the real world (one worker per process).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .._agent import RpcAgent
from .._current import current_agent, current_slot
from .._future import Future
from .._heap import freeze_heap
from .._key_source import auth_key_of
from .._membership import join_group
from .._rref import RRef
from .._torch_builtins import builtin_name
from .._unpickle_allow import UnpickleAllowlist
from .._worker_info import WorkerInfo, check_worker_name
from .._world import JoinOptions
from .options import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_MISSES,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
    BackendType,
    ProcessGroupRpcBackendOptions,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)

T = TypeVar("T")


def is_available() -> bool:
    return True


def init_rpc(
    name: str,
    backend: BackendType | None = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Join the RPC group as worker ``name``.

    With ``world_size`` this is a static group: blocks until every worker has joined. Without it
    (``None`` or 0), a dynamic group that workers join and leave at any time (LIFE-5): returns once every
    current member knows this worker; ``shutdown`` then leaves the group and the others keep working.
    Inside a :class:`twinrpc.simulator.Simulation` this joins the simulated world; otherwise the real
    multiprocess world. Raises RuntimeError("RPC is already initialized") when called twice.
    """
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError("Argument backend must be a member of BackendType")
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, RpcBackendOptions):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"Argument rank must be an int, but got {type(rank).__name__}")
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool)):
        raise TypeError(f"Argument world_size must be an int, but got {type(world_size).__name__}")
    check_worker_name(name)
    _check_options_match_backend(backend, rpc_backend_options)
    if isinstance(getattr(rpc_backend_options, "rpc_timeout", None), datetime.timedelta):
        raise TypeError("rpc_timeout must be a float number of seconds, not a timedelta")
    slot = current_slot()
    if slot.agent is not None:
        raise RuntimeError(f"RPC is already initialized (this worker is {slot.agent.info})")
    options = _join_options(rpc_backend_options if rpc_backend_options is not None else RpcBackendOptions())
    world, info, workers = slot.connect(
        name=name, rank=rank, world_size=world_size, options=options, generation=slot.generation
    )
    # A simulated process started by its program's own launcher (mp.spawn) joins as the rank it
    # asks for: connecting moved it to that worker's slot (simulator/_launch/_processes.py).
    slot = current_slot()
    slot.generation += 1
    allow = options.unpickle_allow
    agent = RpcAgent(
        world,
        info,
        workers,
        options.rpc_timeout,
        options.num_worker_threads,
        UnpickleAllowlist(allow) if allow is not None else None,
    )
    slot.agent = agent
    world.start(agent)
    membership = world.membership
    if membership is not None:  # a dynamic group (LIFE-5): tell the members, who may call us now
        try:
            join_group(agent, membership)
        finally:
            if not agent.running:
                slot.agent = None
    if world.owns_process:
        # torch's objects, and everything else alive by now, are not walked by every full collection
        freeze_heap()


def _join_options(options: RpcBackendOptions) -> JoinOptions:
    """What the world is told, read once from the user's options. A subclass may skip
    ``RpcBackendOptions.__init__`` (a program's own options class): what it lacks has the default."""
    allow = getattr(options, "unpickle_allow", None)
    return JoinOptions(
        rpc_timeout=options.rpc_timeout,
        init_method=options.init_method,
        num_worker_threads=options.num_worker_threads,
        heartbeat_interval=float(getattr(options, "heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL)),
        heartbeat_misses=int(getattr(options, "heartbeat_misses", DEFAULT_HEARTBEAT_MISSES)),
        unpickle_allow=None if allow is None else tuple(allow),
        auth_key=auth_key_of(options),
    )


#: the options class PyTorch requires for each backend (its ``*_init_backend_handler``s check it)
_OPTIONS_OF_BACKEND: dict[BackendType, type[RpcBackendOptions]] = {
    BackendType.TENSORPIPE: TensorPipeRpcBackendOptions,
    BackendType.PROCESS_GROUP: ProcessGroupRpcBackendOptions,
}


def _check_options_match_backend(backend: BackendType | None, options: RpcBackendOptions | None) -> None:
    """PyTorch's check (LIFE-3, LIFE-8): options of the other backend's class are a TypeError.

    Both backends select the same twinrpc world; the check only keeps a program that PyTorch refuses
    from running here. twinrpc's base :class:`RpcBackendOptions` goes with either backend.
    """
    if backend is None or options is None:
        return
    expected = _OPTIONS_OF_BACKEND[backend]
    for other_backend, other in _OPTIONS_OF_BACKEND.items():
        if other is not expected and isinstance(options, other) and not isinstance(options, expected):
            raise TypeError(
                f"`rpc_backend_options` must be a `{expected.__name__}`. {options} (backend={backend!r} "
                f"takes {expected.__name__}; {type(options).__name__} goes with {other_backend!r})"
            )


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Leave the RPC group.

    ``graceful=True`` is a barrier: it returns once every worker has called shutdown and no RPC is in
    flight anywhere (nested calls included), after deleting this worker's user RRefs. ``timeout``
    (seconds, 0 = unbounded) bounds those waits. ``graceful=False`` tears down locally at once.
    """
    agent = current_agent()
    slot = current_slot()
    # Read once, up front: in a simulation all workers share this module, and a graceful shutdown is
    # a barrier, so every worker sees the value the program had set when it called shutdown().
    ignore_rref_leak = bool(_ignore_rref_leak)
    try:
        agent.shutdown(graceful, float(timeout), ignore_rref_leak=ignore_rref_leak)
    finally:
        if slot.agent is agent:
            slot.agent = None


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """This worker's WorkerInfo, or the named worker's."""
    agent = current_agent()
    if worker_name is None:
        return agent.info
    return agent.resolve(worker_name)


def get_worker_infos() -> list[WorkerInfo]:
    """Every worker of the group, ordered by id."""
    return list(current_agent().workers)


def get_rpc_timeout() -> float:
    """The default RPC timeout in seconds."""
    return current_agent().rpc_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout; affects only RPCs issued afterwards."""
    current_agent().rpc_timeout = float(rpc_timeout)


def _check_builtin_arguments(
    to: str | int | WorkerInfo, func: Any, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None
) -> None:
    """A builtin operator's arguments must match one of its schemas, checked on the caller before
    anything is sent (RPC-3), with PyTorch's matcher and its message."""
    qualified_name = builtin_name(func)
    if qualified_name is None or not isinstance(args, (tuple, list, type(None))):
        return  # not a builtin, or arguments the agent refuses with its own error
    if not isinstance(kwargs, (dict, type(None))):
        return
    try:
        torch._C._jit_resolve_packet(qualified_name, *(args or ()), **(kwargs or {}))
    except RuntimeError as exc:
        raise RuntimeError(
            f"{exc}\n(twinrpc: the arguments of {qualified_name} match none of its schemas, so the call "
            f"to {to!r} was not sent)"
        ) from exc


def _check_call(
    to: str | int | WorkerInfo, func: Any, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None
) -> None:
    """What every call checks before anything is sent: a callable, and a builtin's arguments."""
    if not callable(func):
        raise TypeError("function should be callable.")
    _check_builtin_arguments(to, func, args, kwargs)


def rpc_async(
    to: str | int | WorkerInfo,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]:
    """Run ``func(*args, **kwargs)`` on ``to``; returns a Future of the result at once.

    Arguments are pickled now (an unpicklable one raises here and sends nothing). Thread-safe.
    ``timeout``: seconds, -1 = the default at call time, 0 = never.
    """
    agent = current_agent()
    _check_call(to, func, args, kwargs)
    fut = agent.call(to, func, args, kwargs, timeout)
    _track(fut)
    return fut


def rpc_sync(
    to: str | int | WorkerInfo,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T:
    """Run ``func(*args, **kwargs)`` on ``to`` and return its result; blocks. Re-raises the remote
    exception with its original type, the remote worker and traceback in the message."""
    agent = current_agent()
    _check_call(to, func, args, kwargs)
    result: T = agent.call(to, func, args, kwargs, timeout).wait()
    return result


def remote(
    to: str | int | WorkerInfo,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]:
    """Run ``func`` on ``to``, which owns the result; returns an RRef to it at once."""
    agent = current_agent()
    _check_call(to, func, args, kwargs)
    return agent.remote(to, func, args, kwargs, timeout)


# -- _wait_all: wait on every rpc_async issued inside the block (PyTorch's private helper) --------
# Per task (a thread, or a simulated task), so simulated workers sharing a process don't mix them.
_TRACKED: contextvars.ContextVar[list[Future[Any]] | None] = contextvars.ContextVar(
    "twinrpc_wait_all", default=None
)


def _track(fut: Future[Any]) -> None:
    tracked = _TRACKED.get()
    if tracked is not None:
        tracked.append(fut)


@contextlib.contextmanager
def _wait_all() -> Iterator[list[Future[Any]]]:
    """Wait, on exit, for every rpc_async issued inside the block by this task."""
    futures: list[Future[Any]] = []
    token = _TRACKED.set(futures)
    try:
        yield futures
    finally:
        _TRACKED.reset(token)
    from .._future import wait_all

    wait_all(futures)


def _get_current_rpc_agent() -> RpcAgent:
    """This worker's agent (PyTorch's private accessor; portable code uses its ``get_worker_infos()``)."""
    return current_agent()


def _get_debug_info() -> dict[str, Any]:
    """This worker's RRef context and agent state, as ``torch.distributed.rpc._get_debug_info()``.

    PyTorch's RRef keys, with string values as in PyTorch: ``num_owner_rrefs`` (owned values that
    were forked), ``num_forks`` (live forks the owners here know), ``num_pending_users`` (user RRefs
    here not yet confirmed by their owner), ``num_pending_futures`` (owners that requests wait on
    before their ``remote()`` arrived). twinrpc adds ``num_pending_children`` (forks sent by users
    here and not yet accepted), ``num_users``, ``num_deferred_deletes``, ``num_control_unacked``,
    ``num_control_resends`` and ``rref_forks`` (owned rref id -> its live fork ids), and the agent's
    counters under ``agent.*``.
    """
    agent = current_agent()
    info = agent.rrefs.debug_info()
    for key, value in agent.statistics().items():
        if key not in info:
            info[f"agent.{key}"] = str(value)
    return info


def _rref_context_get_debug_info() -> dict[str, Any]:
    """The RRef part of :func:`_get_debug_info` (PyTorch's ``_rref_context_get_debug_info``)."""
    return current_agent().rrefs.debug_info()


#: PyTorch's flag (SHUT-4): when False, ``shutdown()`` raises RuntimeError("Leaking RRef ...") if an
#: owner on this worker still has live forks; when True (default) the leak is only logged.
_ignore_rref_leak = True
