"""Liveness in virtual time: when a silent peer is declared dead, the twin of ``impl/_liveness.py``.

A gloo worker declares a peer dead when nothing (no frame, no heartbeat) came from it
for ``heartbeat_interval * heartbeat_misses`` seconds of its own options (default 1 s x 10; never
with ``heartbeat_interval=0``), and then trusts nothing it sends; the peer, no longer hearing from
it, does the same its own threshold later. The simulator models exactly that in virtual time: a
worker paused, or a link held or partitioned, for longer than the listening worker's bound
(:func:`silence_bound`: the options it passed to ``init_rpc``, the default options while it has no
agent, or ``NetworkModel.heartbeat_timeout`` for everyone when that is set) makes the listening side
declare the silent one dead. Heartbeats run over links only, as in the gloo world: a worker with
no link to the silent one (links are made on first use, simulator/_network/_link_setup.py) judges
nothing until one is made (:meth:`Liveness.link_made`). A bound is read when a silence starts, when the listener calls
``init_rpc`` (:meth:`Liveness.bound_changed`) and again when it expires.

The fault engine (``simulator/_faults/_engine.py``) says which links are silent (a pause, a hold, a
partition) and when a silence changes; this module judges the silences and carries out what the
listening side then does (declare the peer dead, close the connection, which the silent side finds
lost once the closure can reach it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from twinrpc._departure import Departure
from twinrpc.rpc.options import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_MISSES

from ._network._link_setup import linked

if TYPE_CHECKING:
    from ._parts import RunParts


@dataclass(slots=True)
class _Silence:
    since: float
    cause: str = field(default="")
    #: the listener's bound its pending check was scheduled with (None: none scheduled)
    bound: float | None = None


def silence_bound(parts: RunParts, rank: int) -> tuple[float, str]:
    """How many seconds worker ``rank`` lets a peer be silent before declaring it dead (0 = never),
    and where that bound comes from, in the words of the error it raises.

    ``NetworkModel.heartbeat_timeout`` when set (for every worker); otherwise the
    ``heartbeat_interval * heartbeat_misses`` of the options ``rank`` passed to ``init_rpc`` while its
    agent runs, and of the default options before that and after its shutdown, as in the gloo world.
    """
    override = parts.network.heartbeat_timeout
    if override is not None:
        return override, "NetworkModel.heartbeat_timeout"
    world = parts.workers[rank].world
    options = parts.heartbeat_options.get(rank) if world is not None and not world.stopped else None
    interval, misses = options or (DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_MISSES)
    default = "" if options else ", the default options"
    return (
        interval * misses if interval > 0 else 0.0,
        f"heartbeat_interval x heartbeat_misses = {interval:g} s x {misses}{default}",
    )


class Liveness:
    """Which silent peers each worker declares dead, and when (see the module docstring)."""

    def __init__(
        self,
        parts: RunParts,
        record: Callable[[int, str], None],
        is_silent: Callable[[int, int], bool],
        ends_now: Callable[[int, int], bool],
        paused_until: dict[int, float],
    ) -> None:
        self.parts = parts
        #: records a ``fault`` event of the trace on a worker
        self.record = record
        #: whether nothing from the first rank reaches the second now, and whether that ends now
        self.is_silent = is_silent
        self.ends_now = ends_now
        #: rank -> virtual time its pause ends (the fault engine's, read here)
        self.paused_until = paused_until
        #: (silent rank, listening rank) -> since when nothing from the first reaches the second
        self.silent: dict[tuple[int, int], _Silence] = {}
        #: (dead rank, observer) pairs: the observer declared the first dead and trusts nothing from it
        self.distrusted: set[tuple[int, int]] = set()
        #: (observer, dead rank) -> when the observer declared it dead and closed their connection, for
        #: closures the dead one cannot notice yet (it is paused, or the link to it is held or cut)
        self._closures: dict[tuple[int, int], float] = {}

    def silence_changed(self, pairs: list[tuple[int, int]], cause: str) -> None:
        now = self.parts.sched.now
        for pair in pairs:
            src, dst = pair
            if src == dst:
                continue
            silent = self.is_silent(src, dst)
            if silent and pair not in self.silent:
                entry = self.silent[pair] = _Silence(now, cause)
                self.watch(pair, entry)
            elif not silent:
                self.silent.pop(pair, None)

    def watch(self, pair: tuple[int, int], entry: _Silence) -> None:
        """Check the silence ``entry`` of ``pair`` once it lasts the listener's current bound (no
        check with a bound of 0; nothing new when a check with this bound is already pending)."""
        bound, _ = silence_bound(self.parts, pair[1])
        if bound == entry.bound:
            return
        entry.bound = bound
        if bound > 0:
            now = self.parts.sched.now
            delay = bound if entry.since == now else max(0.0, entry.since + bound - now)
            self.parts.sched.call_later(delay, functools.partial(self._silence_check, pair, entry, bound))

    def bound_changed(self, rank: int) -> None:
        """Worker ``rank`` called ``init_rpc``: the silences it listens to are judged by its options."""
        for pair, entry in list(self.silent.items()):
            if pair[1] == rank:
                self.watch(pair, entry)

    def _silence_check(self, pair: tuple[int, int], entry: _Silence, bound: float) -> None:
        if self.silent.get(pair) is not entry or entry.bound != bound or self.ends_now(*pair):
            return
        src, dst = pair
        if silence_bound(self.parts, dst)[0] != bound:  # the listener shut down since: default options
            self.watch(pair, entry)
            return
        self.declare_dead(dst, src, f"{entry.cause} at t={entry.since:g}s")

    def declare_dead(self, observer: int, dead: int, why: str) -> None:
        """``observer`` declares ``dead`` dead, as the gloo world does after heartbeat silence (of
        ``observer``'s :func:`silence_bound`)."""
        parts = self.parts
        if (
            observer in parts.crashes.crashed
            or dead in parts.crashes.crashed
            or (dead, observer) in self.distrusted
        ):
            return
        world = parts.workers[observer].world
        if world is None or world.stopped or not linked(world, dead):
            # heartbeats run over links only: judged again if a link is made (link_made)
            entry = self.silent.get((dead, observer))
            if entry is not None:
                entry.bound = None
            return
        self.distrusted.add((dead, observer))
        bound, limit = silence_bound(parts, observer)
        self.record(
            observer,
            f"worker {observer} declares worker {dead} dead: nothing from it for {bound:g} s ({why})",
        )
        parts.stop_monitors(
            f"worker {observer} declared worker {dead} dead (nothing from it for {bound:g} s; {why})"
        )
        self._tell(
            observer,
            dead,
            Departure.SILENT,
            f"no frame or heartbeat from it for more than {bound:g} s of simulated time (limit: {limit}; "
            f"{why}); its process is stopped, hung or cut off from this one",
        )
        # The observer fails its link, which closes the pair's connection (gloo's PeerLink.abandon):
        # the dead one finds the connection lost as soon as the closure can reach it, heartbeats or not.
        self._closures[(observer, dead)] = parts.sched.now
        self.notice_closure(observer, dead)

    def link_made(self, rank: int, peer: int) -> None:
        """``rank`` and ``peer`` are linked now: heartbeats run over the link from now on, so a
        silence between them is judged (at once if it already lasted a bound)."""
        for pair in ((rank, peer), (peer, rank)):
            entry = self.silent.get(pair)
            if entry is not None:
                self.watch(pair, entry)

    def notice_closure(self, observer: int, dead: int) -> None:
        """Let ``dead`` notice that ``observer`` closed their connection, unless it cannot yet: it is
        paused, or the link from ``observer`` is held or cut (then its resume, or the link's healing,
        calls this again)."""
        declared_at = self._closures.get((observer, dead))
        if declared_at is None or self.is_silent(observer, dead) or dead in self.paused_until:
            return
        del self._closures[(observer, dead)]
        self.parts.sched.call_later(
            self.parts.network.failure_detection,
            lambda: self._connection_closed_by(observer, dead, declared_at),
        )

    def _connection_closed_by(self, observer: int, dead: int, declared_at: float) -> None:
        """``dead`` (alive after all) finds its connection to ``observer`` closed: to it, ``observer``
        is gone as a crashed worker is."""
        parts = self.parts
        if (
            observer in parts.crashes.crashed
            or dead in parts.crashes.crashed
            or (observer, dead) in self.distrusted
        ):
            return
        self.distrusted.add((observer, dead))
        self.record(dead, f"worker {dead} finds its connection to worker {observer} closed")
        self._tell(
            dead,
            observer,
            Departure.CRASHED,
            f"connection lost (closed by the peer, which declared this worker dead at t={declared_at:g} s)",
        )

    def _tell(self, rank: int, peer: int, departure: Departure, detail: str) -> None:
        """Worker ``rank``, if still running RPC, learns that ``peer`` departed."""
        world = self.parts.workers[rank].world
        if world is not None and not world.stopped:
            self.parts.crashes.peer_unavailable(world, rank, peer, departure, detail)
