"""Graceful shutdown (SHUT-1, SHUT-2): the barrier, the join and the RRef drain, for both worlds.

``shutdown(graceful=True)`` is PyTorch's sequence: an all-gather of every worker (the barrier), a
join that waits until no request is in flight anywhere, the RRef release (SHUT-1 step 2) and a
second join. The all-gather goes through the leader (the lexicographically smallest name), as in
PyTorch's ``_all_gather``. A worker that departs without completing its own graceful shutdown makes
every all-gather fail, but not at once: the leader waits until every live worker has contributed (a
live worker still training keeps being served meanwhile), then fails it and tells the live followers
why, so every ``shutdown`` raises the same error naming the departed worker instead of waiting
forever (SHUT-2, SHUT-7). Only a dead leader fails the followers at once: nobody is left to wait for
the others.

The local teardown that follows (``RpcAgent.finalize``) is the agent's: it is also what a
non-graceful shutdown does.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _serialize
from ._departure import Departure, relayed_departure
from ._errors import RPCTimeoutError, WorkerUnavailableError
from ._future import Future, wait_bounded
from ._message import Kind, Message

if TYPE_CHECKING:
    from ._agent import RpcAgent

__all__ = ["ShutdownProtocol"]

_log = logging.getLogger("twinrpc")

#: how long graceful shutdown waits for owners to be released when no timeout is given (PyTorch: 100 s)
OWNER_DRAIN_TIMEOUT = 100.0
#: join rounds back off while requests are still in flight, so a slow handler costs no busy loop
_JOIN_BACKOFF_MIN = 1e-3
_JOIN_BACKOFF_MAX = 0.1


@dataclass(frozen=True, slots=True)
class _GatherAborted:
    """The leader's answer to an all-gather that a departed worker made impossible, sent once every
    live worker has contributed (or the timeout passed): the error it failed with (its text, and how
    the worker left as ``Departure.value``)."""

    why: str
    departure: str | None


@dataclass(frozen=True)
class _PeerDied:
    """A follower's news for the leader, sent before its contribution to an all-gather (or while it
    waits for the answer): worker ``rank`` died (or fell silent). The leader counts that worker as
    departed as if it had seen the death itself, whatever it has heard of it yet: it need not wait
    for a worker that will never contribute, and a follower leaving because of that death (its
    shutdown timed out) is not blamed for it (on a loaded host a crash's news can reach the leader
    after the follower's close frame)."""

    rank: int
    departure: str


class ShutdownProtocol:
    """One worker's part in graceful shutdown. Thread-safe."""

    def __init__(self, agent: RpcAgent) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._gathered: dict[Hashable, dict[int, Any]] = {}
        self._gather_done: dict[Hashable, Future[None]] = {}
        self._scattered: dict[Hashable, Future[Any]] = {}
        #: the first error of each peer that departed without completing a graceful shutdown
        self._peer_errors: dict[int, WorkerUnavailableError] = {}
        #: follower: the deaths already passed on to the leader (_PeerDied)
        self._told: set[int] = set()

    # -- what the agent reports --------------------------------------------------------------------
    def peer_failed(self, peer: int, exc: WorkerUnavailableError, orderly: bool) -> None:
        """``peer`` departed. No all-gather can succeed any more, but the leader fails one only once
        every live worker has contributed (SHUT-7): the all-gathers waiting for no one else but
        ``peer`` end now, the others when their last live worker arrives. A follower fails its
        all-gathers at once only when the leader departed; otherwise it passes the news on to the
        leader and keeps waiting for its answer. Nothing changes when the peer left in order, after
        the final join of its graceful shutdown: it no longer takes part, and the verdict it saw is
        on its way to us."""
        if orderly:
            return
        agent = self._agent
        leader = agent.leader.id
        leading = agent.info.id == leader
        ended: list[Future[None]] = []
        waits: list[Future[Any]] = []
        with self._lock:
            self._peer_errors.setdefault(peer, exc)
            if leading:
                ended = [
                    done
                    for tag, done in self._gather_done.items()
                    if self._all_arrived(self._gathered.get(tag, {}))
                ]
            else:
                waits = list(self._scattered.values())
        if leading:
            for done in ended:
                done.try_set_result(None)
        elif peer == leader:
            for fut in waits:
                fut.try_set_exception(exc)
        elif any(not fut.done() for fut in waits):
            self._tell_leader_of_deaths()

    def peer_joined(self, peer: int) -> None:
        """A new worker took ``peer``'s rank in a dynamic group: the old one's departure is history."""
        with self._lock:
            self._peer_errors.pop(peer, None)
            self._told.discard(peer)

    def on_message(self, msg: Message) -> None:
        """A ``GATHER`` (at the leader) or ``SCATTER`` (at a follower) arrived."""
        if msg.kind is Kind.GATHER:
            self._on_gather(msg)
        else:
            self._on_scatter(msg)

    # -- the sequence ----------------------------------------------------------------------------
    def run(self, timeout: float) -> None:
        """SHUT-1: barrier, join, RRef release, join. ``timeout`` (seconds, 0 = unbounded) bounds each
        wait. Raises what ends it early (a departed worker, a timeout); the caller tears down either way."""
        agent = self._agent
        self.all_gather(("shutdown",), None, timeout, combine=_nothing)
        self.join(timeout)
        drain_bound = timeout if timeout > 0 else OWNER_DRAIN_TIMEOUT
        # RRefs (SHUT-1 step 2): confirm pending forks, delete every user RRef held here.
        agent.rrefs.release_for_shutdown(drain_bound)
        try:
            wait_bounded(
                agent.rrefs.wait_owners_drained(),
                drain_bound,
                lambda: (
                    f"{agent.info} timed out after {drain_bound} s waiting for its owner RRefs to be released"
                ),
                agent.world.call_later,
            )
        except RPCTimeoutError as exc:  # as in PyTorch, only logged; the leak check reports it
            _log.warning("twinrpc: %s", exc)
        self.join(timeout)

    def join(self, timeout: float) -> None:
        """Wait until no request is in flight anywhere (SHUT-1 step 3).

        Four-counter termination detection: each round every worker first drains its own calls, then
        all-gathers (requests sent, requests served, control messages not yet settled); the world is
        quiet when sent equals served, nothing is unsettled, and the totals are unchanged across two
        consecutive rounds. Control messages are not counted as requests: each is resent until acked
        and handled once, so its sender tracks it until it is acked or given up (after its retries,
        or when the peer is gone), and a control message lost for good cannot keep the counts apart.
        """
        agent = self._agent
        previous = None
        backoff = _JOIN_BACKOFF_MIN
        for round_no in itertools.count():
            agent.wait_idle()
            sent, served = agent.request_counts()
            counts = (sent, served, agent.control.unsettled())
            totals = self.all_gather(("join", round_no), counts, timeout, combine=_totals)
            quiet = totals[0] == totals[1] and totals[2] == 0
            if quiet and totals == previous:
                return
            if not quiet and totals == previous:
                # Requests are still being served somewhere (a slow handler), or a control message
                # waits to be resent: don't spin rounds.
                agent.sleep(backoff)
                backoff = min(backoff * 2, _JOIN_BACKOFF_MAX)
            previous = totals

    # -- the all-gather --------------------------------------------------------------------------
    def all_gather(
        self,
        tag: Hashable,
        value: Any,
        timeout: float,
        combine: Callable[[list[Any]], Any] | None = None,
    ) -> Any:
        """Gather one value per worker through the leader; every worker gets the list, in rank order,
        or ``combine(list)``, computed once by the leader, which sends only that to the followers (the
        barrier and the join need no list: sending it to every follower is N^2 work in an N-worker
        world, which dominated the simulator's time at 2048 workers)."""
        agent = self._agent
        me = agent.info.id
        if me == agent.leader.id:
            return self._gather_as_leader(tag, value, timeout, combine)
        with self._lock:
            # Only a dead leader fails a follower at once; any other departure is the leader's to
            # weigh, once every live worker has arrived (SHUT-7).
            dead = self._first_departure() if agent.leader.id in self._peer_errors else None
            if dead is None:
                fut = self._scattered.setdefault(tag, Future())
        if dead is not None:
            raise dead
        fut.label = f"the shutdown leader {agent.leader.name} to answer _all_gather {tag}"
        self._tell_leader_of_deaths()  # the news first, then the contribution (one link, in order)
        payload, _ = _serialize.dumps((tag, value))
        agent.world.send(Message(Kind.GATHER, 0, me, agent.leader.id, payload))
        try:
            result = wait_bounded(
                fut,
                timeout,
                lambda: (
                    f"{agent.info} timed out after {timeout} s waiting for the shutdown leader {agent.leader} in _all_gather"
                ),
                agent.world.call_later,
            )
        except RPCTimeoutError as exc:
            with self._lock:
                self._scattered.pop(tag, None)
                dead = self._first_departure()
            if dead is None:
                raise
            raise _also_timed_out(dead, exc) from exc  # name the worker that died all the same
        except WorkerUnavailableError:  # the leader's verdict, or the leader departed
            with self._lock:
                self._scattered.pop(tag, None)
            raise
        with self._lock:
            self._scattered.pop(tag, None)
        return result

    def _tell_leader_of_deaths(self) -> None:
        """Follower: tell the leader which workers this one saw die and has not told it of yet (see
        _PeerDied), before this worker's contribution, or its leaving, can reach it."""
        agent = self._agent
        leader = agent.leader.id
        with self._lock:
            if leader in self._peer_errors:
                return  # nobody to tell
            died = [
                (peer, err.departure)
                for peer, err in self._peer_errors.items()
                if peer not in self._told and err.departure is not None and not err.departure.shut_down
            ]
            self._told.update(peer for peer, _ in died)
        for peer, departure in died:
            payload, _ = _serialize.dumps((None, _PeerDied(peer, departure.value)))
            agent.world.send(Message(Kind.GATHER, 0, agent.info.id, leader, payload))

    def _gather_as_leader(
        self, tag: Hashable, value: Any, timeout: float, combine: Callable[[list[Any]], Any] | None
    ) -> Any:
        agent = self._agent
        me = agent.info.id
        workers = agent.workers
        # Links are made on first use: one to every follower now, so that a follower that died
        # before it ever linked to the leader is seen departed rather than awaited.
        agent.world.reach(w.id for w in workers)
        with self._lock:
            # Complete when every worker has contributed or departed (checked under the lock that
            # peer_failed takes, so a departure between this check and the wait still ends it). A
            # departed worker (any: the leader needs all) fails the collective instead of letting it
            # wait forever, but only once the live workers have arrived (SHUT-7): until then their
            # calls keep being served.
            got = self._gathered.setdefault(tag, {})
            got[me] = value
            done = self._gather_done.setdefault(tag, Future())
            complete = self._all_arrived(got)
        if complete:
            done.try_set_result(None)
        try:
            wait_bounded(
                done, timeout, lambda: self._gather_timeout_msg(tag, timeout), agent.world.call_later
            )
        except RPCTimeoutError as exc:
            with self._lock:
                dead = self._first_departure()
            if dead is None:
                raise
            dead = _also_timed_out(dead, exc)
            self._abort_gather(tag, dead)
            raise dead from exc
        with self._lock:
            got = self._gathered.pop(tag)
            self._gather_done.pop(tag, None)
            dead = self._first_departure()
        if dead is not None:
            self._abort_gather(tag, dead)
            raise dead
        result: Any = [got[w.id] for w in workers]
        if combine is not None:
            result = combine(result)
        payload, _ = _serialize.dumps((tag, result))
        for w in workers:
            if w.id != me:
                agent.world.send(Message(Kind.SCATTER, 0, me, w.id, payload))
        return result

    def _gather_timeout_msg(self, tag: Hashable, timeout: float) -> str:
        with self._lock:
            got = self._gathered.get(tag, {})
            missing = [
                w.name for w in self._agent.workers if w.id not in got and w.id not in self._peer_errors
            ]
        return f"Followers {missing} timed out in _all_gather after {timeout:.2f} seconds"

    def _all_arrived(self, got: dict[int, Any]) -> bool:
        """Leader: every worker has contributed to an all-gather (``got``) or departed; call with
        ``self._lock`` held."""
        workers = self._agent.workers
        if len(got) == len(workers):
            return True  # the common case, in O(1): a leader gets one message per worker
        return bool(self._peer_errors) and all(w.id in got or w.id in self._peer_errors for w in workers)

    def _on_gather(self, msg: Message) -> None:
        (tag, value), _ = _serialize.loads(
            msg.payload, msg.tensors, msg.src, allow=self._agent.unpickle_allow
        )
        if isinstance(value, _PeerDied):
            # as if this worker had seen it die (the same words, this worker the observer)
            agent = self._agent
            seen = f"seen dead by {agent.worker_by_id(msg.src)}"
            err = agent.departure_error(value.rank, Departure(value.departure), seen)
            self.peer_failed(value.rank, err, orderly=False)
            return
        with self._lock:
            got = self._gathered.setdefault(tag, {})
            got[msg.src] = value
            done = self._gather_done.setdefault(tag, Future())
            complete = self._all_arrived(got)
        if complete:
            done.try_set_result(None)

    def _on_scatter(self, msg: Message) -> None:
        (tag, result), _ = _serialize.loads(
            msg.payload, msg.tensors, msg.src, allow=self._agent.unpickle_allow
        )
        with self._lock:
            fut = self._scattered.setdefault(tag, Future())
        if isinstance(result, _GatherAborted):
            fut.try_set_exception(
                relayed_departure(
                    result.why, result.departure, f"the shutdown leader {self._agent.leader.name}"
                )
            )
        else:
            fut.try_set_result(result)

    def _first_departure(self) -> WorkerUnavailableError | None:
        """A fresh error for the departed peer to blame, if any; call with ``self._lock`` held.

        The first peer found dead (crashed or silent), else the first found departed: a worker that
        dies often makes others leave (a graceful shutdown that fails on it shuts its worker down),
        and the error must name the worker that died, not one that left because of it, whichever
        news arrived first (on a loaded host either may)."""
        errors = list(self._peer_errors.values())
        died = [e for e in errors if e.departure is not None and not e.departure.shut_down]
        for cause in died or errors:
            err = relayed_departure(str(cause), cause.departure.value if cause.departure else None)
            err.__cause__ = cause
            return err
        return None

    def _abort_gather(self, tag: Hashable, exc: WorkerUnavailableError) -> None:
        """Leader: a worker departed, and every live one has arrived (or the timeout passed); tell the
        live followers why the all-gather failed, so their ``shutdown`` raises the same error naming
        that worker (SHUT-2). A follower that has not arrived yet (after a timeout) gets it when it
        does."""
        agent = self._agent
        with self._lock:
            self._gathered.pop(tag, None)
            self._gather_done.pop(tag, None)
            dead = set(self._peer_errors)
        departure = exc.departure.value if exc.departure is not None else None
        payload, _ = _serialize.dumps((tag, _GatherAborted(str(exc), departure)))
        for w in agent.workers:
            if w.id != agent.info.id and w.id not in dead:
                agent.world.send(Message(Kind.SCATTER, 0, agent.info.id, w.id, payload))


def _also_timed_out(dead: WorkerUnavailableError, timed_out: RPCTimeoutError) -> WorkerUnavailableError:
    """The error of a shutdown that timed out after a worker departed: the departure is the cause
    to name, the timeout (which live workers were still missing) what ended the wait."""
    err = relayed_departure(f"{dead}; {timed_out}", dead.departure.value if dead.departure else None)
    err.__cause__ = dead.__cause__
    return err


def _nothing(values: list[Any]) -> None:
    """The barrier's result: that every worker arrived."""
    return None


def _totals(counts: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    """The join's result: (requests sent, requests served, unsettled control messages), summed."""
    sent = served = unsettled = 0
    for a, b, c in counts:
        sent += a
        served += b
        unsettled += c
    return sent, served, unsettled
