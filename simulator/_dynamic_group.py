"""The simulated store's part of a dynamic group (LIFE-5): its members and its membership token.

The gloo world keeps the same things in the rendezvous store (``impl/_dynamic_group.py``); the protocol
that uses them is the core's (``twinrpc._membership``).
"""

from __future__ import annotations

import collections

from twinrpc._future import Future
from twinrpc._worker_info import WorkerInfo

from ._kernel._scheduler import Scheduler


class DynamicGroup:
    """The simulated store's part of one dynamic group (LIFE-5): its members' names and its
    membership token, handed to waiting workers first come first served."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        #: rank -> name of every current member
        self.members: dict[int, str] = {}
        self._held = False
        self._waiting: collections.deque[Future[None]] = collections.deque()

    def lock(self, label: str) -> None:
        if not self._held:
            self._held = True
            return
        fut: Future[None] = Future()
        fut.label = label
        self._waiting.append(fut)
        fut.wait()  # the holder hands the token over in unlock()

    def unlock(self) -> None:
        if self._waiting:
            self._waiting.popleft().set_result(None)
        else:
            self._held = False

    def check_unique(self, name: str, rank: int) -> None:
        """PyTorch's errors for a joiner whose name or rank a member already has."""
        for other_rank, other_name in self.members.items():
            if other_name == name:
                raise RuntimeError(
                    f"RPC worker name {name} is not unique. Workers {rank} and {other_rank} share the same name."
                )
            if other_rank == rank:
                raise RuntimeError(
                    f"RPC worker id {rank} is not unique. Worker {other_name} already has id {rank}, so "
                    f"{name} cannot be added."
                )


class DynamicMember:
    """One member's handle on its :class:`DynamicGroup` (a ``twinrpc._membership.GroupMembership``)."""

    def __init__(self, group: DynamicGroup, rank: int) -> None:
        self.group = group
        self.rank = rank

    def lock(self) -> None:
        self.group.lock(f"the membership token (worker {self.rank} leaves)")

    def unlock(self) -> None:
        self.group.unlock()

    def remove(self) -> None:
        self.group.members.pop(self.rank, None)

    def changed(self, info: WorkerInfo, is_join: bool) -> None:
        """Nothing to track: the simulated store holds only what this simulation's workers wrote
        (nothing of an earlier run can be written back), so a joiner takes its members as they are."""
