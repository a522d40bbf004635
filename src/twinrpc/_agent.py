"""The RPC agent: the protocol core, written once for both worlds.

It turns API calls into messages and messages into calls, keeps the table of pending requests with
their timeouts, serves requests on the world's request pool, and runs graceful shutdown. It blocks only
through futures and never touches threads, sockets or clocks: those belong to its :class:`World`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _builtin_wire, _serialize
from ._call_deadlines import CallDeadlines
from ._control_channel import ControlChannel
from ._departure import Departure, departure_error
from ._dist_autograd import AUTOGRAD_KINDS, CURRENT_CONTEXT, AutogradEnvelope, DistAutogradContainer
from ._errors import (
    RemoteError,
    RPCError,
    RPCTimeoutError,
    SerializationError,
    ShutdownError,
    WorkerUnavailableError,
    original_type,
    remote_repr,
    serialization_error,
    unpickle_error,
)
from ._future import Future, add_internal_callback, receive_while_waiting, then_internal
from ._message import CONTROL_KINDS, REQUEST_KINDS, Kind, Message
from ._rref import (
    GloballyUniqueId,
    OwnerState,
    RRef,
    UserState,
    fetched_through_torchscript,
    wrap_rref,
)
from ._rref_context import ForkRecorder, RRefContext
from ._shutdown import ShutdownProtocol
from ._torch_builtins import is_builtin
from ._unpickle_allow import UnpickleAllowlist
from ._worker_info import Roster, WorkerInfo
from ._world import World

_log = logging.getLogger("twinrpc")

UNSET_RPC_TIMEOUT = -1.0
#: the first byte of a payload in twinrpc._builtin_wire's encoding
_COMPACT = bytes((_builtin_wire.MAGIC,))
#: requests served on the request pool (they run user code, which may block)
_POOL_KINDS = frozenset({Kind.CALL, Kind.REMOTE_CALL})


class _Pending:
    __slots__ = ("dst", "fut", "kind")

    def __init__(self, fut: Future[Any], dst: int, kind: Kind) -> None:
        self.fut = fut
        self.dst = dst
        self.kind = kind


@dataclass(frozen=True, slots=True)
class _RemoteException:
    """An exception as it travels: its type (by reference) and its formatted message."""

    exc_type: type[BaseException]
    message: str
    #: the error is a SerializationError standing for ``exc_type`` (see _errors.serialization_error)
    serialization: bool = False


class RpcAgent:
    """One worker's RPC agent. Thread-safe; every public method may be called from any task."""

    def __init__(
        self,
        world: World,
        info: WorkerInfo,
        workers: list[WorkerInfo] | Roster,
        rpc_timeout: float,
        num_worker_threads: int,
        unpickle_allow: UnpickleAllowlist | None = None,
    ) -> None:
        self.world = world
        #: the globals this worker unpickles (RpcBackendOptions(unpickle_allow=...)); None: any
        self.unpickle_allow = unpickle_allow
        self.info = info
        roster = workers if isinstance(workers, Roster) else Roster(workers)  # shared: never changed
        self.workers = roster.workers
        self._by_name = roster.by_name
        self._by_id = roster.by_id
        self.rpc_timeout = rpc_timeout
        self.num_worker_threads = num_worker_threads
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        #: when pending calls time out (twinrpc._call_deadlines)
        self._deadlines = CallDeadlines(world, self._lock, self._pending, self._on_timeout)
        #: request id -> (its destination, the RRef forks it carried to their owner there), accepted
        #: when its reply arrives; kept past a timeout, as a late reply accepts them too
        #: (RRefContext.accepted_by_reply)
        self._accepted_by_reply: dict[int, tuple[int, list[GloballyUniqueId]]] = {}
        self._active_calls = 0
        self._idle: Future[None] | None = None
        self._sent_requests = 0
        self._served_requests = 0
        self.running = True
        #: resent-until-acked messages: RRef control and autograd cleanup (twinrpc._control_channel)
        self.control = ControlChannel(self)
        self.rrefs = RRefContext(self)
        self.autograd = DistAutogradContainer(self)  # distributed autograd state (twinrpc._dist_autograd)
        observers = world.observers()
        self.rrefs.observer = observers.rrefs
        self.autograd.observer = observers.autograd
        self.shutdown_protocol = ShutdownProtocol(self)  # graceful shutdown (twinrpc._shutdown)
        self.leader = roster.leader
        #: a member of a dynamic group (init_rpc without world_size, LIFE-5): workers join and leave
        #: while it runs (update_membership), and shutdown only leaves the group (twinrpc._membership)
        self.dynamic = False
        #: workers that left the dynamic group: still named in messages about calls made to them
        self._left: dict[int, WorkerInfo] = {}

    # -- names ----------------------------------------------------------------------------------
    def resolve(self, to: Any) -> WorkerInfo:
        """``to`` as a WorkerInfo: a worker name, a rank or a WorkerInfo (RPC-5)."""
        if isinstance(to, WorkerInfo):
            known = self._by_name.get(to.name)
            if known is None or known.id != to.id:
                raise RuntimeError(
                    f"name:{self.info.name},rank:{self.info.id} could not find destination {to}"
                )
            return known
        if isinstance(to, str):
            info = self._by_name.get(to)
            if info is None:
                raise RuntimeError(
                    f"name:{self.info.name},rank:{self.info.id} could not find destination name {to}"
                )
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            info = self._by_id.get(to)
            if info is None:
                raise RuntimeError(
                    f"name:{self.info.name},rank:{self.info.id} could not find destination id {to}"
                )
            return info
        if hasattr(to, "name") and hasattr(to, "id"):  # a torch WorkerInfo
            return self.resolve(WorkerInfo(to.name, to.id))
        raise ValueError(f"Cannot get WorkerInfo from name {to}")

    def worker_by_id(self, rank: int) -> WorkerInfo:
        info = self._by_id.get(rank)
        return info if info is not None else self._left[rank]

    def update_membership(self, info: WorkerInfo, is_join: bool) -> None:
        """``info`` joined (``is_join``) or left this worker's dynamic group (LIFE-5). Readers see the
        old or the new membership, never a mix: the tables are replaced, not changed in place."""
        with self._lock:
            by_id = dict(self._by_id)
            if is_join:
                by_id[info.id] = info
                self._left.pop(info.id, None)
            else:
                by_id.pop(info.id, None)
                self._left[info.id] = info
            self._by_id = by_id
            self._by_name = {w.name: w for w in by_id.values()}
            self.workers = sorted(by_id.values(), key=lambda w: w.id)
        if is_join:  # a new worker under a departed one's rank
            self.rrefs.peer_joined(info.id)
            self.shutdown_protocol.peer_joined(info.id)

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        """As PyTorch's agent method: this worker's info, or the named worker's."""
        return self.info if worker_name is None else self.resolve(worker_name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """As PyTorch's agent method: every worker, ordered by id."""
        return list(self.workers)

    # -- client side ----------------------------------------------------------------------------
    def request(
        self, dst: int, kind: Kind, obj: Any, timeout: float, deferrable: bool = False
    ) -> Future[Any]:
        """Send a request and return a future of the deserialized reply (``deferrable``: see
        ``Message.deferrable``).

        Raises:
            SerializationError: ``obj`` cannot be pickled (nothing was sent).
            NotInitializedError: the agent has shut down.
        """
        if not self.running:
            from ._errors import NotInitializedError

            raise NotInitializedError()
        context_id = CURRENT_CONTEXT.get()
        rrefs = self.rrefs
        fork = ForkRecorder(rrefs, dst)
        try:
            if context_id is not None and kind in AUTOGRAD_KINDS:  # hook: the request joins the context
                payload, tensors = self.autograd.dumps_request(context_id, dst, kind, obj, fork)
            elif kind is Kind.GRADIENT and (encoded := _builtin_wire.encode_gradients(*obj)) is not None:
                payload, tensors = encoded  # without pickle, and so is the ack (twinrpc._fast_engine)
            else:
                # a builtin operator's Parameter arguments travel as tensors, as PyTorch's builtin
                # calls (TorchScript) send them; the builtin wire sends them so too
                func = obj[0] if kind is Kind.CALL else obj[2] if kind is Kind.REMOTE_CALL else None
                builtin = func is not None and is_builtin(func)
                # rpc.remote of a builtin on plain arguments: without pickle, as rpc_sync's call
                remote = (
                    _builtin_wire.encode_remote_call(*obj) if builtin and kind is Kind.REMOTE_CALL else None
                )
                payload, tensors = (
                    remote if remote is not None else _serialize.dumps(obj, fork, link_parameters=builtin)
                )
        except BaseException:
            rrefs.unfork(fork.forks)  # nothing is sent
            raise
        forks = fork.forks
        # forks that the reply will accept (RREF-F1)
        by_reply = [d.fork_id for d in forks if rrefs.accepted_by_reply(d, dst)] if forks else None
        return self._send_request(dst, kind, payload, tensors, timeout, deferrable, by_reply)

    def _send_request(
        self,
        dst: int,
        kind: Kind,
        payload: bytes,
        tensors: list[torch.Tensor],
        timeout: float,
        deferrable: bool = False,
        by_reply: list[GloballyUniqueId] | None = None,
    ) -> Future[Any]:
        """Send an encoded request: its pending entry, deadline and message (see :meth:`request`)."""
        fut: Future[Any] = Future()
        receive = self.world.reply_receiver(dst)
        if receive is not None:
            receive_while_waiting(fut, receive)
        pending = _Pending(fut, dst, kind)
        timeout = self.rpc_timeout if timeout is None or timeout < 0 else float(timeout)
        msg_id = next(self._ids)  # atomic: itertools.count under the GIL
        # Made only when read (a deadlock report, a repr); the tables are replaced, never changed
        by_id = self._by_id
        fut.label = lambda: (
            f"reply to {kind.name}#{msg_id} from {(by_id.get(dst) or self.worker_by_id(dst)).name}"
        )
        with self._lock:
            self._pending[msg_id] = pending
            self._active_calls += 1
            if kind not in CONTROL_KINDS:
                self._sent_requests += 1
            if by_reply:
                self._accepted_by_reply[msg_id] = (dst, by_reply)
            arm = self._deadlines.add(msg_id, timeout) if timeout > 0 else None
        if arm is not None:
            self._deadlines.arm(timeout, arm)
        self.world.send(Message(kind, msg_id, self.info.id, dst, payload, tensors, deferrable))
        return fut

    def call(self, to: Any, func: Any, args: Any, kwargs: Any, timeout: float) -> Future[Any]:
        """``rpc_async``: run ``func(*args, **kwargs)`` on ``to``."""
        dst = self._by_name.get(to) if type(to) is str else None
        if dst is None:
            dst = self.resolve(to)
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if self.running and CURRENT_CONTEXT.get() is None:
            # A builtin operator on plain arguments travels without pickle (twinrpc._builtin_wire);
            # inside a distributed autograd context the call is pickled with its envelope (DAG-4).
            encoded = _builtin_wire.encode_call(func, args, kwargs)
            if encoded is not None:
                return self._send_request(dst.id, Kind.CALL, encoded[0], encoded[1], timeout)
        return self.request(dst.id, Kind.CALL, (func, args, kwargs), timeout)

    def remote(self, to: Any, func: Any, args: Any, kwargs: Any, timeout: float) -> RRef[Any]:
        """``rpc.remote``: run ``func`` on ``to``, which becomes the owner of the result."""
        dst = self.resolve(to)
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if dst.id == self.info.id:
            owner = self.rrefs.new_owner_for_remote_to_self()
            try:
                fut = self.request(
                    dst.id, Kind.REMOTE_CALL, (owner.rref_id, owner.rref_id, func, args, kwargs), timeout
                )
            except BaseException as exc:
                # Nothing was sent (e.g. an unpicklable argument): release the self-fork, or the owner
                # would leak it until shutdown (found by the simulator's SHUT-1 no-leak monitor).
                owner.value.try_set_exception(exc)
                self.rrefs.drop_fork(owner.rref_id, owner.rref_id)
                raise
            add_internal_callback(fut, lambda f: self._remote_to_self_done(f, owner))
            rref = wrap_rref(self, owner)
            return rref
        user = self.rrefs.new_user_for_remote(dst.id)
        try:
            fut = self.request(
                dst.id, Kind.REMOTE_CALL, (user.rref_id, user.fork_id, func, args, kwargs), timeout
            )
        except BaseException:
            self.rrefs.remote_timed_out(user)  # nothing was sent: this user must not send a delete
            user.deleted = True
            raise
        user.created = then_internal(fut, lambda f: self._remote_done(f, user))
        return wrap_rref(self, user)

    def _remote_done(self, f: Future[Any], user: UserState) -> None:
        try:
            f.wait()
        except RPCTimeoutError:
            self.rrefs.remote_timed_out(user)
            raise
        except BaseException as exc:
            user.creation_error = exc
            self.rrefs.confirm_user(user)
            raise
        self.rrefs.confirm_user(user)

    def _remote_to_self_done(self, f: Future[Any], owner: OwnerState) -> None:
        try:
            f.wait()
        except BaseException as exc:
            owner.value.try_set_exception(exc)
        self.rrefs.drop_fork(owner.rref_id, owner.rref_id)

    def _finish_call(self, msg_id: int) -> _Pending | None:
        with self._lock:
            return self._pending.pop(msg_id, None)

    def _call_ended(self) -> None:
        with self._lock:
            self._active_calls -= 1
            idle = self._idle if self._active_calls == 0 else None
            if idle is not None:
                self._idle = None
        if idle is not None:
            idle.set_result(None)

    def _on_timeout(self, msg_id: int, timeout: float) -> None:
        pending = self._finish_call(msg_id)
        if pending is None:
            return
        dst = self.worker_by_id(pending.dst)
        pending.fut.set_exception(
            RPCTimeoutError(
                f"RPC ran for more than set timeout ({round(timeout * 1000)} ms) and will now be marked "
                f"with an error: {pending.kind.name} to '{dst.name}' (rank {dst.id}) got no reply within "
                f"{timeout:.2f} s ({self.world.clock_name} time); pass timeout=0 to wait forever or "
                "raise rpc_timeout in init_rpc"
            )
        )
        self._call_ended()

    def on_send_failed(self, msg: Message, exc: BaseException) -> None:
        """The world could not deliver ``msg`` (dead or departed peer)."""
        if msg.kind not in REQUEST_KINDS:
            return
        if msg.kind not in CONTROL_KINDS:
            with self._lock:
                self._sent_requests -= 1
        self._take_accepts(msg.id)  # the owner never got the forks: nothing needs their parents
        pending = self._finish_call(msg.id)
        if pending is not None:
            pending.fut.set_exception(exc)
            self._call_ended()

    def on_request_copies(self, msg: Message, copies: int) -> None:
        """The world delivers request ``msg`` ``copies`` times instead of once: 0 when it was lost for
        good, 2 or more when it was duplicated. Only the simulator's fault plans do this (a real link
        delivers a message once or fails). join() counts requests sent against requests served, so
        every copy that will be served must be counted, or shutdown would wait forever."""
        with self._lock:
            self._sent_requests += copies - 1

    def departure_error(self, peer: int, departure: Departure, detail: str = "") -> WorkerUnavailableError:
        """The error calls to ``peer`` fail with after it departed (``twinrpc._departure``)."""
        try:
            info: WorkerInfo | int = self.worker_by_id(peer)
        except KeyError:  # a dynamic group's worker this one never knew
            info = peer
        return departure_error(info, self.info, departure, detail)

    def on_peer_failed(self, peer: int, departure: Departure, detail: str = "") -> None:
        """``peer`` departed (``departure``; ``detail``: the world's words for a crash or silence):
        fail every call pending on it, and, unless it left in order, every collective that needs it.

        The worlds only report departures; what each means is decided here (twinrpc._departure)."""
        exc = self.departure_error(peer, departure, detail)
        with self._lock:
            dead = [(mid, p) for mid, p in self._pending.items() if p.dst == peer]
            for mid, _ in dead:
                del self._pending[mid]
            # Requests to it will never be served: keep the join accounting balanced.
            self._sent_requests -= sum(1 for _, p in dead if p.kind not in CONTROL_KINDS)
            # No reply will come from it: the forks its requests carried need their parents no more.
            gone = [mid for mid, (dst, _) in self._accepted_by_reply.items() if dst == peer]
            accepted = [fork for mid in gone for fork in self._accepted_by_reply.pop(mid)[1]]
        self.rrefs.implied_accepts(accepted)
        for _, p in dead:
            p.fut.set_exception(exc)
            self._call_ended()
        died = not departure.shut_down
        self.rrefs.peer_departed(peer, exc, died)  # owners drop the forks a dead worker held (RREF-D2)
        self.autograd.peer_departed(peer, died)  # contexts a dead worker took part in are released (DAG-18)
        self.shutdown_protocol.peer_failed(peer, exc, departure.orderly)

    # -- incoming -------------------------------------------------------------------------------
    def on_message(self, msg: Message) -> None:
        """Entry point for every delivered message; runs on a task of this worker."""
        kind = msg.kind
        if kind is Kind.RESPONSE or kind is Kind.EXCEPTION:
            self._on_reply(msg)
        elif kind in _POOL_KINDS:
            if _builtin_wire.is_call(msg.payload):
                self._submit_builtin(msg)
            else:
                self.world.submit(self._serve, msg)
        elif kind in REQUEST_KINDS:
            self._serve(msg)
        elif kind is Kind.GATHER or kind is Kind.SCATTER:
            self.shutdown_protocol.on_message(msg)
        else:
            _log.warning("twinrpc: %s dropped a message of unknown kind %r", self.info, kind)

    def _on_reply(self, msg: Message) -> None:
        if self._accepted_by_reply:
            self._take_accepts(msg.id)
        with self._lock:  # _finish_call, inlined: this runs for every reply
            pending = self._pending.pop(msg.id, None)
        if pending is None:
            return  # a late reply to a call that timed out: dropped (ERR-4)
        try:
            value, load = _serialize.loads(
                msg.payload,
                msg.tensors,
                msg.src,
                self.rrefs.rebuild,
                allow=self.unpickle_allow,
                kind=msg.kind,
            )
        except BaseException as exc:
            pending.fut.set_exception(
                SerializationError(
                    f"the reply from {self.worker_by_id(msg.src)} could not be unpickled: {exc!r}"
                )
            )
        else:
            if type(value) is AutogradEnvelope:  # hook: a reply linked into a context (DAG-4)
                value = value.body
            if msg.kind is Kind.EXCEPTION:
                pending.fut.set_exception(self._rebuild_exception(value))
            else:
                pending.fut.set_result(value)
            if load.after_handling:
                load.handled()
        self._call_ended()

    def _take_accepts(self, msg_id: int) -> None:
        """The owner answered (or could never get) request ``msg_id``: the RRef forks it carried to
        their owner are accepted."""
        with self._lock:
            entry = self._accepted_by_reply.pop(msg_id, None)
        if entry is not None:
            self.rrefs.implied_accepts(entry[1])

    @staticmethod
    def _rebuild_exception(remote: Any) -> BaseException:
        if not isinstance(remote, _RemoteException):
            return RemoteError(f"malformed exception reply: {remote!r}")
        if remote.serialization:
            return serialization_error(remote.message, remote.exc_type)
        try:
            return remote.exc_type(remote.message)
        except BaseException as exc:
            return RuntimeError(
                f"Failed to create original exception type. Error msg was {exc} "
                f"Original exception on remote side was {remote.message}"
            )

    # -- serving --------------------------------------------------------------------------------
    def _submit_builtin(self, msg: Message) -> None:
        """A builtin operator call in the compact encoding: decoded here (it runs no user code and
        never blocks), then served on the request pool, or on this very thread if the world can and
        the call is brief (``World.submit``'s ``brief``). One that cannot be decoded is served as any request,
        whose decoding fails again and replies with the error."""
        try:
            call, load = _serialize.loads(
                msg.payload, msg.tensors, msg.src, None, True, self.unpickle_allow, msg.kind
            )
        except BaseException:
            self.world.submit(self._serve, msg)
            return
        self.world.submit(self._serve_loaded, msg, call, load, brief=_builtin_wire.is_brief(call))

    def _serve_loaded(self, msg: Message, obj: Any, load: _serialize.LoadState) -> None:
        try:
            self._handle(msg, obj, load)
        finally:
            if load.after_handling:
                load.handled()

    def _serve(self, msg: Message) -> None:
        """Run one request and reply (now, or when the value it waits for is ready)."""
        try:
            obj, load = _serialize.loads(
                msg.payload,
                msg.tensors,
                msg.src,
                self.rrefs.rebuild,
                request=True,
                allow=self.unpickle_allow,
                kind=msg.kind,
            )
        except BaseException as exc:
            self.reply_error(
                msg,
                SerializationError(
                    unpickle_error(
                        exc,
                        f"{self.info} could not unpickle a {msg.kind.name} request from "
                        f"{self._by_id.get(msg.src, msg.src)}",
                    )
                ),
            )
            return
        try:
            self._handle(msg, obj, load)
        finally:
            if load.after_handling:  # e.g. RRef child accepts, sent after the reply (twinrpc._rref_context)
                load.handled()

    def _handle(self, msg: Message, obj: Any, load: _serialize.LoadState) -> None:
        if load.unconfirmed_rrefs:
            try:
                for user in load.unconfirmed_rrefs:  # RREF-F3: run only once argument RRefs are confirmed
                    user.confirmed.wait()
            except BaseException as exc:  # the owner could not be reached to confirm a fork
                self.reply_error(msg, exc)
                return
        kind = msg.kind
        token = None
        if type(obj) is AutogradEnvelope:  # hook: run inside the caller's autograd context (DAG-4)
            obj, token = self.autograd.enter_request(msg, obj)
        try:
            if kind is Kind.CALL:
                func, args, kwargs = obj
                self._run(msg, func, args, kwargs, on_value=None)
            elif kind is Kind.REMOTE_CALL:
                rref_id, fork_id, func, args, kwargs = obj
                owner = self.rrefs.create_owner_for_remote(rref_id, fork_id)
                self._run(msg, func, args, kwargs, on_value=owner)
            elif kind is Kind.RREF_FETCH:
                owner = self.rrefs.get_or_create_owner(obj)
                add_internal_callback(
                    owner.value,
                    lambda f: self._reply_from(msg, f, link_parameters=fetched_through_torchscript(owner)),
                )
            elif kind is Kind.RREF_TYPE:
                owner = self.rrefs.get_or_create_owner(obj)
                add_internal_callback(owner.value, lambda f: self._reply_from(msg, f, transform=type))
            elif self.control.handles(kind):
                # Control messages are resent until acked; a duplicate is acked without being
                # handled or counted as served again (join counts logical requests; twinrpc._control_channel).
                if self.control.receive(msg.src, kind, obj):
                    self.reply(msg, None)
                else:
                    payload, _ = _serialize.dumps(None)
                    self.world.send(Message(Kind.RESPONSE, msg.id, self.info.id, msg.src, payload))
            elif kind is Kind.GRADIENT:  # hook: distributed backward (twinrpc._fast_engine)
                self.autograd.on_gradient(msg, obj)
            else:
                self.reply_error(msg, RPCError(f"{self.info} cannot serve a {kind.name} request"))
        except BaseException as exc:
            self.reply_error(msg, exc)
        finally:
            if token is not None:
                CURRENT_CONTEXT.reset(token)

    def _run(self, msg: Message, func: Any, args: Any, kwargs: Any, on_value: OwnerState | None) -> None:
        is_async = getattr(func, "_wrapped_async_rpc_function", None) is not None
        try:
            result = func(*args, **kwargs)
        except Exception as exc:
            if is_builtin(func) and not isinstance(exc, RuntimeError):
                exc = RuntimeError(f"{type(exc).__name__}: {exc}").with_traceback(exc.__traceback__)
            self._finish_run(msg, None, exc, on_value)
            return
        if not is_async:
            if on_value is None:
                self.reply(msg, result)  # _finish_run's case for a call, directly
            else:
                self._finish_run(msg, result, None, on_value)
            return
        # Every future torch makes is a torch._C.Future: torch.futures.Future(), what its then() and
        # collect_all() return, and twinrpc's own (a torch.futures.Future subclass). PyTorch accepts
        # them all (RPC-14).
        if not isinstance(result, torch._C.Future):
            err = RuntimeError(
                "Functions decorated with @rpc.async_function must return a torch.futures.Future "
                f"object, but got {type(result)}"
            )
            self._finish_run(msg, None, err, on_value)
            return

        def done(f: Any) -> None:
            try:
                value = f.wait()
            except BaseException as exc:
                self._finish_run(msg, None, exc, on_value)
            else:
                self._finish_run(msg, value, None, on_value)

        if isinstance(result, Future):
            add_internal_callback(result, done)  # only replies: the protocol's own, never blocks
        else:
            result.add_done_callback(done)

    def _finish_run(
        self, msg: Message, value: Any, exc: BaseException | None, owner: OwnerState | None
    ) -> None:
        if owner is not None:  # remote(): keep the value (or error) on the owner, reply with an ack
            if exc is None:
                owner.value.try_set_result(value)
            else:
                owner.value.try_set_exception(exc)
            self.reply(msg, None)
        elif exc is None:
            self.reply(msg, value)
        else:
            self.reply_error(msg, exc)

    def _reply_from(
        self,
        msg: Message,
        f: Future[Any],
        transform: Callable[[Any], Any] | None = None,
        *,
        link_parameters: bool = False,
    ) -> None:
        try:
            value = f.wait()
        except BaseException as exc:
            self.reply_error(msg, exc)
            return
        self.reply(msg, value if transform is None else transform(value), link_parameters=link_parameters)

    def reply(self, msg: Message, value: Any, *, link_parameters: bool = False) -> None:
        """Send ``value`` back for ``msg``; ``link_parameters``: see ``twinrpc._serialize.dumps``."""
        fork = ForkRecorder(self.rrefs, msg.src)
        try:
            # hook: the reply to a request served inside an autograd context joins it (DAG-4)
            linked = (
                self.autograd.dumps_reply(msg, value, fork, link_parameters=link_parameters)
                if self.autograd.replies
                else None
            )
            if linked is None and msg.payload[:1] == _COMPACT:  # a builtin call's result, without pickle
                linked = _builtin_wire.encode_value(value)
            payload, tensors = (
                linked
                if linked is not None
                else _serialize.dumps(value, fork, link_parameters=link_parameters)
            )
        except BaseException as exc:
            self.rrefs.unfork(fork.forks)  # this reply is not sent: an error reply goes instead
            self.reply_error(
                msg,
                serialization_error(
                    f"the result of a {msg.kind.name} request on {self.info} cannot be sent back: {exc}",
                    original_type(exc),
                ),
            )
            return
        reply = Message(Kind.RESPONSE, msg.id, self.info.id, msg.src, payload, tensors)
        if self.running and msg.kind not in CONTROL_KINDS:  # _send_reply's common case, inlined
            with self._lock:
                self._served_requests += 1
            self.world.send(reply)
        else:
            self._send_reply(msg, reply)

    def reply_error(self, msg: Message, exc: BaseException) -> None:
        if self.autograd.replies:  # hook: no reply will join the context
            self.autograd.forget_reply(msg)
        text = "".join(traceback.format_exception(exc))
        message = f"On {self.info}:\n{remote_repr(exc)}\n{text}"  # PyTorch's form (ERR-1)
        remote = _RemoteException(original_type(exc), message, isinstance(exc, SerializationError))
        try:
            payload, tensors = _serialize.dumps(remote)
        except BaseException:  # the type itself cannot travel (e.g. a local class)
            payload, tensors = _serialize.dumps(
                _RemoteException(RemoteError, remote.message, remote.serialization)
            )
        self._send_reply(msg, Message(Kind.EXCEPTION, msg.id, self.info.id, msg.src, payload, tensors))

    def _send_reply(self, request: Message, reply: Message) -> None:
        if not self.running:
            # This worker has left (finalize ran): it sends nothing more, so the caller's call fails
            # with the departure error its world announced, in both worlds (SHUT-3).
            return
        if request.kind not in CONTROL_KINDS:
            with self._lock:
                self._served_requests += 1
        elif request.kind is Kind.CONTEXT_CLEANUP or request.kind is Kind.RREF_USER_DELETE:
            # Nothing waits on the ack of a release or of a dead RRef's delete either: it rides with
            # the next message back (in a training loop, the reply to the call the release itself
            # rode with).
            reply.deferrable = True
        self.world.send(reply)

    # -- shutdown -------------------------------------------------------------------------------
    def wait_idle(self) -> None:
        """Block until this worker has no outstanding client call."""
        with self._lock:
            if self._active_calls == 0:
                return
            if self._idle is None:
                self._idle = Future()
                self._idle.label = f"{self.info.name}'s outstanding calls to finish (shutdown)"
            idle = self._idle
        idle.wait()

    def sleep(self, seconds: float) -> None:
        """Block this task for ``seconds`` of the world's clock."""
        fut: Future[None] = Future()
        self.world.call_later(seconds, lambda: fut.set_result(None))
        fut.wait()

    def request_counts(self) -> tuple[int, int]:
        """(requests sent, requests served) so far, control messages excluded: what graceful
        shutdown's join compares across the world (twinrpc._shutdown)."""
        with self._lock:
            return self._sent_requests, self._served_requests

    def shutdown(self, graceful: bool, timeout: float, *, ignore_rref_leak: bool = True) -> None:
        """``rpc.shutdown``: the graceful protocol (twinrpc._shutdown) when ``graceful``, then the local
        teardown; a dynamic member only leaves its group (LIFE-5)."""
        if self.dynamic:
            from ._membership import leave_group

            leave_group(self, graceful, timeout, ignore_rref_leak=ignore_rref_leak)
            return
        completed = False
        try:
            if graceful:
                self.shutdown_protocol.run(timeout)
                completed = True
        finally:
            self.finalize(graceful=graceful, ignore_rref_leak=ignore_rref_leak, completed=completed)

    def finalize(
        self, *, graceful: bool = False, ignore_rref_leak: bool = True, completed: bool = False
    ) -> None:
        """Local teardown: stop the world, fail whatever is still pending.

        Raises:
            RuntimeError: "Leaking RRef ..." when an owner still has forks and ``ignore_rref_leak`` is
                False (SHUT-4), after the teardown completed.
        """
        if not self.running:
            return
        self.running = False
        self.control.close()
        leak_error = self.rrefs.close(graceful, ignore_rref_leak)  # RRef leak check (SHUT-4)
        with self._lock:  # emptied in place: the call deadlines read this table
            pending = dict(self._pending)
            self._pending.clear()
        for p in pending.values():
            p.fut.set_exception(
                ShutdownError(
                    f"RPC agent of {self.info} shut down while a {p.kind.name} to {self.worker_by_id(p.dst)} was pending"
                )
            )
        # ``completed``: every worker passed the final join, so peers may see our departure as
        # orderly (it must not fail their own last collective, which no longer needs us).
        self.world.stop(graceful=completed)
        if leak_error is not None:
            raise leak_error

    def statistics(self) -> dict[str, Any]:
        with self._lock:
            stats = {
                "name": self.info.name,
                "rank": self.info.id,
                "pending_calls": len(self._pending),
                "active_calls": self._active_calls,
                "sent_requests": self._sent_requests,
                "served_requests": self._served_requests,
            }
        stats.update(self.rrefs.statistics())
        return stats
