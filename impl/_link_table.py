"""Links made on first use: a static group's ``init_rpc`` agrees on names and ranks only, and the link
to a peer is made when either side first sends to the other (or both at once).

The store's part (:class:`PairAsks`), under the generation's ``twinrpc/<n>/`` prefix and, with a job
key, MACed under the run key (impl/_auth.py, ``JobAuth.run``), so that no entry of an earlier run is
acted on:

* ``ask/<rank>/<n>``: worker ``rank``'s inbox; a worker that wants a link to it posts its own rank
  there, and ``rank``'s watcher thread (one per process) then connects too. ``stop`` ends the watcher.
* ``pair/<low>-<high>/here/<rank>``: ``rank`` is connecting the pair; each side waits for the other's
  before the pair's nonce exchange and gloo group (``JobAuth.link``, ``make_pair_group``), which use
  the same deterministic keys whoever started, so two sides that start at once make one link.
* ``vouched/<challenge>/<rank>``: ``rank``'s answer to ``vouch <challenge>`` in its inbox, posted by
  a dynamic group's worker that found this group's ``kind`` entry (impl/_group_kind.py).
* ``gone/<rank>``: ``rank``'s world stopped (``graceful`` or ``abrupt``); a worker connecting to it
  then fails at once, as if the peer's close frame had come.
* ``proc/<rank>``: ``rank``'s host and process (``announce``), so that a worker on the same host can
  tell a slow peer from a stopped one (impl/_peer_process.py).

A peer that answers nothing (its process died, or is stopped) fails the connection after the liveness
bound, as a silent link does: the messages waiting for the link fail with ``WorkerUnavailableError``,
never hang. A peer on this host whose process still runs is waited for however long it takes: with
many workers on few cores, its answer may wait seconds for a core.

:class:`LinkTable` holds the links and the messages waiting for one, and connects the pairs on two
small sets of short-lived threads (``MAKERS`` each), so that a burst of asks (every worker of a
large job calling one at once) costs a few threads, not one per peer. Pairs wait on each other, so
one set for all could wait in a cycle (each of a ring of workers asking the next, with no thread
left to answer); instead one set *asks* (connects a pair this worker wants) and the other *answers*
(connects a pair a peer asked for). An answer waits only for the peer's asking thread, which is on
that very pair already, so answers always finish; and asks wait only for answers.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from twinrpc._errors import AuthenticationError
from twinrpc._message import Message

from ._link import PeerLink, PeerShutDown, PeerSilent
from ._peer_process import PeerProcess, Verdict
from ._same_host import host_identity
from ._stores import WrappedStore

_log = logging.getLogger("twinrpc.impl")

#: polling for the peer's answer: first and longest pause between two looks at the store
_POLL_FIRST = 0.001
_POLL_MAX = 0.1
#: threads connecting pairs at once, for each of asking and answering (see the module docstring)
MAKERS = 4
#: the watcher's longest pause between two looks at its inbox: what an ask to an idle worker may
#: wait before it is read, and 10 small store requests a second per idle process
_WATCH_MAX = 0.1


def pair_key(a: int, b: int) -> str:
    """The prefix of a pair's keys (the lower rank first), as ``make_pair_group`` and ``JobAuth.link``."""
    return f"pair/{min(a, b)}-{max(a, b)}"


class PolledWaits(WrappedStore):
    """The store a pair is made over: a read of a key not written yet waits by looking at the store
    (``check``) until it is there, instead of blocking in the store. A TCPStore client serves one
    request at a time, so a pair's gloo group waiting for its peer's address would hold the process's
    connection: pairs made at once around a ring of workers would then wait on each other in a cycle
    (each peer's own connection held by its next pair) until the store's timeout."""

    def __init__(self, inner: Any, timeout: timedelta, stopping: threading.Event) -> None:
        super().__init__(inner)
        self._seconds = timeout.total_seconds()
        #: set when this worker's world stops: a wait then ends at once (LinkStopped)
        self._stopping = stopping

    def _await(self, keys: list[str], timeout: timedelta | None) -> None:
        seconds = self._seconds if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + seconds
        pause = _POLL_FIRST
        while not self._inner.check(keys):
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"Wait timeout after {seconds:g} s for keys {keys} (the peer did not connect)"
                )
            if self._stopping.wait(pause):
                raise LinkStopped("this worker's RPC stopped while connecting")
            pause = min(pause * 2, _POLL_MAX)

    def get(self, key: str) -> bytes:
        self._await([key], None)
        return super().get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(keys, timeout)


class LinkStopped(RuntimeError):
    """This worker's world stopped while a link was being made."""


class PairAsks:
    """One worker's use of the store's link keys (see the module docstring). ``store``: the run's
    store (MACed under the run key with a job key). Thread safety: ``ask``, ``here`` and
    ``wait_for`` on any thread; ``next_ask`` on the watcher only.

    Every use shares the process's one connection to the store: none blocks in it, and no worker
    opens a second one. A TCPStore server (PyTorch's libuv one, e.g. torchrun's) looks up the
    host name of each connection it accepts on its only thread (a reverse DNS query); a query the
    resolver gets no answer to stalls every client of the store for the resolver's timeout (5 s by
    default), so each connection a worker opens is one more chance of stalling the whole job's
    ``init_rpc`` (docs/explanation/gloo-world.md)."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store = store
        self._rank = rank
        self._next = 1

    def ask(self, peer: int) -> None:
        """Ask ``peer`` to connect to this worker (its watcher reads it)."""
        post_ask(self._store, peer, str(self._rank))

    def here(self, peer: int) -> None:
        """Tell ``peer`` this worker is connecting their pair."""
        self._store.set(f"{pair_key(self._rank, peer)}/here/{self._rank}", "1")

    def wait_for(self, peer: int, seconds: float, stopping: threading.Event) -> None:
        """Wait until ``peer`` connects the pair too. Looks at the store without blocking in it (the
        connection is shared), every millisecond at first, then backing off to 0.1 s.

        Raises:
            PeerShutDown: the peer's world has stopped.
            PeerSilent: no answer within ``seconds``: its process died or is stopped (a peer whose
                process runs on this host is waited for: it is slow, see ``_runs_here``).
            LinkStopped: this worker's world stopped meanwhile.
            AuthenticationError: the peer's entry is not of this run.
        """
        here = f"{pair_key(self._rank, peer)}/here/{peer}"
        gone = f"gone/{peer}"
        deadline = time.monotonic() + seconds
        pause = _POLL_FIRST
        while True:
            if self._store.check([here]):
                self._store.get(here)  # with a job key: raises unless written in this run
                return
            if self._store.check([gone]):
                raise PeerShutDown(self._store.get(gone) == b"graceful")
            if time.monotonic() >= deadline:
                if self._runs_here(peer):  # slow, not dead: wait on, and look again after as long
                    deadline = time.monotonic() + seconds
                    continue
                raise PeerSilent(
                    f"it did not answer this worker's connection within {seconds:g} s (its process "
                    "died, or is stopped or cut off)"
                )
            if stopping.wait(pause):
                raise LinkStopped("this worker's RPC stopped while connecting")
            pause = min(pause * 2, _POLL_MAX)

    def announce(self) -> None:
        """Tell the workers on this host which process this worker is (see ``_runs_here``)."""
        process = PeerProcess.me()
        if process is not None:
            self._store.set(f"proc/{self._rank}", host_identity() + b"\n" + process.encode().encode())

    def _runs_here(self, peer: int) -> bool:
        """Whether ``peer``'s process is known to run on this host, not stopped (see ``announce``)."""
        key = f"proc/{peer}"
        if not self._store.check([key]):
            return False
        host, _, process = self._store.get(key).partition(b"\n")
        found = PeerProcess.decode(process.decode(errors="replace"))
        return host == host_identity() and found is not None and found.verdict() is Verdict.ALIVE

    def leave(self, graceful: bool) -> None:
        """This worker's world stops: connections to it fail from now on, and its watcher ends."""
        self._store.set(f"gone/{self._rank}", "graceful" if graceful else "abrupt")
        n = int(self._store.add(f"ask/{self._rank}/count", 1))
        self._store.set(f"ask/{self._rank}/{n}", "stop")

    def next_ask(self, stopping: threading.Event) -> int | None:
        """Wait for the next inbox entry: the rank that asks, or None for ``stop`` or once
        ``stopping`` is set. Looks at the store without blocking in it (see the class): every
        millisecond after an entry, backing off to ``_WATCH_MAX`` while none comes. An entry that
        is not of this run (with a job key) is logged and skipped."""
        pause = _POLL_FIRST
        while True:
            key = f"ask/{self._rank}/{self._next}"
            if not self._store.check([key]):
                if stopping.wait(pause):
                    return None
                pause = min(pause * 2, _WATCH_MAX)
                continue
            self._next += 1
            pause = _POLL_FIRST
            try:
                entry = self._store.get(key).decode()
            except AuthenticationError as exc:
                _log.error("twinrpc: %s; skipped", exc)
                continue
            if not entry.startswith("vouch "):
                return None if entry == "stop" else int(entry)
            # a dynamic group's worker found this group's 'kind' entry: a live worker says so
            self._store.set(f"vouched/{entry.removeprefix('vouch ')}/{self._rank}", "static")


def post_ask(store: Any, peer: int, entry: str) -> None:
    """Post ``entry`` to ``peer``'s inbox in the run's ``store`` (its watcher reads it: next_ask)."""
    n = int(store.add(f"ask/{peer}/count", 1))
    store.set(f"ask/{peer}/{n}", entry)


class LinkTable:
    """A world's links, made on first use (see the module docstring). Thread-safe.

    ``make(peer)`` makes the link once both sides are connecting (the nonce exchange and the pair's
    gloo group; milliseconds); ``start(link)`` starts its threads; ``failed(peer, exc)`` reports a
    peer no link could be made to; ``send_failed(msg, exc)`` fails a message that waited for it.
    ``asks`` is None when every link is made up front (a dynamic group: ``add``)."""

    def __init__(
        self,
        rank: int,
        asks: PairAsks | None,
        make: Callable[[int], PeerLink],
        start: Callable[[PeerLink], None],
        failed: Callable[[int, BaseException], None],
        send_failed: Callable[[Message, BaseException], None],
        silence: float,
    ) -> None:
        self._rank = rank
        self._asks = asks
        self._make = make
        self._start = start
        self._failed = failed
        self._send_failed = send_failed
        self._silence = silence
        #: guards what follows; notified when a link is made or given up (link_to)
        self._lock = threading.Condition()
        #: replaced, never changed in place (readers iterate without the lock)
        self.links: dict[int, PeerLink] = {}
        #: peers being connected to, with the messages waiting for the link, in order
        self._waiting: dict[int, list[Message]] = {}
        #: peers no link could be made to, and why (later sends fail at once with it)
        self._unreachable: dict[int, BaseException] = {}
        #: peers being connected to or queued for it, by whether we ask (else answer their ask)
        self._connecting: dict[int, bool] = {}
        #: peers queued for a maker thread, asks and answers apart (see the module docstring)
        self._queued: dict[bool, collections.deque[int]] = {
            True: collections.deque(),
            False: collections.deque(),
        }
        #: maker threads running, asks and answers apart
        self._makers: dict[bool, list[threading.Thread]] = {True: [], False: []}
        self._maker_ids = itertools.count()
        #: set once this world stops: links being made give up (their waits in the store end)
        self.stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- links -------------------------------------------------------------------------------------
    def add(self, link: PeerLink) -> None:
        """A link made elsewhere (a dynamic group's, connected at join); the caller starts it."""
        with self._lock:
            self.links = {**self.links, link.peer: link}

    def link_or_wait(self, msg: Message) -> PeerLink | None:
        """The link to ``msg.dst``; None once ``msg`` waits for it (being made now) or has failed."""
        peer = msg.dst
        with self._lock:
            link = self.links.get(peer)
            if link is not None:
                return link
            error = self._unreachable.get(peer)
            if error is None:
                if self._asks is None or self.stopping.is_set():
                    # a dynamic group's member that stopped before this worker joined, or we stop
                    error = PeerShutDown(graceful=False)
                else:
                    self._waiting.setdefault(peer, []).append(msg)
                    self._connect(peer, asking=True)
                    return None
        self._send_failed(msg, error)
        return None

    def reach(self, peer: int, *, asking: bool = True) -> None:
        """Make the link to ``peer`` now unless one exists or is being made (``asking``: tell the peer
        to connect too; False when answering its ask)."""
        with self._lock:
            if peer in self.links or peer in self._unreachable or self._asks is None:
                return
            if not self.stopping.is_set():
                self._connect(peer, asking)

    def link_to(self, peer: int, timeout: float) -> PeerLink:
        """The link to ``peer``, made now if there is none (for tools and tests that need it before
        any message).

        Raises:
            BaseException: why it could not be made (as reported to the agent).
            TimeoutError: it was not made within ``timeout`` seconds.
        """
        self.reach(peer)
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                link = self.links.get(peer)
                if link is not None:
                    return link
                error = self._unreachable.get(peer)
                if error is not None:
                    raise error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no link to rank {peer} within {timeout:g} s")
                self._lock.wait(left)

    def _connect(self, peer: int, asking: bool) -> None:
        """Under the lock: queue ``peer`` for a maker thread (see the module docstring), unless under
        way. A peer queued to be asked that asks us meanwhile moves to the answers: it waits for us."""
        queued = self._connecting.get(peer)
        if queued is not None:
            if queued and not asking and peer in self._queued[True]:
                self._queued[True].remove(peer)
                self._enqueue(peer, asking=False)
            return
        self._waiting.setdefault(peer, [])
        self._enqueue(peer, asking)

    def _enqueue(self, peer: int, asking: bool) -> None:
        """Under the lock: ``peer`` waits for a maker thread of its kind; start one if fewer than
        MAKERS run."""
        self._connecting[peer] = asking
        self._queued[asking].append(peer)
        makers = self._makers[asking]
        if len(makers) < MAKERS:
            kind = "connect" if asking else "answer"
            thread = threading.Thread(
                target=self._make_links,
                args=(asking,),
                name=f"twinrpc-{kind}-{self._rank}-{next(self._maker_ids)}",
                daemon=True,
            )
            makers.append(thread)
            thread.start()

    def _make_links(self, asking: bool) -> None:
        """A maker thread: connect the queued peers of its kind, one at a time; exit when none is left."""
        me = threading.current_thread()
        while True:
            with self._lock:
                queue = self._queued[asking]
                if not queue:
                    self._makers[asking].remove(me)
                    return
                peer = queue.popleft()
            if self.stopping.is_set():
                self._give_up(peer, LinkStopped("this worker's RPC stopped while connecting"))
            else:
                self._connect_peer(peer, asking)

    def _connect_peer(self, peer: int, asking: bool) -> None:
        asks = self._asks
        try:
            if asks is None:
                raise LinkStopped("this worker's RPC has stopped")
            asks.here(peer)
            if asking:
                asks.ask(peer)
            asks.wait_for(peer, self._silence, self.stopping)
            link = self._make(peer)
        except BaseException as exc:
            self._give_up(peer, exc)
            return
        self._start(link)
        with self._lock:
            # What waited goes first, in order, before any later send (which queues behind them and
            # finds the link from now on); this thread sends them (no outbox thread started for it).
            for msg in self._waiting.pop(peer, []):
                link.sender.enqueue(msg, self._send_failed)
            self.links = {**self.links, peer: link}
            self._connecting.pop(peer, None)
            self._lock.notify_all()
        link.sender.flush()

    def _give_up(self, peer: int, exc: BaseException) -> None:
        with self._lock:
            waiting = self._waiting.pop(peer, [])
            self._unreachable[peer] = exc
            self._connecting.pop(peer, None)
            self._lock.notify_all()
        if isinstance(exc, LinkStopped):
            return  # nothing is reported after stop
        _log.debug("twinrpc: rank %d could not connect to rank %d: %s", self._rank, peer, exc)
        self._failed(peer, exc)
        for msg in waiting:
            self._send_failed(msg, exc)

    # -- the watcher -------------------------------------------------------------------------------
    def watch(self) -> None:
        """Start the thread that answers peers' asks (none without ``asks``)."""
        if self._asks is None:
            return
        self._asks.announce()
        self._watcher = threading.Thread(target=self._watch, name=f"twinrpc-asks-{self._rank}", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        asks = self._asks
        assert asks is not None
        while True:
            try:
                peer = asks.next_ask(self.stopping)
            except Exception as exc:  # the store is gone (its host process left)
                _log.debug("twinrpc: rank %d stops answering link asks: %s", self._rank, exc)
                return
            if peer is None:
                return
            self.reach(peer, asking=False)

    def release(self) -> None:
        """After stop: let go of the store (no link is made any more; see GlooWorld._release)."""
        self._asks = None
        self._make = _stopped

    def stop(self, graceful: bool, timeout: float) -> list[str]:
        """No link is made from now on: tell the store (connections to us fail at once), end the
        watcher and wait up to ``timeout`` for the connections under way (a peer that answered
        makes its link in milliseconds; the others give up now). The names of threads still running."""
        self.stopping.set()
        deadline = time.monotonic() + timeout
        if self._asks is not None:
            try:
                self._asks.leave(graceful)
            except Exception as exc:  # the store is gone; so is the watcher's wait
                _log.debug("twinrpc: rank %d could not post its leaving: %s", self._rank, exc)
        with self._lock:
            threads = [*self._makers[True], *self._makers[False]]
        if self._watcher is not None:
            threads.append(self._watcher)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]


def _stopped(peer: int) -> PeerLink:
    """What makes a link once the table is released: nothing."""
    raise LinkStopped("this worker's RPC has stopped")
