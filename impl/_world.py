"""The gloo world: twinrpc's real, multiprocess implementation of ``twinrpc._world.World``."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from twinrpc._departure import Departure
from twinrpc._errors import AuthenticationError
from twinrpc._message import Message
from twinrpc._serialize import copy_storages
from twinrpc._worker_info import WorkerInfo
from twinrpc._world import GroupMembership, TimerHandle, World, WorldEvents

from ._auth import FrameAuth
from ._door_watch import DOOR_WATCH
from ._dynamic_group import StoreGroup
from ._link import THREAD_ROLE, PeerLink, PeerShutDown, PeerSilent, link_broken, make_pair_group
from ._link_table import LinkTable, PairAsks, PolledWaits
from ._pair import PairGroup
from ._pool import CallbackRunner, RequestPool
from ._rendezvous import Joined
from ._timer import TimerThread
from ._trace import TraceRecorder

_log = logging.getLogger("twinrpc.impl")
_CLOSE_WAIT = 10.0
#: after abandoning a link at shutdown, how long its threads get to leave gloo (they wake at once)
_ABANDON_WAIT = 2.0
#: how long stop() waits for the pool, timer and link threads to exit (they do at once, unless one is
#: still running a request: possible after shutdown(graceful=False))
_THREAD_EXIT_WAIT = 2.0
#: seconds a deferrable message waits at most for another message to ride with (PeerLink.defer)
RIDER_WAIT = 0.05
#: how long a process whose peer failed lets that peer's process exit first when it exits itself
#: (see FollowOnExit): the failed peer may spend _THREAD_EXIT_WAIT joining its threads after its
#: links closed, then its interpreter finalizes
FOLLOW_ON_EXIT_GRACE = _THREAD_EXIT_WAIT + 1.0


class FollowOnExit:
    """Lets the process whose failure started a cascade exit first.

    When a worker fails (its program raises, or its process dies), its links close and its peers'
    calls fail with ``WorkerUnavailableError`` at once; their programs raise in turn and their
    processes exit. A launcher that reports the first process to exit with an error
    (``torch.multiprocessing.spawn``, torchrun) then often reports a peer's follow-on error instead of
    the one that started it, since the failed worker still joins its threads and finalizes. So a
    process that saw a peer's link break (a crash, or a shutdown without the graceful protocol)
    waits at interpreter exit until :data:`FOLLOW_ON_EXIT_GRACE` seconds after it saw that, after
    its own links are closed: the peer's process exits first, and a peer of it that failed in turn
    after it. Bounded, and only after such a departure; a process whose RPC then ended with a
    completed graceful shutdown (it did not fail) or that exits through ``os._exit`` (or a signal)
    does not wait."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: time.monotonic() of the latest peer failure this process saw; None: none
        self._seen: float | None = None
        atexit.register(self.wait)  # now, on import: it runs after the atexit hooks of every world

    def peer_failed(self, departure: Departure) -> None:
        """A link to a peer reported ``departure``."""
        if departure is Departure.CRASHED or departure is Departure.SHUT_DOWN:
            with self._lock:
                self._seen = time.monotonic()

    def settled(self) -> None:
        """This process's RPC ended with a completed graceful shutdown: nothing of it follows a failure."""
        with self._lock:
            self._seen = None

    def wait(self) -> None:
        """At interpreter exit: let a failed peer's process exit first (see the class)."""
        with self._lock:
            seen = self._seen
        if seen is not None:
            time.sleep(max(0.0, seen + FOLLOW_ON_EXIT_GRACE - time.monotonic()))


FOLLOW_ON_EXIT = FollowOnExit()
#: seconds dead user RRefs' deletes are gathered before the timer sends them (see schedule_rref_delete)
DELETE_WAIT = 0.01


class GlooWorld(World):
    """One process's world: links to the peers it talks to (made on first use in a static group,
    impl/_link_table.py; to every member in a dynamic one), a request pool, a timer. Thread-safe."""

    clock_name = "wall-clock"

    def __init__(
        self,
        joined: Joined,
        num_worker_threads: int,
        *,
        heartbeat_interval: float,
        heartbeat_misses: int,
        rpc_timeout: float,
    ) -> None:
        self.rank = joined.rank
        #: every worker this one has known, by rank (a departed worker stays, for error messages)
        self.workers: dict[int, WorkerInfo] = {w.id: w for w in joined.workers}
        #: this worker's dynamic group (LIFE-5); the world returns from a join holding its token
        self._group: StoreGroup | None = joined.group
        #: the job key (impl/_auth.py): every link's frames are authenticated; None: no key
        self._auth = joined.auth
        self.membership: GroupMembership | None = joined.group
        self.agent: WorldEvents | None = None
        self._early: list[Message] = []
        self._early_failures: list[tuple[int, Departure, str]] = []
        #: TWINRPC_TRACE=dir: this worker's sends and deliveries are written there (impl/_trace.py)
        self._recorder = TraceRecorder.from_env(self.rank, joined.workers)
        self._lock = threading.Lock()
        self._stopped = False
        #: a thread making a link was still running when the world stopped (see _release)
        self._still_linking = False
        #: a timer is set to send the riders still waiting (one for all links, see _flush_riders)
        self._rider_timer = False
        #: dead user RRefs' deletes waiting for the timer (see schedule_rref_delete), under
        #: _delete_lock: a lock of their own, held only where nothing is allocated that garbage
        #: collection could interrupt to add a delete on the same thread
        self._deletes: list[Callable[[], Any]] = []
        self._delete_lock = threading.Lock()
        self._pool = RequestPool(num_worker_threads, f"twinrpc-pool-{self.rank}")
        #: user Future callbacks of futures completed on the links' and the timer's threads
        self._callbacks = CallbackRunner(self._pool.run_job)
        self._timer = TimerThread(f"twinrpc-timer-{self.rank}", defer_callbacks=self._callbacks.submit)
        # With heartbeats the timer judges a stuck send (PeerLink.check_alive); without them a send
        # waits at most rpc_timeout in gloo (none with rpc_timeout=0: the user chose to wait forever).
        self._send_timeout = None if heartbeat_interval > 0 or rpc_timeout <= 0 else rpc_timeout
        #: how long a silent peer may stay silent before it is judged dead
        silence = (
            heartbeat_interval * heartbeat_misses
            if heartbeat_interval > 0
            else joined.timeout.total_seconds()
        )
        # A static group's links are made on first use (impl/_link_table.py); a dynamic group's
        # joiner connects to every member now, as each member connects to it (_watch_joins).
        self._table = LinkTable(
            self.rank,
            PairAsks(joined.run_store or joined.store, self.rank) if self._group is None else None,
            lambda peer: self._make_link(peer, *self._connect(pair_store, peer)),
            self._start_link,
            self._peer_failed,
            self._send_failed,
            silence,
        )
        # pairs are made over waits that never hold the store's connection, and end when we stop
        pair_store = PolledWaits(
            joined.pair_store if joined.pair_store is not None else joined.store,
            joined.timeout,
            self._table.stopping,
        )
        if self._group is not None:
            self._group.confirm(silence)  # every member answers our join notice before anything connects
            # Pairs are created in one global order, so no two processes wait on each other in a cycle.
            for peer in sorted(self.workers):
                if peer != self.rank and peer not in joined.stopped:
                    pg, auth = self._connect(pair_store, peer)
                    self._table.add(self._make_link(peer, pg, auth))
        self._store = joined.store
        for link in self.links.values():
            self._start_link(link)
        self._table.watch()
        #: a dynamic member's thread that connects the links to workers joining later
        self._watcher: threading.Thread | None = None
        if self._group is not None:
            self._watcher = threading.Thread(
                target=self._watch_joins, name=f"twinrpc-joins-{self.rank}", daemon=True
            )
            self._watcher.start()
        # Heartbeats (failure detection for a peer that stops without closing its connection).
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_threshold = heartbeat_interval * heartbeat_misses
        if heartbeat_interval > 0 and len(self.workers) > 1:
            self._next_tick = time.monotonic() + heartbeat_interval
            self._timer.call_later(heartbeat_interval, self._heartbeat_tick)
        DOOR_WATCH.hold()  # idle same-host links park their doorbells there (let go in _stop_threads)
        atexit.register(self._close_at_exit)

    def _connect(self, pair_store: Any, peer: int) -> tuple[PairGroup, FrameAuth | None]:
        """The pair's gloo group and same-host rings for ``peer``; with a job key, the link's frame
        MACs too, from a nonce exchange made first: the pair's entries (gloo's addresses, the
        same-host offers) are then MACed under the link's key, so none of an earlier run is taken."""
        if self._auth is None:
            return make_pair_group(pair_store, self.rank, peer), None
        try:
            link = self._auth.link(pair_store, self.rank, peer)
            return make_pair_group(link.store, self.rank, peer), link.frames
        except AuthenticationError as exc:
            raise AuthenticationError(
                f"connecting to {self.workers[peer].name!r} (rank {peer}): {exc}; nothing connected"
            ) from exc

    @property
    def links(self) -> dict[int, PeerLink]:
        """The links made so far, by peer (a snapshot: replaced, never changed in place)."""
        return self._table.links

    def reach(self, peers: Iterable[int]) -> None:
        """Make the links to ``peers`` now (see World.reach): a peer that died before any link to it
        was made is then reported, as a link's failure."""
        for peer in peers:
            if peer != self.rank:
                self._table.reach(peer)

    def link_to(self, peer: int, timeout: float) -> PeerLink:
        """The link to ``peer``, made now if need be (see LinkTable.link_to)."""
        return self._table.link_to(peer, timeout)

    def _start_link(self, link: PeerLink) -> None:
        link.start(self._pool.run_job, self._callbacks.submit)

    def _make_link(self, peer: int, pg: Any, auth: FrameAuth | None) -> PeerLink:
        link = PeerLink(
            self.rank, peer, pg, self._deliver, self._peer_failed, send_timeout=self._send_timeout, auth=auth
        )
        link.peer_name = f"'{self.workers[peer].name}' (rank {peer})"
        return link

    # -- dynamic groups (LIFE-5) -------------------------------------------------------------------
    def _watch_joins(self) -> None:
        """Connect a link to each worker that joins this dynamic group, as the joiner connects to us
        (its init_rpc waits for that, then tells our agent it joined). Ends when stop() posts ``stop``."""
        group = self._group
        assert group is not None
        while True:
            try:
                notice = group.next_notice()
            except Exception as exc:  # the store is gone (its host process left)
                _log.debug("twinrpc: rank %d stops watching for joins: %s", self.rank, exc)
                return
            if notice is None:
                return
            if self._stopped:
                continue  # the joiner's connect to us fails (bounded by its store timeout)
            if not group.joiner_went_on(notice):
                continue
            info = notice.member.info
            try:
                pg, auth = self._connect(notice.pair_store, info.id)
            except Exception as exc:
                _log.warning("twinrpc: could not connect to %s joining the group: %s", info, exc)
                continue
            with self._lock:
                self.workers = {**self.workers, info.id: info}
                link = self._make_link(info.id, pg, auth)
                self._table.add(link)
            self._start_link(link)

    # -- World interface ---------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic()

    def send(self, msg: Message) -> None:
        if self._stopped:
            return  # a worker that has left sends nothing more (twinrpc._departure)
        if self._recorder is not None:
            self._recorder.record("send", msg)
        if msg.dst == self.rank:
            # To ourselves: no network, but still a copy (the callee must not share the caller's objects).
            local = Message(msg.kind, msg.id, msg.src, msg.dst, msg.payload, copy_storages(msg.tensors))
            self._deliver(local)
            return
        link = self._table.links.get(msg.dst)
        if link is None:
            # No link yet: the message waits while it is made (or fails if it cannot be)
            link = self._table.link_or_wait(msg)
            if link is None:
                return
        if msg.deferrable and link.defer(msg, self._send_failed):
            self._flush_riders_later()
            return
        if THREAD_ROLE.no_blocking_send:
            # A one-frame message the peer has a receive posted for goes at once, or rides the frame
            # going out if the send lock is taken (most replies);
            # otherwise a receiver hands its role to an idle thread and sends itself (no outbox hop
            # on the reply's way); the timer (no link to hand off) queues on the outbox.
            try:
                if link.try_send_now(msg, self._send_failed):
                    return
            except Exception as exc:
                self._send_failed(msg, exc)
                return
            receiving = THREAD_ROLE.link
            if receiving is None or not receiving.hand_off():
                link.send_later(msg, self._send_failed)
                return
        try:
            link.send(msg, self._send_failed)  # a small message may ride a frame already going out
        except Exception as exc:
            self._send_failed(msg, exc)

    def _flush_riders_later(self) -> None:
        """Deferred messages wait RIDER_WAIT at most: one timer at a time serves every link (a timer
        per message would wake the timer thread for each, which is what deferring saves)."""
        with self._lock:
            if self._rider_timer or self._stopped:
                return
            self._rider_timer = True
        self._timer.call_later(RIDER_WAIT, self._flush_riders)

    def _flush_riders(self) -> None:
        with self._lock:
            self._rider_timer = False
        for link in self.links.values():
            link.flush_riders()

    def _send_failed(self, msg: Message, exc: BaseException) -> None:
        agent = self.agent
        if agent is not None:
            agent.on_send_failed(
                msg, agent.departure_error(msg.dst, *_departure_of(exc, self._auth is not None))
            )

    def schedule_rref_delete(self, fn: Callable[[], Any]) -> None:
        """Gather dead user RRefs' deletes for DELETE_WAIT, then send them from the timer thread. A
        delete is deferrable and so is its ack (twinrpc._rref_context): they ride the next frames
        each way, so a loop that drops an RRef per call wakes no thread per delete (a pool thread to
        send it, the owner's receiver for its frame, ours for the ack's)."""
        if self._stopped:
            raise RuntimeError("the world has stopped")  # shutdown's flush sends what is left
        with self._delete_lock:
            self._deletes.append(fn)
            first = len(self._deletes) == 1
        if first:  # else the timer is set already
            self._timer.call_later(DELETE_WAIT, self._send_deletes)

    def _send_deletes(self) -> None:
        fresh: list[Callable[[], Any]] = []
        with self._delete_lock:
            deletes, self._deletes = self._deletes, fresh
        for fn in deletes:
            try:
                fn()
            except Exception:  # one delete's failure must not keep the others
                _log.exception("twinrpc: sending a dead RRef's delete failed")

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        # On an idle pool thread (not a request slot): a task (a backward run after a fork, see
        # twinrpc._fast_engine) should not cost an OS thread of its own each time.
        self._pool.run_job(lambda: fn(*args))

    def submit(self, fn: Callable[..., Any], *args: Any, brief: bool = False) -> None:
        receiving = THREAD_ROLE.link
        if receiving is not None:
            if brief:
                # Short and never blocks (the hint): run it right here if a slot is free, and
                # stay the receiver (no other thread is woken to receive meanwhile).
                self._pool.run_inline(fn, args)
            else:
                # On a receiver: run the request right here if a slot is free, handing receiving over.
                self._pool.run_here(fn, args, receiving.hand_off)
        else:
            self._pool.submit(fn, *args)

    def reply_receiver(self, peer: int) -> Callable[[Any], None] | None:
        """A same-host link's caller receives its reply itself (Receiver.receive_until); None before
        the link exists (its first message makes it) or between hosts."""
        link = self._table.links.get(peer)
        return None if link is None else link.reply_receiver

    def call_later(self, delay: float, fn: Callable[[], Any]) -> TimerHandle:
        return self._timer.call_later(delay, fn)

    def start(self, agent: WorldEvents) -> None:
        with self._lock:
            self.agent = agent
            early, self._early = self._early, []
            failed, self._early_failures = self._early_failures, []
        for msg in early:
            agent.on_message(msg)
        for peer, departure, detail in failed:  # a peer that left before the agent started
            agent.on_peer_failed(peer, departure, detail)

    def stop(self, graceful: bool = False) -> None:
        """Close every link (peers' receivers for us stop), then stop the pool and timer and wait for
        every thread of ours to exit (_stop_threads).

        Bounded: a peer that has not closed its side within ``_CLOSE_WAIT`` (stopped, or still
        running after a non-graceful shutdown) has its link abandoned, so no thread of ours is left
        blocked in gloo."""
        if not self._mark_stopped():
            return
        atexit.unregister(self._close_at_exit)
        if graceful:
            FOLLOW_ON_EXIT.settled()
        self._stop_watching()
        self._stop_linking(graceful)
        deadline = time.monotonic() + _CLOSE_WAIT
        links = list(self.links.values())
        for link in links:
            link.closing = True
        for link in links:
            link.send_close(graceful, deadline)
        for link in links:
            if link.failed is None and not link.join(max(0.0, deadline - time.monotonic())):
                _log.debug("twinrpc: receiver for rank %d still running at shutdown", link.peer)
        for link in links:
            if not link.threads_done():
                link.abandon()  # wakes whatever still waits in gloo for this peer (joined below)
                link.join(_ABANDON_WAIT)
        self._stop_threads()
        self._release()

    def _close_at_exit(self) -> None:
        """The program exits without rpc.shutdown() (e.g. on an exception): before the interpreter
        finalizes, close every link at once and wait for our threads to leave gloo. Otherwise a
        receiver woken by the peer's next frame (a heartbeat, its close) during finalization aborts
        the process (see _stop_threads). Peers see the connection close, as when the process dies."""
        if not self._mark_stopped():
            return
        self._stop_watching()
        self._stop_linking(graceful=False)
        for link in self.links.values():
            link.close_now()
        self._stop_threads()
        self._release()

    def _release(self) -> None:
        """After stop: let go of every gloo group and, in a static group, of the store, so that gloo's
        threads and every socket of ours close now rather than at a garbage collection (the world, its
        agent and the links' parts refer to each other). A link whose threads are still running keeps
        its group. A dynamic group's store stays: its members still use it to leave."""
        for link in self.links.values():
            if link.threads_done():
                link.release()
        if self._group is None:
            self._table.release()
            self._store = None
            if self._auth is not None and not self._still_linking:
                # (a thread still making a link may still call into the job key's stores: a store
                # written in Python, released under a C++ call, aborts the process; the garbage
                # collector frees them once that thread is done)
                self._auth.release()

    def _stop_linking(self, graceful: bool) -> None:
        """No link is made from now on (peers connecting to us fail at once); the links being made
        are finished first, so that stop closes them too."""
        left = self._table.stop(graceful, _THREAD_EXIT_WAIT)
        self._still_linking = bool(left)
        if left:
            _log.warning(
                "twinrpc: %s still connecting %.0f s after RPC stopped", ", ".join(left), _THREAD_EXIT_WAIT
            )

    def _stop_watching(self) -> None:
        if self._group is not None and self._watcher is not None:
            try:
                self._group.post_stop()
            except Exception as exc:  # the store is gone; so is the watcher's wait
                _log.debug("twinrpc: could not post stop to this worker's inbox: %s", exc)
            self._watcher.join(_THREAD_EXIT_WAIT)

    def _mark_stopped(self) -> bool:
        """Stop delivering to the agent; False if the world was stopped already."""
        with self._lock:
            if self._stopped:
                return False
            self._stopped = True
            self.agent = None
        return True

    def _stop_threads(self) -> None:
        """Stop the pool and the timer, then wait for every thread of ours to exit.

        No thread of ours may outlive stop(): the world's threads are daemon threads that call into
        gloo with the GIL released, and one that returns from such a call while the interpreter
        finalizes is ended by pthread_exit, whose unwind through pybind11's GIL guard aborts the
        process ("terminate called without an active exception"). A thread still running a request
        after _THREAD_EXIT_WAIT is named in a warning."""
        self._pool.stop()
        self._timer.stop()
        deadline = time.monotonic() + _THREAD_EXIT_WAIT
        left = [
            name
            for link in self.links.values()
            for name in link.join_threads(max(0.0, deadline - time.monotonic()))
        ]
        if not self._timer.join(max(0.0, deadline - time.monotonic())):
            left.append(f"twinrpc-timer-{self.rank}")
        left += self._pool.join(max(0.0, deadline - time.monotonic()))
        if not DOOR_WATCH.let_go(max(0.0, deadline - time.monotonic())):
            left.append("twinrpc-doorwatch")
        if left:
            _log.warning(
                "twinrpc: %s still running %.0f s after RPC stopped (a request that has not returned); a process "
                "that exits while one is inside native code may abort",
                ", ".join(left),
                _THREAD_EXIT_WAIT,
            )
        if self._recorder is not None:
            self._recorder.close()

    # -- liveness ----------------------------------------------------------------------------------
    def _heartbeat_tick(self) -> None:
        """Every heartbeat interval, on the timer thread: judge each peer's silence, then queue our
        own heartbeat on every link (each link's outbox sends it; nothing here blocks)."""
        if self._stopped:
            return
        interval = self._heartbeat_interval
        now = time.monotonic()
        late = now - self._next_tick
        self._next_tick = now + interval
        self._timer.call_later(interval, self._heartbeat_tick)
        links = list(self.links.values())
        if late > self._heartbeat_threshold / 2:
            # This process itself was not running for a good part of the threshold (stopped, swapped
            # out, starved): the peers' frames are waiting unread, so their silence may be ours.
            # Start counting again rather than declare a live peer dead.
            _log.warning("twinrpc: heartbeat tick %.1f s late; restarting peer liveness counts", late)
            for link in links:
                link.restart_liveness(now)
        else:
            for link in links:
                link.check_alive(now, self._heartbeat_threshold)
        for link in links:
            link.send_heartbeat()

    # -- incoming ----------------------------------------------------------------------------------
    def _deliver(self, msg: Message) -> None:
        if self._recorder is not None:
            self._recorder.record("deliver", msg)
        agent = self.agent
        if agent is None:
            with self._lock:
                if self.agent is None and not self._stopped:
                    self._early.append(msg)
                    return
                agent = self.agent
            if agent is None:
                return  # arrived after shutdown: dropped
        agent.on_message(msg)

    def _peer_failed(self, peer: int, exc: BaseException) -> None:
        departure, detail = _departure_of(exc, self._auth is not None)
        FOLLOW_ON_EXIT.peer_failed(departure)
        agent = self.agent
        if agent is None:
            with self._lock:
                if self.agent is None and not self._stopped:
                    self._early_failures.append((peer, departure, detail))
                    return
                agent = self.agent
            if agent is None:
                return
        agent.on_peer_failed(peer, departure, detail)


#: what a broken connection may also mean with a job key: the peer refused a frame of ours and closed
#: the link (it cannot tell us so over a link it no longer trusts)
_KEYED_CLOSE = (
    "With this job's key, a worker also closes a link on which a frame failed authentication (a frame "
    "altered on the way, or sent by a process without the key): if the peer is still running, its log "
    "names the frame"
)


def _departure_of(exc: BaseException, keyed: bool) -> tuple[Departure, str]:
    """How a link's error says the peer left, with the transport's words for a crash or silence (the
    core describes a shutdown itself); ``keyed``: the job has a key, so a broken connection may be a
    peer that refused our frame."""
    if isinstance(exc, PeerShutDown):
        return (Departure.LEFT if exc.graceful else Departure.SHUT_DOWN), ""
    if isinstance(exc, PeerSilent):
        return Departure.SILENT, str(exc)
    if isinstance(exc, AuthenticationError):
        return Departure.REFUSED, str(exc)
    broken = str(link_broken(exc))  # twinrpc's words for gloo's bare errors
    return Departure.CRASHED, f"{broken}. {_KEYED_CLOSE}" if keyed else broken
