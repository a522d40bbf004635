"""``twinrpc.rpc``: PyTorch's ``torch.distributed.rpc`` API, served by twinrpc."""

from __future__ import annotations

from .._errors import (
    AuthenticationError,
    NotInitializedError,
    RemoteError,
    RPCError,
    RPCTimeoutError,
    SerializationError,
    ShutdownError,
    WorkerUnavailableError,
)
from .._rref import RRef
from .._worker_info import WorkerInfo
from . import functions
from .api import (
    _get_debug_info,
    _rref_context_get_debug_info,
    _set_rpc_timeout,
    _wait_all,
    get_rpc_timeout,
    get_worker_info,
    get_worker_infos,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_SEND_RECV_THREADS,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
    BackendType,
    ProcessGroupRpcBackendOptions,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)

PyRRef = RRef

__all__ = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_SEND_RECV_THREADS",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
    "AuthenticationError",
    "BackendType",
    "NotInitializedError",
    "ProcessGroupRpcBackendOptions",
    "PyRRef",
    "RPCError",
    "RPCTimeoutError",
    "RRef",
    "RemoteError",
    "RpcBackendOptions",
    "SerializationError",
    "ShutdownError",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "WorkerUnavailableError",
    "_get_debug_info",
    "_rref_context_get_debug_info",
    "_set_rpc_timeout",
    "_wait_all",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "get_worker_infos",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
