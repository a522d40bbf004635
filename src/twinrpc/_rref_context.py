"""The RRef protocol of PyTorch's design note (rref.rst), per worker.

Bookkeeping (all guarded by one lock):

- ``owners``: rref id -> OwnerState, for values that were forked at least once (RREF-3);
- ``forks``: rref id -> the fork ids the owner knows to be alive; the owner drops the value when the
  set becomes empty (RREF-D1);
- ``pending_users``: forks this worker holds that the owner has not confirmed yet (strong refs, so an
  unconfirmed user cannot die early);
- ``pending_children``: forks this worker (a user) sent whose owner confirmation has not reached us;
  the parent is kept alive until then (G2).

Control messages (user delete, fork request, child accept) are requests answered by an ack.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

from ._errors import RPCError
from ._future import Future
from ._message import Kind
from ._rref import RREF_TIMEOUT_MSG, ForkData, GloballyUniqueId, OwnerState, RRef, UserState
from ._serialize import LoadState

if TYPE_CHECKING:
    from ._agent import RpcAgent

_log = logging.getLogger("twinrpc")


class RRefContext:
    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.rank = agent.info.id
        self._lock = threading.RLock()
        self._counter = itertools.count()
        self.owners: dict[GloballyUniqueId, OwnerState] = {}
        self.forks: dict[GloballyUniqueId, set[GloballyUniqueId]] = {}
        self.pending_users: dict[GloballyUniqueId, UserState] = {}
        self.pending_children: dict[GloballyUniqueId, Any] = {}
        self.users: weakref.WeakValueDictionary[GloballyUniqueId, UserState] = weakref.WeakValueDictionary()
        self._owners_empty: Future[None] | None = None
        self.closed = False

    def new_id(self) -> GloballyUniqueId:
        return GloballyUniqueId(self.rank, next(self._counter))

    # -- owners -----------------------------------------------------------------------------
    def new_local_owner(self, value: Any) -> OwnerState:
        """``RRef(value)``: an owner that enters the owner map only when first forked (RREF-3)."""
        state = OwnerState(self.new_id())
        state.value.set_result(value)
        return state

    def get_or_create_owner(self, rref_id: GloballyUniqueId) -> OwnerState:
        with self._lock:
            state = self.owners.get(rref_id)
            if state is None:
                state = self.owners[rref_id] = OwnerState(rref_id)
                self.forks.setdefault(rref_id, set())
            return state

    def _drop_fork(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            forks = self.forks.get(rref_id)
            if forks is None:
                return
            forks.discard(fork_id)
            if not forks:
                del self.forks[rref_id]
                self.owners.pop(rref_id, None)
                if not self.owners and self._owners_empty is not None:
                    done, self._owners_empty = self._owners_empty, None
                else:
                    done = None
            else:
                done = None
        if done is not None:
            done.set_result(None)

    # -- remote() ---------------------------------------------------------------------------
    def new_owner_for_remote_to_self(self) -> OwnerState:
        """remote() to this worker: the owner exists at once with a self-fork (RREF-2)."""
        rref_id = self.new_id()
        with self._lock:
            state = self.owners[rref_id] = OwnerState(rref_id)
            self.forks[rref_id] = {rref_id}
        return state

    def new_user_for_remote(self, owner: int) -> UserState:
        """remote() to another worker: a pending user, rref id first, then fork id (RREF-1)."""
        rref_id = self.new_id()
        fork_id = self.new_id()
        state = UserState(self.agent, owner, rref_id, fork_id)
        with self._lock:
            self.pending_users[fork_id] = state
            self.users[fork_id] = state
        return state

    def confirm_user(self, state: UserState) -> None:
        with self._lock:
            self.pending_users.pop(state.fork_id, None)
        state.reported_confirmed = True
        state.confirmed.try_set_result(None)

    def remote_timed_out(self, state: UserState) -> None:
        state.timed_out = True
        with self._lock:
            self.pending_users.pop(state.fork_id, None)

    # -- forks: pickling and unpickling ------------------------------------------------------
    def fork(self, rref: RRef[Any], dst: int) -> ForkData:
        """Pickle ``rref`` for a message to ``dst`` (RREF-F1)."""
        state = rref._state
        fork_id = self.new_id()
        if isinstance(state, OwnerState):
            with self._lock:
                self.owners.setdefault(state.rref_id, state)
                self.forks.setdefault(state.rref_id, set()).add(fork_id)
            return ForkData(self.rank, state.rref_id, fork_id, self.rank)
        if state.timed_out:
            raise RPCError(RREF_TIMEOUT_MSG)
        if state.deleted:
            raise RuntimeError(f"Cannot call fork an UserRRef after deletion. ({rref})")
        with self._lock:
            self.pending_children[fork_id] = state  # G2: the parent lives until the child is accepted
        return ForkData(state.owner, state.rref_id, fork_id, self.rank)

    def rebuild(self, data: ForkData, src: int, load: LoadState) -> RRef[Any]:
        """Unpickle a fork that arrived from ``src`` (RREF-F2)."""
        agent = self.agent
        if data.owner == self.rank:
            owner = self.get_or_create_owner(data.rref_id)
            if data.parent == self.rank:
                self._drop_fork(data.rref_id, data.fork_id)  # the owner sent its RRef to itself
            else:
                # A phantom fork: never added to the owner's forks; the parent may now let go.
                self.send_control(data.parent, Kind.RREF_CHILD_ACCEPT, data.fork_id)
            return RRef._wrap(agent, owner)
        state = UserState(agent, data.owner, data.rref_id, data.fork_id)
        with self._lock:
            self.users[data.fork_id] = state
        if data.parent == data.owner:
            # The owner registered this fork when it pickled it: safe at once (reports False, RREF-6).
            state.confirmed.set_result(None)
        else:
            with self._lock:
                self.pending_users[data.fork_id] = state
            load.unconfirmed_rrefs.append(state)
            fut = self.send_control(data.owner, Kind.RREF_FORK_REQUEST, (data.rref_id, data.fork_id))
            parent = data.parent
            fut.add_done_callback(lambda f: self._fork_request_acked(f, state, parent))
        return RRef._wrap(agent, state)

    def _fork_request_acked(self, f: Future[Any], state: UserState, parent: int) -> None:
        try:
            f.wait()
        except BaseException as exc:
            _log.warning("twinrpc: fork request for %s failed: %s", state.fork_id, exc)
            return
        self.confirm_user(state)
        self.send_control(parent, Kind.RREF_CHILD_ACCEPT, state.fork_id)

    def send_control(self, dst: int, kind: Kind, obj: Any) -> Future[Any]:
        return self.agent.request(dst, kind, obj, timeout=0)

    # -- control message handlers (run on the receiving worker) ------------------------------
    def on_user_delete(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        self._drop_fork(rref_id, fork_id)

    def on_fork_request(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        self.get_or_create_owner(rref_id)
        with self._lock:
            self.forks.setdefault(rref_id, set()).add(fork_id)

    def on_child_accept(self, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            self.pending_children.pop(fork_id, None)

    # -- deletion -----------------------------------------------------------------------------
    def user_died(self, state: UserState) -> None:
        """The last Python reference to a user went away: tell the owner once (G1)."""
        if state.deleted or self.closed or state.timed_out:
            return
        state.deleted = True
        try:
            self.send_control(state.owner, Kind.RREF_USER_DELETE, (state.rref_id, state.fork_id))
        except Exception as exc:  # the agent may be going away; nothing else can be done
            _log.debug("twinrpc: could not send RREF_USER_DELETE for %s: %s", state.fork_id, exc)

    def delete_all_users(self) -> None:
        """Graceful shutdown: delete every live user this worker holds (SHUT-1 step 2)."""
        with self._lock:
            users = [u for u in self.users.values() if not u.deleted and u.confirmed.done()]
        for user in users:
            self.user_died(user)

    def wait_owners_drained(self) -> Future[None]:
        """A future that completes when this worker owns no forked value any more."""
        with self._lock:
            if not self.owners:
                done: Future[None] = Future()
                done.set_result(None)
                return done
            if self._owners_empty is None:
                self._owners_empty = Future()
            return self._owners_empty

    def leaks(self) -> list[tuple[GloballyUniqueId, list[GloballyUniqueId]]]:
        with self._lock:
            return [(rid, sorted(f)) for rid, f in self.forks.items() if f]

    # -- values -------------------------------------------------------------------------------
    def to_here(self, rref: RRef[Any], timeout: float) -> Any:
        state = rref._state
        if isinstance(state, OwnerState):
            return state.value.wait()
        if state.deleted:
            raise RuntimeError(
                f"User RRef with RRefId={state.rref_id} and ForkId={state.fork_id} has been deleted. "
                "Cannot call to_here() on it after deletion."
            )
        if state.timed_out:
            raise RPCError(RREF_TIMEOUT_MSG)
        return self.agent.request(state.owner, Kind.RREF_FETCH, state.rref_id, timeout).wait()

    def get_type(self, rref: RRef[Any], timeout: float) -> Future[type]:
        state = rref._state
        if isinstance(state, OwnerState):
            return state.value.then(lambda f: type(f.wait()))
        if state.type_future is None:
            if state.timed_out:
                raise RPCError(RREF_TIMEOUT_MSG)
            state.type_future = self.agent.request(state.owner, Kind.RREF_TYPE, state.rref_id, timeout)
        return state.type_future

    def backward(self, rref: RRef[Any], ctx_id: int, retain_graph: bool) -> None:
        raise RPCError("RRef.backward needs distributed autograd, which twinrpc does not provide yet")

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {
                "num_owner_rrefs": len(self.owners),
                "num_forks": sum(len(f) for f in self.forks.values()),
                "num_pending_users": len(self.pending_users),
                "num_pending_children": len(self.pending_children),
                "num_users": len(self.users),
            }
