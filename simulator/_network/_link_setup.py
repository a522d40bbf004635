"""Links made on first use in virtual time, the twin of ``impl/_link_table.py``.

A static group's ``init_rpc`` agrees on names and ranks only; the link between two workers is made
when either first sends to the other (or the shutdown leader reaches its followers, ``World.reach``).
Setting a link up costs :data:`LINK_SETUP_ROUND_TRIPS` store round trips (each twice the network
model's ``latency``), during which the messages for the peer wait, in order; two sides that start at
once make one link. The trace shows each set-up (``link`` when it starts, ``link-up`` when made).

What the store tells a worker setting a link up, as in the gloo world:

* the peer's world has stopped: the set-up fails at once with the peer's departure (its shutdown was
  written to the store, not sent over a link that never existed);
* the peer crashed (or never answers): the set-up fails once the worker's liveness bound
  (``heartbeat_interval * heartbeat_misses``, :func:`silence_bound`) has passed since it started, with
  ``Departure.SILENT``; with no bound (``heartbeat_interval=0``) it waits.

Only existing links carry news of a crash or a shutdown (simulator/_crashes.py asks :func:`linked`):
a worker with no link to a crashed peer learns of it only when it tries to make one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from twinrpc._departure import Departure

if TYPE_CHECKING:
    from twinrpc._message import Message

    from .._kernel._scheduler import Scheduler
    from .._model._network import NetworkModel
    from .._traces._trace import Trace
    from .._world import SimWorker, SimWorld

#: the store round trips of a pair's set-up: this side's "here", the ask, the look for the peer's
#: "here", and the pair's nonce exchange and gloo group (impl/_link_table.py)
LINK_SETUP_ROUND_TRIPS = 4


def linked(world: SimWorld, peer: int) -> bool:
    """Whether ``world`` has a link to ``peer``: made by a send or a reach, or, in a dynamic group,
    made when the members joined (every member connects at join)."""
    return peer == world.rank or world.membership is not None or peer in world.links


class LinkSetup:
    """Makes the links of one simulation (see the module docstring).

    Args:
        sched: the simulation's scheduler.
        trace: its trace (set-ups are recorded).
        network: its network model (``latency``: a store round trip is twice it).
        workers: its workers, by rank.
        crashed: rank -> time of its crash, shared with the simulation's crashes.
        bound: rank -> its liveness bound in seconds (0: none) and the words for where it comes from.
        unavailable: tells a world that a peer departed (``Crashes.peer_unavailable``).
        made: two ranks are linked now (their heartbeats start: ``Liveness.link_made``).
    """

    def __init__(
        self,
        sched: Scheduler,
        trace: Trace,
        network: NetworkModel,
        workers: list[SimWorker],
        crashed: dict[int, float],
        bound: Callable[[int], tuple[float, str]],
        unavailable: Callable[[SimWorld, int, int, Departure, str], None],
        made: Callable[[int, int], None],
    ) -> None:
        self.sched = sched
        self.trace = trace
        self.network = network
        self.workers = workers
        self.crashed = crashed
        self.bound = bound
        self.unavailable = unavailable
        self.made = made

    def cost(self) -> float:
        """Virtual seconds a set-up takes when the peer answers."""
        return LINK_SETUP_ROUND_TRIPS * 2 * self.network.latency

    def send(self, world: SimWorld, msg: Message) -> None:
        """``msg`` waits for the link to its destination, which is made now unless under way."""
        self.reach(world, msg.dst).append(msg)

    def reach(self, world: SimWorld, peer: int) -> list[Message]:
        """Start making ``world``'s link to ``peer`` unless under way; the messages waiting for it."""
        waiting = world.connecting.get(peer)
        if waiting is not None:
            return waiting
        waiting = world.connecting[peer] = []
        now = self.sched.now
        self.trace.record(now, world.rank, "link", f"rank {world.rank} sets up its link to rank {peer}")
        self.sched.call_later(self.cost(), functools.partial(self._answered, world, peer, now))
        return waiting

    def _answered(self, world: SimWorld, peer: int, started: float) -> None:
        """The set-up's store round trips are done: the link is made, or the store says why not."""
        if world.stopped or world.worker.crashed or world is not self.workers[world.rank].world:
            world.connecting.pop(peer, None)  # this world stopped meanwhile: nothing is reported
            return
        target = self.workers[peer].world
        if peer in self.crashed or target is None:
            bound, limit = self.bound(world.rank)
            if bound > 0:  # the peer never answers: given up once the liveness bound has passed
                delay = max(0.0, started + bound - self.sched.now)
                self.sched.call_later(delay, functools.partial(self._silent, world, peer, bound, limit))
            return
        if target.stopped:  # its shutdown is in the store: the set-up fails at once
            self._fail(world, peer, target.departure or Departure.SHUT_DOWN, "")
            return
        if peer not in world.links:
            world.links.add(peer)
            target.links.add(world.rank)
            self.trace.record(self.sched.now, world.rank, "link-up", f"rank {world.rank} <-> rank {peer}")
            self.made(world.rank, peer)
            _flush(target, world.rank)  # both sides started: one link, for both
        _flush(world, peer)

    def _silent(self, world: SimWorld, peer: int, bound: float, limit: str) -> None:
        if world.stopped or world.worker.crashed or world is not self.workers[world.rank].world:
            return
        self._fail(
            world,
            peer,
            Departure.SILENT,
            f"it did not answer this worker's connection within {bound:g} s of simulated time (limit: "
            f"{limit}); its process died, or is stopped or cut off",
        )

    def _fail(self, world: SimWorld, peer: int, departure: Departure, detail: str) -> None:
        """No link to ``peer`` can be made: ``world`` learns it departed; what waited fails."""
        waiting = world.connecting.pop(peer, [])
        self.unavailable(world, world.rank, peer, departure, detail)
        for msg in waiting:
            world.fail_send(msg, departure, detail)


def _flush(world: SimWorld, peer: int) -> None:
    """``world``'s link to ``peer`` is made: what waited for it goes first, in order."""
    if world.connecting.get(peer):  # sent by a task of its own, which takes what waits by then
        world.worker.spawn("link-up", world.send_waiting, peer)
    else:
        world.connecting.pop(peer, None)
