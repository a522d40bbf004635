"""Backend options and backend types, with PyTorch's names and defaults."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

# the job key's sources, where the worlds and the docs of ``auth_key`` look for them
from .._key_source import AUTH_KEY_ENV as AUTH_KEY_ENV
from .._key_source import AUTH_KEY_FILE_ENV as AUTH_KEY_FILE_ENV
from .._key_source import auth_key_of as auth_key_of

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16
#: PyTorch 1.6's default ``num_send_recv_threads`` of ``ProcessGroupRpcBackendOptions``
#: (``kDefaultNumSendRecvThreads`` in torch/csrc/distributed/rpc/process_group_agent.h)
DEFAULT_NUM_SEND_RECV_THREADS = 4
UNSET_RPC_TIMEOUT = -1.0
DEFAULT_SHUTDOWN_TIMEOUT = 0
#: seconds between the gloo world's liveness frames on every link (0 = no heartbeats)
DEFAULT_HEARTBEAT_INTERVAL = 1.0
#: a peer silent for this many intervals while we wait for its next frame is declared dead
DEFAULT_HEARTBEAT_MISSES = 10


class BackendType(enum.Enum):
    """The RPC backends. Both members select the world the program runs in: the simulator inside a
    simulation, the gloo world otherwise.

    ``TENSORPIPE`` is PyTorch 2.x's name (and its default). ``PROCESS_GROUP`` is the name PyTorch 1.4 to
    1.7 used (the default of ``init_rpc`` up to 1.6), kept so programs written for those versions run
    unchanged (spec/lifecycle.md, LIFE-8); it pairs with
    :class:`~twinrpc.rpc.ProcessGroupRpcBackendOptions`.
    """

    TENSORPIPE = "TENSORPIPE"
    PROCESS_GROUP = "PROCESS_GROUP"

    def __repr__(self) -> str:
        return f"BackendType.{self.name}"  # PyTorch's repr (its members are generated at import time)


class RpcBackendOptions:
    """Options for ``init_rpc``; subclass it to carry more.

    Args:
        rpc_timeout: default timeout of every RPC in seconds (0 = never time out).
        init_method: rendezvous URL (``env://``, ``tcp://host:port``, ``file://path``).
        num_worker_threads: size of the pool that serves incoming requests (keyword-only; twinrpc
            accepts it here as well as on ``TensorPipeRpcBackendOptions``).
        heartbeat_interval: twinrpc only: seconds between the small liveness frames each
            worker sends on every link (0 turns heartbeats off). A peer whose process is stopped or
            cut off without its connection closing (SIGSTOP, a partition) is declared dead (ERR-7)
            after ``heartbeat_interval * heartbeat_misses`` seconds without any frame from it while
            this worker waits for one. Heartbeats come from a thread of their own, so a peer busy
            in a long user function stays alive. The simulator applies the same bound in virtual
            time (unless its ``NetworkModel.heartbeat_timeout`` overrides it).
        heartbeat_misses: twinrpc only: see ``heartbeat_interval``.
        unpickle_allow: twinrpc only: module patterns (``"mypkg.*"``, ``"torch.add"``, ``"__main__"``)
            naming the globals this worker may unpickle from other workers' requests and replies,
            beyond what twinrpc itself needs (tensors, RRefs, remote errors, torch's dtypes and
            optimizers). A message naming any other global is refused before anything in it runs:
            its caller gets a SerializationError naming the global. None (the default): any global,
            as PyTorch does. See docs/howto/restrict-unpickling.md.
        auth_key: twinrpc only: the job's secret (bytes). Every worker of the job must have the same
            one; None (the default) takes it from the file named by ``TWINRPC_AUTH_KEY_FILE``
            (readable by its owner only), else from the environment variable ``TWINRPC_AUTH_KEY``
            (UTF-8, removed from the environment once read), and without any, frames and rendezvous
            entries carry no authentication. With a
            key, the gloo world authenticates every frame and every rendezvous entry and drops what
            fails the check before unpickling any of it; in both worlds, workers started with
            different keys fail ``init_rpc`` with :class:`~twinrpc.rpc.AuthenticationError` on every rank. See
            docs/howto/authenticate-workers.md.
    """

    def __init__(
        self,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_misses: int = DEFAULT_HEARTBEAT_MISSES,
        unpickle_allow: Sequence[str] | None = None,
        auth_key: bytes | None = None,
    ) -> None:
        if not isinstance(rpc_timeout, (int, float)) or isinstance(rpc_timeout, bool):
            raise TypeError(
                f"rpc_timeout must be a number of seconds (float), but got {type(rpc_timeout).__name__}: "
                f"{rpc_timeout!r}"
            )
        if not isinstance(init_method, str):
            raise TypeError(f"init_method must be a str URL, but got {init_method!r}")
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be a positive int, but got {num_worker_threads!r}")
        if (
            not isinstance(heartbeat_interval, (int, float))
            or isinstance(heartbeat_interval, bool)
            or not heartbeat_interval >= 0
        ):
            raise ValueError(
                f"heartbeat_interval must be a number of seconds >= 0 (0 = off), but got {heartbeat_interval!r}"
            )
        if (
            not isinstance(heartbeat_misses, int)
            or isinstance(heartbeat_misses, bool)
            or heartbeat_misses < 1
        ):
            raise ValueError(f"heartbeat_misses must be a positive int, but got {heartbeat_misses!r}")
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method
        self.num_worker_threads = num_worker_threads
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_misses = heartbeat_misses
        if unpickle_allow is not None and (
            isinstance(unpickle_allow, str) or not all(isinstance(p, str) and p for p in unpickle_allow)
        ):
            raise TypeError(
                "unpickle_allow must be a list of non-empty module patterns such as ['mypkg.*'], "
                f"but got {unpickle_allow!r}"
            )
        self.unpickle_allow: list[str] | None = None if unpickle_allow is None else list(unpickle_allow)
        if auth_key is not None and not isinstance(auth_key, (bytes, bytearray)):
            raise TypeError(
                "auth_key must be bytes (the job's secret, the same on every worker), "
                f"but got {type(auth_key).__name__}"
            )
        if auth_key is not None and not auth_key:
            raise ValueError("auth_key must not be empty: pass the job's secret, or None for no key")
        #: never shown by repr (a secret)
        self.auth_key: bytes | None = None if auth_key is None else bytes(auth_key)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r}, "
            f"num_worker_threads={self.num_worker_threads})"
        )


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """PyTorch's options class, accepted so torch programs port by changing imports.

    Device maps are accepted but only CPU tensors travel: a CUDA tensor in an RPC is an error.
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: dict[str, dict[Any, Any]] | None = None,
        devices: list[Any] | None = None,
        _transports: list[str] | None = None,
        _channels: list[str] | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_misses: int = DEFAULT_HEARTBEAT_MISSES,
        unpickle_allow: Sequence[str] | None = None,
        auth_key: bytes | None = None,
    ) -> None:
        super().__init__(
            rpc_timeout,
            init_method,
            num_worker_threads=num_worker_threads,
            heartbeat_interval=heartbeat_interval,
            heartbeat_misses=heartbeat_misses,
            unpickle_allow=unpickle_allow,
            auth_key=auth_key,
        )
        self.device_maps: dict[str, dict[Any, Any]] = dict(device_maps or {})
        self.devices: list[Any] = list(devices or [])

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Record a device map for ``to`` (CPU-only twinrpc keeps it for API compatibility)."""
        self.device_maps.setdefault(to, {}).update(device_map)

    def set_devices(self, devices: list[Any]) -> None:
        self.devices = list(devices)


class ProcessGroupRpcBackendOptions(RpcBackendOptions):
    """PyTorch 1.6's options class of the ``PROCESS_GROUP`` backend, accepted so programs written for
    PyTorch 1.4 to 1.7 run unchanged (LIFE-8). Removed from PyTorch in 1.9; TensorPipe's options are the
    2.x form.

    Args:
        num_send_recv_threads: the size of the thread pool of PyTorch's ProcessGroupAgent (default 4,
            as in PyTorch 1.6). twinrpc has one pool serving incoming requests, so this is its
            ``num_worker_threads``: the number of requests a worker executes concurrently (LIFE-7). The
            attributes ``num_send_recv_threads`` and ``num_worker_threads`` are one value.
        rpc_timeout: default timeout of every RPC in seconds (0 = never time out).
        init_method: rendezvous URL (``env://``, ``tcp://host:port``, ``file://path``).
        heartbeat_interval: twinrpc only: see :class:`RpcBackendOptions`.
        heartbeat_misses: twinrpc only: see :class:`RpcBackendOptions`.
        unpickle_allow: twinrpc only: see :class:`RpcBackendOptions`.
        auth_key: twinrpc only: see :class:`RpcBackendOptions`.
    """

    def __init__(
        self,
        num_send_recv_threads: int = DEFAULT_NUM_SEND_RECV_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        *,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_misses: int = DEFAULT_HEARTBEAT_MISSES,
        unpickle_allow: Sequence[str] | None = None,
        auth_key: bytes | None = None,
    ) -> None:
        if (
            not isinstance(num_send_recv_threads, int)
            or isinstance(num_send_recv_threads, bool)
            or num_send_recv_threads < 1
        ):
            raise ValueError(
                f"num_send_recv_threads must be a positive int, but got {num_send_recv_threads!r}"
            )
        super().__init__(
            rpc_timeout,
            init_method,
            num_worker_threads=num_send_recv_threads,
            heartbeat_interval=heartbeat_interval,
            heartbeat_misses=heartbeat_misses,
            unpickle_allow=unpickle_allow,
            auth_key=auth_key,
        )

    @property
    def num_send_recv_threads(self) -> int:
        """The number of requests this worker executes concurrently (= ``num_worker_threads``)."""
        return self.num_worker_threads

    @num_send_recv_threads.setter
    def num_send_recv_threads(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"num_send_recv_threads must be a positive int, but got {value!r}")
        self.num_worker_threads = value

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_send_recv_threads={self.num_send_recv_threads}, "
            f"rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r})"
        )
