"""The twinrpc error tree.

Every error mixes in the builtin that PyTorch raises for the same situation, so code written for
``torch.distributed.rpc`` (``except RuntimeError:``, ``pytest.raises(RuntimeError, match=...)``) keeps
working, and the message fragments PyTorch users match on are kept verbatim.
"""

from __future__ import annotations

import pickle

__all__ = [
    "NotInitializedError",
    "RPCError",
    "RPCTimeoutError",
    "RemoteError",
    "SerializationError",
    "ShutdownError",
    "WorkerUnavailableError",
]

NOT_INITIALIZED_MSG = "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."


class RPCError(RuntimeError):
    """Base class of every error twinrpc raises itself."""


class NotInitializedError(RPCError):
    """An RPC API was used before ``init_rpc`` or after ``shutdown``."""

    def __init__(self, what: str | None = None) -> None:
        msg = NOT_INITIALIZED_MSG if what is None else f"{NOT_INITIALIZED_MSG} ({what})"
        super().__init__(msg)


class RPCTimeoutError(RPCError, TimeoutError):
    """An RPC did not complete within its timeout. The remote execution is not cancelled."""


class RemoteError(RPCError):
    """A remote failure whose original exception type could not be rebuilt on the caller."""


class WorkerUnavailableError(RPCError):
    """The destination worker is dead, unreachable or has shut down."""


class ShutdownError(RPCError):
    """The local agent shut down while the call was still pending."""


class SerializationError(RPCError, pickle.PicklingError):
    """An argument or result cannot travel in an RPC (unpicklable, a lambda, a CUDA tensor, a Future)."""
