"""RRef: the public remote reference, and the owner/user state behind it.

One ``RRef`` class (generic, so ``RRef[torch.Tensor]`` works) wraps either an :class:`OwnerState`
(this worker holds the value) or a :class:`UserState` (a fork held elsewhere). The protocol that keeps
owners and users consistent lives in :mod:`twinrpc._rref_context`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from ._current import current_agent, maybe_current_agent
from ._errors import RPCError
from ._future import Future

if TYPE_CHECKING:
    from ._agent import RpcAgent
    from ._unpickle_allow import UnpickleAllowlist
    from ._worker_info import WorkerInfo

T = TypeVar("T")

RREF_TIMEOUT_MSG = (
    "RRef creation via rpc.remote() timed out, and it is possible that the RRef on the owner node "
    "does not exist."
)


@dataclass(frozen=True, slots=True, order=True)
class GloballyUniqueId:
    """An RRef or fork id: the creating worker's rank and a per-worker counter."""

    created_on: int
    local_id: int

    def __repr__(self) -> str:
        return f"GloballyUniqueId(created_on={self.created_on}, local_id={self.local_id})"

    def __reduce__(self) -> tuple[type[GloballyUniqueId], tuple[int, int]]:
        # Pickled in every RRef message: the dataclass default (__getstate__/__setstate__ over
        # fields()) costs ~4x more than rebuilding from the two ints.
        return (GloballyUniqueId, (self.created_on, self.local_id))


@dataclass(frozen=True, slots=True)
class ForkData:
    """What travels when an RRef is pickled inside an RPC (RREF-F1)."""

    owner: int
    rref_id: GloballyUniqueId
    fork_id: GloballyUniqueId
    parent: int


class OwnerState:
    """The single owner of a value. ``value`` completes when the creating function finishes.

    ``created`` is False while the owner exists only because a request about it (a fetch, a fork
    request, a phantom fork) overtook the ``remote()`` call that creates it; PyTorch counts such
    owners as "pending futures" in its debug info.
    """

    __slots__ = (
        "__weakref__",
        "created",
        "from_value",
        "rref_id",
        "type_future",
        "type_result",
        "value",
    )

    def __init__(self, rref_id: GloballyUniqueId, *, created: bool = True) -> None:
        self.rref_id = rref_id
        self.value: Future[Any] = Future()
        self.created = created
        #: made by ``RRef(value)`` (see :func:`fetched_through_torchscript`)
        self.from_value = False
        #: the cached ``_get_type`` future (RREF-7: the same Future on every non-blocking call)
        self.type_future: Future[type] | None = None
        #: what the first successful ``_get_type`` call returned (PyTorch caches it, see RRef._get_type)
        self.type_result: Any = None

    is_owner = True


def fetched_through_torchscript(owner: OwnerState) -> bool:
    """Whether PyTorch fetches ``owner``'s value through TorchScript rather than pickle: an
    ``RRef(value)`` of a value TorchScript can type (a tensor, a list or dict of tensors, a number),
    not of an instance of a Python class it has not scripted, as PyTorch's ``PyRRef`` decides
    (torch/csrc/distributed/rpc/py_rref.cpp, ``tryInferTypeWithTypeHint``). An ``nn.Parameter`` in
    such a value arrives as a plain tensor, recorded for autograd like any tensor (RPC-9)."""
    if not owner.from_value:
        return False
    value = owner.value.value()  # an RRef(value) owner is complete from the start
    cls = type(value)
    if torch._jit_internal.can_compile_class(cls) and torch.jit._state._get_script_class(cls) is None:
        return False  # PyTorch does not infer a Python class's type (it would try to script it)
    return bool(torch._C._jit_try_infer_type(value).success())


class UserState:
    """A fork of a remote value. Dying sends RREF_USER_DELETE to the owner exactly once (G1)."""

    __slots__ = (
        "__weakref__",
        "agent",
        "confirmed",
        "created",
        "creation_error",
        "deleted",
        "fork_id",
        "owner",
        "reported_confirmed",
        "rref_id",
        "timed_out",
        "type_future",
        "type_result",
    )

    def __init__(
        self, agent: RpcAgent, owner: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId
    ) -> None:
        self.agent = agent
        self.owner = owner
        self.rref_id = rref_id
        self.fork_id = fork_id
        #: completes when the owner knows this fork (remote() ack or fork-request ack)
        self.confirmed: Future[None] = Future()
        #: what confirmed_by_owner() reports; False for a fork received straight from the owner (RREF-6)
        self.reported_confirmed = False
        #: the remote() creation future (its _get_future()), or None for a fork
        self.created: Future[None] | None = None
        self.creation_error: BaseException | None = None
        self.timed_out = False
        self.deleted = False
        self.type_future: Future[type] | None = None
        self.type_result: Any = None

    is_owner = False

    def __del__(self) -> None:
        # The last Python reference went away. The delete message is not sent from here: __del__
        # can run inside any code that allocates (holding any lock), so the context defers the send
        # to a task of the world (G1, RREF-D1).
        if not self.deleted:
            self.agent.rrefs.user_died(self)


class RRef(Generic[T]):
    """A reference to a value owned by some worker, as ``torch.distributed.rpc.RRef``.

    ``RRef(value)`` makes this worker the owner of ``value``. Every other RRef comes from
    ``rpc.remote`` or arrives inside an RPC (a fork). The owner keeps the value alive while any fork
    anywhere is alive.
    """

    __slots__ = ("__weakref__", "_agent", "_state")

    def __init__(self, value: T, type_hint: Any = None) -> None:
        agent = maybe_current_agent()
        if agent is None:
            raise RPCError(
                "Current RPC agent is not set! Did you initialize the RPC framework "
                "(e.g. calling rpc.init_rpc)?"
            )
        self._agent = agent
        self._state: OwnerState | UserState = agent.rrefs.new_local_owner(value)

    @classmethod
    def _wrap(cls, agent: RpcAgent, state: OwnerState | UserState) -> RRef[Any]:
        obj = cls.__new__(cls)
        obj._agent = agent
        obj._state = state
        return obj

    # -- identity ---------------------------------------------------------------------------
    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._state.is_owner

    def owner(self) -> WorkerInfo:
        """The owner's WorkerInfo."""
        return self._agent.worker_by_id(self._owner_rank())

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self.owner().name

    def _owner_rank(self) -> int:
        state = self._state
        return self._agent.info.id if isinstance(state, OwnerState) else state.owner

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows this reference. Always True on the owner.

        As in PyTorch, a fork received directly from the owner reports False: the owner registered
        it when sending, so it is safe, but no confirmation message ever arrives.
        """
        state = self._state
        if isinstance(state, OwnerState):
            return True
        return state.reported_confirmed

    # -- values -----------------------------------------------------------------------------
    def local_value(self) -> T:
        """The value, on the owner only (no copy). Blocks until the creating function finished."""
        state = self._state
        if isinstance(state, UserState):
            raise RuntimeError(
                f"For UserRRef(rref_id={state.rref_id}, fork_id={state.fork_id}), can't call "
                f"localValue() on user {self._agent.info}. Call it on owner "
                f"{self._agent.worker_by_id(state.owner)}"
            )
        return state.value.wait()  # type: ignore[no-any-return]

    def to_here(self, timeout: float = -1.0) -> T:
        """The value: on the owner the object itself, on a user a copy fetched from the owner.

        Blocks. ``timeout`` (seconds; -1 = the default RPC timeout, 0 = never) bounds this fetch only.
        """
        return self._agent.rrefs.to_here(self, timeout)  # type: ignore[no-any-return]

    # -- proxies ----------------------------------------------------------------------------
    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """A proxy: ``rref.rpc_sync().m(*a)`` runs ``rref.local_value().m(*a)`` on the owner, waits."""
        from ._rref_proxy import RRefProxy

        return RRefProxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        """A proxy whose method calls return a Future of the owner-side call's result."""
        from ._rref_proxy import RRefProxy

        return RRefProxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        """A proxy whose method calls return an RRef to the owner-side call's result."""
        from ._rref_proxy import RRefProxy

        return RRefProxy(self, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from the tensor this RRef holds (RREF-10)."""
        self._agent.rrefs.backward(self, dist_autograd_ctx_id, retain_graph)

    # -- internals PyTorch also exposes -----------------------------------------------------
    def _get_future(self) -> Future[None]:
        """The creation future of ``rpc.remote``; complete at once for other RRefs."""
        state = self._state
        if isinstance(state, UserState) and state.created is not None:
            return state.created
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _get_type(self, timeout: float = -1.0, blocking: bool = True) -> Any:
        """The type of the value: local on the owner, one cached RPC on a user (RREF-7).

        As in PyTorch, the first call's result is cached and returned by every later call whatever
        its ``blocking``: the type if the first call blocked, else the (same) Future of the type.
        """
        state = self._state
        if state.type_result is not None:
            return state.type_result
        fut = self._agent.rrefs.get_type(self, timeout)
        result = fut.wait() if blocking else fut
        state.type_result = result
        return result

    def __reduce__(self) -> Any:
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled when using RPC")

    def __repr__(self) -> str:
        state = self._state
        if isinstance(state, OwnerState):
            return f"OwnerRRef({state.rref_id!r})"
        return f"UserRRef(RRefId = {state.rref_id!r}, ForkId = {state.fork_id!r})"

    __str__ = __repr__


# -- the protocol's own access to an RRef (package-internal: an RRef's state is not user API) ---------
def wrap_rref(agent: RpcAgent, state: OwnerState | UserState) -> RRef[Any]:
    """The user-facing RRef for ``state`` on ``agent``'s worker (an owner or a user fork)."""
    return RRef._wrap(agent, state)


def state_of(rref: RRef[Any]) -> OwnerState | UserState:
    """The protocol state behind ``rref``."""
    return rref._state


def agent_of(rref: RRef[Any]) -> RpcAgent:
    """The agent of the worker that holds ``rref``."""
    return rref._agent


def owner_allowlist(rref: Any, helper: str) -> UnpickleAllowlist | None:
    """The ``unpickle_allow`` of the worker running a twinrpc ``helper`` aimed at ``rref``'s value (an
    RPC from a peer, which chose the argument): with one, ``rref`` must be an RRef, so the helper reaches
    only the values RRefs hold, each checked by the helper; None: no allowlist (PyTorch's behaviour).

    Raises:
        UnpickleRefused: ``rref`` is not an RRef.
    """
    allow = current_agent().unpickle_allow
    if allow is not None:
        allow.check_type(rref, RRef, helper)
    return allow


def owner_value(rref: Any, expected: type | tuple[type, ...], helper: str) -> Any:
    """``rref.local_value()`` for a twinrpc ``helper`` that acts on it in a way only values of the
    ``expected`` types allow (a remote optimizer's ``step``, a module's ``forward``): with
    ``unpickle_allow``, a peer may not aim the helper at an RRef of any other value.

    Raises:
        UnpickleRefused: ``rref`` is not an RRef, or its value not of the ``expected`` types.
    """
    allow = owner_allowlist(rref, helper)
    value = rref.local_value()
    if allow is not None:
        allow.check_type(value, expected, helper)
    return value
