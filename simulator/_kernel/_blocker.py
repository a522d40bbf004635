"""``SimBlocker``: what ``Future.wait()`` does inside a simulation (park the task on the scheduler)."""

from __future__ import annotations

from typing import Any

import greenlet

from twinrpc._future import Future, add_waiter

from ._scheduler import Scheduler

_getcurrent = greenlet.getcurrent


class SimBlocker:
    """Blocking in the simulator: park the current task until the future completes."""

    __slots__ = ("crashed", "sched")

    def __init__(self, sched: Scheduler, crashed: dict[int, float]) -> None:
        self.sched = sched
        self.crashed = crashed

    def wait_done(self, fut: Future[Any]) -> None:
        sched = self.sched
        task = getattr(_getcurrent(), "task", None)  # sched.current_task(), inlined: every wait
        if task is None:
            raise RuntimeError(
                "twinrpc.simulator: Future.wait() outside a simulated task; wait only from worker "
                "programs, RPC handlers and callbacks"
            )
        if task.worker in self.crashed:
            # A crashed worker's task is unwinding (Simulation.crash): it must never block again.
            raise greenlet.GreenletExit()
        if add_waiter(fut, lambda _f: sched.wake(task)):
            sched.park(fut)
