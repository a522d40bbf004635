"""The reliable control channel: messages the protocol resends until acked and handles once.

RRef control messages (user delete, fork request, child accept) and distributed autograd's context
cleanup are requests answered by an ack. They are **retried** when the ack does not come within a
retry interval (a lost message or a lost ack), per a :class:`RetryPolicy`: the RRef messages with
exponential backoff until acked (:data:`CONTROL_RETRY`), the cleanup with PyTorch's own bounded
schedule for it (``twinrpc._dist_autograd.CLEANUP_RETRY``). A message is abandoned when the peer is
known dead or this worker shuts down.

Every control message carries ``(seq, low, body)``: ``seq`` numbers the logical message per
destination and is reused by its resends; ``low`` is the smallest sequence number the sender has not
seen acked yet, so the receiver can forget everything below it. The receiver handles each ``seq``
once and acks duplicates without handling them again, so a duplicated or resent fork request can
never resurrect a fork that was deleted in between. Its memory is bounded by the number of unacked
messages.

Graceful shutdown's termination detection (``twinrpc._shutdown``) does not count control messages as
requests: each is tracked by its sender until acked or given up (:meth:`ControlChannel.unsettled`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import RPCError, RPCTimeoutError, ShutdownError
from ._future import Future, add_internal_callback
from ._message import Kind

if TYPE_CHECKING:
    from ._agent import RpcAgent

__all__ = ["CONTROL_RETRY", "ControlChannel", "RetryPolicy"]

_log = logging.getLogger("twinrpc")

#: first resend of an unacked control message after this many seconds of the world's clock
CONTROL_RETRY_INITIAL = 1.0
#: the backoff doubles up to this interval
CONTROL_RETRY_MAX = 16.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When a control message that got no ack is sent again.

    Attempt ``k`` (0 is the first send) waits ``min(ack_wait * ack_wait_growth**k, ack_wait_max)``
    seconds for its ack (``ack_wait`` None: the agent's ``rpc_timeout``, and 0 waits forever). After a
    timeout, attempt ``k + 1`` is sent once ``spacing * backoff**k`` seconds have passed since attempt
    ``k`` was sent (at once if they have). ``max_retries`` bounds the resends (None: until acked).
    """

    ack_wait: float | None
    ack_wait_growth: float = 1.0
    ack_wait_max: float = float("inf")
    spacing: float = 0.0
    backoff: float = 1.0
    max_retries: int | None = None

    def ack_timeout(self, attempt: int, rpc_timeout: float) -> float:
        if self.ack_wait is None:
            return rpc_timeout
        return min(self.ack_wait * self.ack_wait_growth**attempt, self.ack_wait_max)

    def next_send_after(self, attempt: int) -> float:
        """Seconds after attempt ``attempt`` was sent that attempt ``attempt + 1`` may be sent."""
        return self.spacing * self.backoff**attempt


#: RRef control messages: resent as soon as an ack wait of 1 s, doubling up to 16 s, expires; no bound
CONTROL_RETRY = RetryPolicy(
    ack_wait=CONTROL_RETRY_INITIAL, ack_wait_growth=2.0, ack_wait_max=CONTROL_RETRY_MAX
)

#: what a control message's receiver runs for it: ``handler(src, body)``, once per logical message
ControlHandler = Callable[[int, Any], None]


class _Outbox:
    """Sender side of the channel to one peer."""

    __slots__ = ("seq", "unacked")

    def __init__(self) -> None:
        self.seq = itertools.count()
        self.unacked: set[int] = set()


@dataclass(frozen=True, slots=True)
class _Control:
    """One control message being sent: what every (re)send of it needs."""

    dst: int
    kind: Kind
    seq: int
    body: Any
    #: completes when the ack arrives, or fails (see ControlChannel.send)
    done: Future[None]
    policy: RetryPolicy
    #: its first attempt may ride with the next message to dst (Message.deferrable)
    deferrable: bool


class _Inbox:
    """Receiver side of the channel from one peer: which sequence numbers were handled."""

    __slots__ = ("floor", "seen")

    def __init__(self) -> None:
        self.floor = 0  # every seq below this was handled (the sender saw it acked)
        self.seen: set[int] = set()  # handled seqs >= floor


class ControlChannel:
    """One worker's end of the control channel to every peer. Thread-safe.

    Sends go out as requests of the agent (so they time out, fail when the peer departs, and are
    answered like any request); handlers are registered per message kind by the protocol parts that
    own them (the RRef context, distributed autograd)."""

    def __init__(self, agent: RpcAgent) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._outboxes: dict[int, _Outbox] = {}
        self._inboxes: dict[int, _Inbox] = {}
        self._handlers: dict[Kind, ControlHandler] = {}
        self._closed = False
        #: resends so far (observability; the soak and property tests read it)
        self.resends = 0

    def register(self, kind: Kind, handler: ControlHandler) -> None:
        """Run ``handler(src, body)`` for each logical control message of ``kind`` that arrives."""
        self._handlers[kind] = handler

    def handles(self, kind: Kind) -> bool:
        return kind in self._handlers

    def close(self) -> None:
        """This worker shuts down: no more resends (a message due for one fails with ShutdownError)."""
        self._closed = True

    # -- sending ---------------------------------------------------------------------------------
    def send(
        self, dst: int, kind: Kind, body: Any, policy: RetryPolicy = CONTROL_RETRY, deferrable: bool = False
    ) -> Future[None]:
        """Send a control message to ``dst``, resending it per ``policy`` until acked. The receiver
        handles it once however often it arrives. ``deferrable``: the first attempt may wait briefly
        to travel with the next message to ``dst`` (``Message.deferrable``).

        The returned future completes when the ack arrives, or fails when the peer is unreachable, this
        worker shuts down or the policy's retries are used up.
        """
        with self._lock:
            out = self._outboxes.get(dst)
            if out is None:
                out = self._outboxes[dst] = _Outbox()
            seq = next(out.seq)
            out.unacked.add(seq)
        done: Future[None] = Future()
        done.label = f"ack of {kind.name} seq {seq} from rank {dst}"
        self._attempt(_Control(dst, kind, seq, body, done, policy, deferrable), 0)
        return done

    def send_quietly(self, dst: int, kind: Kind, body: Any, deferrable: bool = False) -> None:
        """Fire-and-forget control message (retried); a final failure is only logged. ``deferrable``:
        see send."""
        try:
            fut = self.send(dst, kind, body, deferrable=deferrable)
        except Exception as exc:  # the agent may be going away
            _log.debug("twinrpc: could not send %s to rank %d: %s", kind.name, dst, exc)
            return
        add_internal_callback(fut, lambda f: _log_failure(f, kind, dst))

    def _settle(self, c: _Control) -> None:
        with self._lock:
            self._outboxes[c.dst].unacked.discard(c.seq)

    def _attempt(self, c: _Control, attempt: int) -> None:
        out = self._outboxes[c.dst]
        if self._closed and attempt:
            self._settle(c)
            c.done.try_set_exception(ShutdownError(f"{c.kind.name} to rank {c.dst} abandoned: RPC shut down"))
            return
        with self._lock:
            low = min(out.unacked)
        agent = self._agent
        timeout = c.policy.ack_timeout(attempt, agent.rpc_timeout)
        sent_at = agent.world.now()
        try:
            fut = agent.request(c.dst, c.kind, (c.seq, low, c.body), timeout, c.deferrable and not attempt)
        except BaseException as exc:
            self._settle(c)
            c.done.try_set_exception(exc)
            return
        if attempt:
            with self._lock:
                self.resends += 1
        add_internal_callback(fut, lambda f: self._attempt_done(f, c, attempt, sent_at))

    def _attempt_done(self, f: Future[Any], c: _Control, attempt: int, sent_at: float) -> None:
        policy = c.policy
        try:
            f.wait()
        except RPCTimeoutError as exc:
            if policy.max_retries is not None and attempt >= policy.max_retries:
                self._settle(c)
                err = RPCError(
                    "The RPC has not succeeded after the specified number of max retries "
                    f"({policy.max_retries}): {c.kind.name} to rank {c.dst}"
                )
                err.__cause__ = exc
                c.done.try_set_exception(err)
                return
            _log.debug("twinrpc: no ack for %s seq %d to rank %d; resending", c.kind.name, c.seq, c.dst)
            world = self._agent.world
            wait = sent_at + policy.next_send_after(attempt) - world.now()
            if wait > 0:
                world.call_later(wait, lambda: self._attempt(c, attempt + 1))
            else:
                self._attempt(c, attempt + 1)
            return
        except BaseException as exc:
            self._settle(c)
            c.done.try_set_exception(exc)
            return
        self._settle(c)
        c.done.try_set_result(None)

    def unsettled(self) -> int:
        """Control messages sent and neither acked nor given up yet (what shutdown's join waits for)."""
        with self._lock:
            return sum(len(out.unacked) for out in self._outboxes.values())

    # -- receiving -------------------------------------------------------------------------------
    def receive(self, src: int, kind: Kind, payload: Any) -> bool:
        """A control message arrived from ``src``: handle it unless it is a duplicate or a resend of
        one already handled. Returns whether it was handled (fresh); either way it must be acked.

        Raises:
            Whatever the handler raises (the caller answers the request with it).
        """
        seq, low, body = payload
        with self._lock:
            inbox = self._inboxes.get(src)
            if inbox is None:
                inbox = self._inboxes[src] = _Inbox()
            if low > inbox.floor:
                inbox.floor = low
                inbox.seen = {s for s in inbox.seen if s >= low}
            if seq < inbox.floor or seq in inbox.seen:
                return False
            inbox.seen.add(seq)
        self._handlers[kind](src, body)
        return True

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {
                "num_control_unacked": sum(len(o.unacked) for o in self._outboxes.values()),
                "num_control_resends": self.resends,
            }


def _log_failure(f: Future[Any], kind: Kind, dst: int) -> None:
    try:
        f.wait()
    except BaseException as exc:
        _log.debug("twinrpc: %s to rank %d was not acknowledged: %s", kind.name, dst, exc)
