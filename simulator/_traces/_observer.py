"""Records RRef and distributed-autograd events in a simulation's trace.

The protocol core reports these through two optional hooks (``RRefContext.observer``,
``DistAutogradContainer.observer``; ``None`` in the real world). When the trace is on, the simulation
installs a :class:`TraceObserver` in both; for RRefs it also forwards every event to the online
monitors (``simulator/_checks/_monitors.py``) until they stop at a crash.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinrpc._rref import GloballyUniqueId, OwnerState, UserState

if TYPE_CHECKING:
    from .._checks._monitors import GenerationMonitor
    from .._kernel._scheduler import Scheduler
    from ._trace import Trace


def _gid(g: GloballyUniqueId) -> str:
    return f"{g.created_on}:{g.local_id}"


class TraceObserver:
    """One per simulation: the ``RRefObserver`` and ``AutogradObserver`` of every worker's agent."""

    def __init__(self, sched: Scheduler, trace: Trace, monitor: GenerationMonitor | None) -> None:
        self.trace = trace
        self.sched = sched
        #: the online monitors of one generation to forward RRef events to (one trace observer per
        #: generation, simulator/_observers.py); cleared when they stop (a crash)
        self.monitor = monitor

    def _rec(self, rank: int, event: str, detail: str) -> None:
        self.trace.record(self.sched.now, rank, event, detail)

    # -- RRefObserver ------------------------------------------------------------------------------
    def user_created(self, rank: int, state: UserState) -> None:
        self._rec(
            rank,
            "rref-user-created",
            f"rref {_gid(state.rref_id)} fork {_gid(state.fork_id)} owner rank {state.owner}",
        )
        if self.monitor is not None:
            self.monitor.user_created(rank, state)

    def user_confirmed(self, rank: int, state: UserState) -> None:
        self._rec(rank, "rref-user-confirmed", f"rref {_gid(state.rref_id)} fork {_gid(state.fork_id)}")
        if self.monitor is not None:
            self.monitor.user_confirmed(rank, state)

    def user_deleted(self, rank: int, state: UserState, notified: bool) -> None:
        how = "delete sent to owner" if notified else "no delete sent"
        self._rec(
            rank,
            "rref-user-deleted",
            f"rref {_gid(state.rref_id)} fork {_gid(state.fork_id)} ({how})",
        )
        if self.monitor is not None:
            self.monitor.user_deleted(rank, state, notified)

    def child_forked(self, rank: int, parent: UserState, child_fork_id: GloballyUniqueId) -> None:
        self._rec(
            rank,
            "rref-forked",
            f"rref {_gid(parent.rref_id)} fork {_gid(parent.fork_id)} -> child fork {_gid(child_fork_id)}",
        )
        if self.monitor is not None:
            self.monitor.child_forked(rank, parent, child_fork_id)

    def fork_known(self, rank: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        self._rec(rank, "rref-fork-known", f"rref {_gid(rref_id)} fork {_gid(fork_id)}")
        if self.monitor is not None:
            self.monitor.fork_known(rank, rref_id, fork_id)

    def fork_abandoned(self, rank: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        self._rec(rank, "rref-fork-abandoned", f"rref {_gid(rref_id)} fork {_gid(fork_id)}")
        if self.monitor is not None:
            self.monitor.fork_abandoned(rank, rref_id, fork_id)

    def delete_heard(self, rank: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        self._rec(rank, "rref-delete-heard", f"rref {_gid(rref_id)} fork {_gid(fork_id)}")
        if self.monitor is not None:
            self.monitor.delete_heard(rank, rref_id, fork_id)

    def owner_registered(self, rank: int, state: OwnerState) -> None:
        self._rec(rank, "rref-owner-created", f"rref {_gid(state.rref_id)}")
        if self.monitor is not None:
            self.monitor.owner_registered(rank, state)

    def owner_dropped(self, rank: int, state: OwnerState) -> None:
        self._rec(rank, "rref-freed", f"rref {_gid(state.rref_id)}")
        if self.monitor is not None:
            self.monitor.owner_dropped(rank, state)

    def closed(
        self, rank: int, graceful: bool, leaks: list[tuple[GloballyUniqueId, list[GloballyUniqueId]]]
    ) -> None:
        self._rec(rank, "rref-closed", "graceful" if graceful else "not graceful")
        if self.monitor is not None:
            self.monitor.closed(rank, graceful, leaks)

    # -- AutogradObserver --------------------------------------------------------------------------
    def autograd_event(self, rank: int, event: str, context_id: int, detail: str) -> None:
        text = f"context {context_id}: {detail}" if detail else f"context {context_id}"
        self._rec(rank, f"autograd-{event}", text)
