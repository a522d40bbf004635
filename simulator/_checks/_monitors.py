"""Online monitors: RRef protocol invariants checked at every RRef event of a simulation.

The simulation sees every worker at once, so it can check what no single worker can: the monitor is
told by each worker's RRef context (``twinrpc._rref_context.RRefObserver``) when users are created,
forked and deleted, when owners learn of forks and deletions, and when owners drop values. The
moment an invariant breaks, the run fails with a :class:`MonitorViolation` naming the requirement,
the RRef, the workers and the virtual time (the scheduler raises it before the next event).

Invariants (requirement IDs from spec/rref.md and spec/shutdown.md):

- ``RREF-D1`` (owner value freed while a user exists): an owner never drops a value while a user RRef
  of it is alive anywhere or a fork of it is still in flight; no user is ever created for a value
  its owner already dropped.
- ``RREF-F1`` (G2): a user RRef that forked a child is not deleted before the owner knows the child.
- ``RREF-D1`` (G1): a user RRef dies only through a deletion notice to its owner (unless it timed
  out or RPC was already shut down), and after a graceful shutdown every owner has heard every
  deletion sent to it.
- ``SHUT-1`` (no leaks): after a graceful shutdown an owner has no fork left, except the forks of
  ``remote()`` calls that timed out (PyTorch leaks those too, ERR-5).

Each generation of groups (a worker's k-th ``init_rpc`` joins generation k, ``simulator/_rendezvous.py``)
is checked on its own: a worker that shuts RPC down and initialises it again numbers its RRefs from
the start again, so the same ids name other RRefs in the next generation, and an RRef of the previous
one that dies later is still that generation's.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from twinrpc._rref import GloballyUniqueId, OwnerState, UserState

from .._errors import MonitorViolation

if TYPE_CHECKING:
    from .._kernel._scheduler import Scheduler
    from .._traces._trace import Trace

_Key = tuple[GloballyUniqueId, GloballyUniqueId]  # (rref id, fork id)


class RRefMonitor:
    """The RRef monitors of one simulation (``Simulation(monitors=True)``, the default): one
    ``GenerationMonitor`` per generation of groups, reporting here."""

    def __init__(self, sched: Scheduler, trace: Trace) -> None:
        self.sched = sched
        self.trace = trace
        self.violations: list[MonitorViolation] = []
        self.events = 0
        #: why checking stopped (a worker crashed: the invariants assume no worker dies), or None
        self.stopped: str | None = None
        self._generations: dict[int, GenerationMonitor] = {}

    def generation(self, generation: int) -> GenerationMonitor:
        """The monitor of the RRefs of generation ``generation``'s groups (what its workers report to)."""
        monitor = self._generations.get(generation)
        if monitor is None:
            monitor = self._generations[generation] = GenerationMonitor(self)
        return monitor

    def stop(self, why: str) -> None:
        """Stop checking for the rest of the run (``Simulation.crash``); recorded in the trace."""
        if self.stopped is None:
            self.stopped = why
            for monitor in self._generations.values():
                monitor.forget_users()  # no G1 reports for users that die with a crashed worker
            self.trace.record(self.sched.now, -1, "monitors-off", why)

    def fail(self, requirement: str, invariant: str, message: str) -> None:
        """Report a violation (nothing once stopped); the scheduler raises the first one."""
        if self.stopped is not None:
            return
        violation = MonitorViolation(requirement, invariant, self.sched.now, message)
        self.violations.append(violation)
        self.trace.record(self.sched.now, -1, "violation", str(violation))
        if self.sched.failure is None:
            self.sched.failure = violation


class GenerationMonitor:
    """The RRef invariants of one generation's groups: the ``RRefObserver`` of their workers."""

    def __init__(self, monitor: RRefMonitor) -> None:
        self.monitor = monitor
        self._users: dict[GloballyUniqueId, dict[GloballyUniqueId, int]] = {}  # rref -> fork -> rank
        # rref -> forks its owner has registered or received (indexed by rref: an owner dropping its
        # value forgets them in O(its forks), not O(every fork of the run))
        self._known: dict[GloballyUniqueId, set[GloballyUniqueId]] = {}
        self._children: dict[_Key, set[GloballyUniqueId]] = {}  # parent -> children not yet known
        self._parent_of: dict[_Key, _Key] = {}  # child -> parent, while the child is not yet known
        self._in_flight: dict[GloballyUniqueId, set[GloballyUniqueId]] = {}  # rref -> forked children
        self._deleting: dict[_Key, tuple[int, int]] = {}  # delete sent, not heard: (user rank, owner)
        self._dead: set[_Key] = set()  # users whose death was reported
        self._timed_out: set[_Key] = set()
        self._freed: dict[GloballyUniqueId, int] = {}  # rref -> the owner rank that dropped it
        self._refs: dict[_Key, weakref.ref[UserState]] = {}

    def forget_users(self) -> None:
        """Stop watching the user RRefs' lives (the monitors stopped)."""
        self._refs.clear()

    def _fail(self, requirement: str, invariant: str, message: str) -> None:
        self.monitor.fail(requirement, invariant, message)

    # -- events (RRefObserver) -----------------------------------------------------------------
    def user_created(self, rank: int, state: UserState) -> None:
        self.monitor.events += 1
        rid, fid = state.rref_id, state.fork_id
        if rid in self._freed:
            self._fail(
                "RREF-D1",
                "owner-free",
                f"worker {rank} received user fork {fid} of {rid}, whose owner (worker "
                f"{self._freed[rid]}) already dropped the value",
            )
        self._users.setdefault(rid, {})[fid] = rank
        key = (rid, fid)

        def gone(_ref: weakref.ref[UserState]) -> None:
            self._user_gone(key, rank)

        self._refs[key] = weakref.ref(state, gone)
        children = self._in_flight.get(rid)
        if children is not None:
            children.discard(fid)

    def user_confirmed(self, rank: int, state: UserState) -> None:
        """Nothing to check: the owner's side (``fork_known``) carries the invariant."""

    def _user_gone(self, key: _Key, rank: int) -> None:
        self._refs.pop(key, None)
        if key not in self._dead:
            self._fail(
                "RREF-D1",
                "G1",
                f"user fork {key[1]} of {key[0]} on worker {rank} was garbage collected without "
                "notifying its owner",
            )
        self._dead.discard(key)

    def user_deleted(self, rank: int, state: UserState, notified: bool) -> None:
        self.monitor.events += 1
        rid, fid = state.rref_id, state.fork_id
        key = (rid, fid)
        if key in self._dead:
            return  # reported already (a remote() that timed out, then garbage collected)
        self._dead.add(key)
        users = self._users.get(rid)
        if users is not None:
            users.pop(fid, None)
            if not users:
                del self._users[rid]
        if state.timed_out:
            self._timed_out.add(key)
        unknown = self._children.pop(key, set())
        for child in unknown:
            self._parent_of.pop((rid, child), None)
        if unknown:
            self._fail(
                "RREF-F1",
                "G2",
                f"user fork {fid} of {rid} on worker {rank} was deleted before its owner (worker "
                f"{state.owner}) confirmed its child fork(s) {sorted(unknown)}",
            )
        if notified:
            self._deleting[key] = (rank, state.owner)

    def child_forked(self, rank: int, parent: UserState, child_fork_id: GloballyUniqueId) -> None:
        self.monitor.events += 1
        parent_key = (parent.rref_id, parent.fork_id)
        self._children.setdefault(parent_key, set()).add(child_fork_id)
        self._parent_of[(parent.rref_id, child_fork_id)] = parent_key
        self._in_flight.setdefault(parent.rref_id, set()).add(child_fork_id)

    def fork_known(self, rank: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        self.monitor.events += 1
        self._known.setdefault(rref_id, set()).add(fork_id)
        self._child_settled(rref_id, fork_id)  # e.g. a phantom fork reached the owner

    def fork_abandoned(self, rank: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        """A fork was undone before its message left (pickling the message failed): no child is
        pending any more, and the owner no longer counts it."""
        self.monitor.events += 1
        self._child_settled(rref_id, fork_id)
        known = self._known.get(rref_id)
        if known is not None:
            known.discard(fork_id)

    def _child_settled(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        """The fork is no longer a child its parent must wait for, nor in flight."""
        parent = self._parent_of.pop((rref_id, fork_id), None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(fork_id)
        children = self._in_flight.get(rref_id)
        if children is not None:
            children.discard(fork_id)

    def delete_heard(self, rank: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        self.monitor.events += 1
        key = (rref_id, fork_id)
        self._deleting.pop(key, None)
        known = self._known.get(rref_id)
        if known is not None:
            known.discard(fork_id)
            if not known:
                del self._known[rref_id]

    def owner_registered(self, rank: int, state: OwnerState) -> None:
        self.monitor.events += 1
        self._freed.pop(state.rref_id, None)

    def owner_dropped(self, rank: int, state: OwnerState) -> None:
        self.monitor.events += 1
        rid = state.rref_id
        users = self._users.get(rid, {})
        live = {f: r for f, r in users.items() if (rid, f) not in self._timed_out}
        if live:
            where = ", ".join(f"fork {f} on worker {r}" for f, r in sorted(live.items()))
            self._fail(
                "RREF-D1",
                "owner-free",
                f"owner worker {rank} dropped the value of {rid} while users are alive: {where}",
            )
        in_flight = self._in_flight.pop(rid, set())
        if in_flight:
            self._fail(
                "RREF-D1",
                "owner-free",
                f"owner worker {rank} dropped the value of {rid} while forks {sorted(in_flight)} of it are "
                "still in flight",
            )
        self._freed[rid] = rank
        self._known.pop(rid, None)

    def closed(
        self, rank: int, graceful: bool, leaks: list[tuple[GloballyUniqueId, list[GloballyUniqueId]]]
    ) -> None:
        self.monitor.events += 1
        if not graceful:
            return
        unheard = sorted((k, src) for k, (src, owner) in self._deleting.items() if owner == rank)
        if unheard:
            where = ", ".join(f"fork {k[1]} of {k[0]} (from worker {src})" for k, src in unheard)
            self._fail(
                "RREF-D1",
                "G1",
                f"owner worker {rank} finished a graceful shutdown without hearing the deletion of {where}",
            )
        leaks = [(rid, [f for f in forks if (rid, f) not in self._timed_out]) for rid, forks in leaks]
        leaks = [(rid, forks) for rid, forks in leaks if forks]
        if leaks:
            self._fail(
                "SHUT-1",
                "no-leak",
                f"owner worker {rank} still has forks after a graceful shutdown: {leaks}",
            )
