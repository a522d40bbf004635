"""The twinrpc error tree.

Every error mixes in the builtin that PyTorch raises for the same situation, so code written for
``torch.distributed.rpc`` (``except RuntimeError:``, ``pytest.raises(RuntimeError, match=...)``) keeps
working, and the message fragments PyTorch users match on are kept verbatim.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._departure import Departure

__all__ = [
    "AuthenticationError",
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
    """The destination worker is dead, unreachable or has shut down.

    Built by ``twinrpc._departure.departure_error``, which sets ``departure`` (how the worker left)."""

    #: how the worker left (``twinrpc._departure.Departure``); None if not known
    departure: Departure | None = None


class AuthenticationError(RPCError):
    """With a job key (``RpcBackendOptions(auth_key=...)``, ``TWINRPC_AUTH_KEY_FILE`` or
    ``TWINRPC_AUTH_KEY``): the workers were
    not all started with the same key, or a frame or rendezvous entry failed the key's check. Nothing
    in what failed was used or unpickled; on a link, the link to that peer fails with it."""


#: what an init_rpc that failed over the workers' keys tells the user to do (both worlds)
AUTH_KEY_HINT = (
    "Every worker of a job must be started with the same key (RpcBackendOptions(auth_key=...), a file "
    "named by TWINRPC_AUTH_KEY_FILE or the environment variable TWINRPC_AUTH_KEY), or all without one"
)


class ShutdownError(RPCError):
    """The local agent shut down while the call was still pending."""


class SerializationError(RPCError, pickle.PicklingError):
    """An argument or result cannot travel in an RPC (unpicklable, a lambda, a CUDA tensor, a Future)."""


_SERIALIZATION_TYPES: dict[type[BaseException], type[SerializationError]] = {}


def serialization_error(message: str, like: type[BaseException] | None = None) -> SerializationError:
    """A SerializationError that is also an instance of ``like`` (the pickler's own error type).

    PyTorch lets the pickler's error through: ``TypeError`` for a lock, ``PicklingError`` for a
    lambda. Mixing that type in keeps ``except TypeError:`` working while ``except RPCError:`` and
    ``except RuntimeError:`` also catch it.
    """
    if like is None or issubclass(SerializationError, like) or not issubclass(like, Exception):
        return SerializationError(message)
    cls = _SERIALIZATION_TYPES.get(like)
    if cls is None:
        try:
            cls = type(
                f"SerializationError[{like.__name__}]",
                (SerializationError, like),
                {"__module__": __name__, "__qualname__": "SerializationError", "original_type": like},
            )
        except TypeError:  # an incompatible instance layout: keep the plain class
            cls = SerializationError
        _SERIALIZATION_TYPES[like] = cls
    return cls(message)


def original_type(exc: BaseException) -> type[BaseException]:
    """The builtin a SerializationError stands for (itself for any other error)."""
    return getattr(type(exc), "original_type", type(exc))


#: PyTorch's words when a request names a function or class the callee does not have (RPC-8); its
#: ``_InternalRPCPickler.deserialize`` appends them to the unpickler's ``AttributeError``
NOT_SERIALIZED_HINT = (
    "Default RPC pickler does not serialize function code. Ensure that UDFs are defined on both caller "
    "and callee modules."
)


def unpickle_error(exc: BaseException, what: str) -> str:
    """The message of a request that the callee cannot unpickle: ``what`` (which request, from whom)
    and the unpickler's error; an ``AttributeError`` (a function missing on the callee) gets PyTorch's
    "RPC pickler does not serialize" hint after it."""
    text = f"{what}: {remote_repr(exc)}"
    if isinstance(exc, AttributeError):
        text += f" {NOT_SERIALIZED_HINT}"
    return text


def remote_repr(exc: BaseException) -> str:
    """``repr(exc)`` with its escapes undone, so the message reads as the remote raised it.

    PyTorch builds the remote error's text from ``repr(e)`` and decodes it with ``unicode_escape``
    (torch/distributed/rpc/internal.py, ``_handle_exception``): quotes, newlines, tabs and backslashes
    arrive as written, e.g. ``ValueError('he said "it's"`` and a real line break. Escaping non-ASCII
    characters first keeps them intact too (PyTorch's decoding garbles them).
    """
    text = repr(exc)
    try:
        return text.encode("ascii", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:  # a repr that is not a plain Python literal
        return text
