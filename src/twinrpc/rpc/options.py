"""Backend options and backend types, with PyTorch's names and defaults."""

from __future__ import annotations

import enum
from typing import Any

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16
UNSET_RPC_TIMEOUT = -1.0
DEFAULT_SHUTDOWN_TIMEOUT = 0


class BackendType(enum.Enum):
    """The RPC backends. ``TENSORPIPE`` (PyTorch's name) selects the world the program runs in:
    the simulator inside a simulation, the gloo world otherwise."""

    TENSORPIPE = "TENSORPIPE"


class RpcBackendOptions:
    """Options for ``init_rpc``; subclass it to carry more.

    Args:
        rpc_timeout: default timeout of every RPC in seconds (0 = never time out).
        init_method: rendezvous URL (``env://``, ``tcp://host:port``, ``file://path``).
        num_worker_threads: size of the pool that serves incoming requests (keyword-only; twinrpc
            accepts it here as well as on ``TensorPipeRpcBackendOptions``).
    """

    def __init__(
        self,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
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
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method
        self.num_worker_threads = num_worker_threads

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
    ) -> None:
        super().__init__(rpc_timeout, init_method, num_worker_threads=num_worker_threads)
        self.device_maps: dict[str, dict[Any, Any]] = dict(device_maps or {})
        self.devices: list[Any] = list(devices or [])

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Record a device map for ``to`` (CPU-only twinrpc keeps it for API compatibility)."""
        self.device_maps.setdefault(to, {}).update(device_map)

    def set_devices(self, devices: list[Any]) -> None:
        self.devices = list(devices)
