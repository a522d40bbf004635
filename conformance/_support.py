"""Helpers shared by conformance test programs (they run on workers, so they take no ``ctx``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import Any


def rpc_module(backend: str) -> ModuleType:
    """The RPC module of ``backend``, for code running inside a UDF (which has no ``ctx``)."""
    if backend == "torch":
        import torch.distributed.rpc as rpc
    else:
        import twinrpc.rpc as rpc
    return rpc


def backend_sleep(backend: str, seconds: float) -> None:
    """Sleep inside a user function: virtual time inside a simulation (the sim backend, or a
    third-party backend built on the simulator), wall-clock time elsewhere."""
    if backend == "torch":  # the oracle's processes need nothing of twinrpc
        time.sleep(seconds)
    else:
        from twinrpc.simulator import sleep

        sleep(seconds)


def outcome(thunk: Callable[[], Any]) -> tuple[Any, Any]:
    """``("ok", value)``, or ``(builtin kinds, message)`` for an exception.

    The kinds are the names of the builtin exception classes the exception is an instance of, so a
    backend may raise a documented subclass (``RPCError(RuntimeError)``) and still match.
    """
    try:
        return ("ok", thunk())
    except Exception as exc:
        kinds = tuple(k.__name__ for k in (RuntimeError, TypeError, ValueError) if isinstance(exc, k))
        return (kinds or (type(exc).__name__,), str(exc))


def slow_echo(backend: str, seconds: float, value: Any) -> Any:
    """A UDF that takes ``seconds`` (virtual on the simulator) and returns ``value``."""
    backend_sleep(backend, seconds)
    return value


def backend_now(backend: str) -> float:
    """The backend's clock in seconds: virtual time in the simulator, the monotonic clock elsewhere."""
    if backend == "sim":
        from twinrpc.simulator import now

        return now()
    return time.monotonic()


def timed(backend: str, thunk: Callable[[], Any]) -> dict[str, Any]:
    """What ``thunk()`` did and how long it took on the backend's clock: plain data for a test body."""
    start = backend_now(backend)
    try:
        value = thunk()
    except Exception as exc:
        return {
            "raised": type(exc).__name__,
            "runtime_error": isinstance(exc, RuntimeError),
            "message": str(exc),
            "elapsed": backend_now(backend) - start,
        }
    return {"raised": None, "value": value, "elapsed": backend_now(backend) - start}


def dist_autograd_module(backend: str) -> ModuleType:
    """The distributed autograd module of ``backend``, for code running inside a UDF."""
    if backend == "torch":
        import torch.distributed.autograd as dist_autograd
    else:
        import twinrpc.autograd as dist_autograd
    return dist_autograd
