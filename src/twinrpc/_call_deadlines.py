"""When pending calls time out: one world timer per distinct timeout, not one per call.

Calls made with the same timeout expire in the order they were sent, so each timeout keeps a FIFO of
``(deadline, call id)`` with a single timer armed for its head. A call that ends first (its reply came,
its peer failed, the agent shut down) is not cancelled here: when its deadline comes, it is no longer
pending and is skipped. Nearly every call ends long before its timeout (a minute by default), so one
timer per call (closures, a handle, a heap entry, and a cancel) was work done only to be undone.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Container

from ._world import World

#: the fewest entries of one timeout worth compacting (see CallDeadlines._compact)
_COMPACT_MIN = 1024


class CallDeadlines:
    """The deadlines of one agent's pending calls.

    ``add`` is called with ``lock`` held (the agent's, which guards ``pending``); ``expire(call_id,
    timeout)`` is called without it, once per call still pending at its deadline."""

    def __init__(
        self,
        world: World,
        lock: threading.Lock,
        pending: Container[int],
        expire: Callable[[int, float], None],
    ) -> None:
        self._world = world
        self._lock = lock
        self._pending = pending
        self._expire = expire
        #: timeout -> (deadline, call id) in the order the calls were made, so in deadline order
        self._queues: dict[float, collections.deque[tuple[float, int]]] = {}
        #: the queue length at which the ended calls are dropped from it
        self._compact_at: dict[float, int] = {}

    def add(self, call_id: int, timeout: float) -> float | None:
        """Record ``call_id``'s deadline (``lock`` held). Returns the deadline when the caller must
        arm a timer for it (:meth:`arm`, after releasing the lock): its queue was empty."""
        deadline = self._world.now() + timeout
        queue = self._queues.get(timeout)
        if queue is None:
            queue = self._queues[timeout] = collections.deque()
            self._compact_at[timeout] = _COMPACT_MIN
        queue.append((deadline, call_id))
        if len(queue) == 1:
            return deadline
        if len(queue) > self._compact_at[timeout]:
            self._compact(timeout, queue)
        return None

    def held(self) -> int:
        """How many deadlines are kept (ended calls not yet dropped included): what a long run's
        memory grows with (``lock`` held)."""
        return sum(len(queue) for queue in self._queues.values())

    def timeouts(self) -> int:
        """How many distinct timeouts have calls queued (``lock`` held)."""
        return len(self._queues)

    def arm(self, timeout: float, deadline: float) -> None:
        """Start the timer of ``timeout``'s queue for its head, due at ``deadline``."""
        self._world.call_later(deadline - self._world.now(), lambda: self._fire(timeout, deadline))

    def _fire(self, timeout: float, due: float) -> None:
        """The timer armed for ``due`` fired: expire every call due by then that is still pending,
        and re-arm for the next head."""
        expired = []
        nxt: float | None = None
        with self._lock:
            queue = self._queues[timeout]
            pending = self._pending
            while queue and queue[0][0] <= due:
                call_id = queue.popleft()[1]
                if call_id in pending:
                    expired.append(call_id)
            if queue:
                nxt = queue[0][0]
            else:  # gone until a call with this timeout comes again (timeouts may differ per call)
                del self._queues[timeout], self._compact_at[timeout]
        for call_id in expired:
            self._expire(call_id, timeout)
        if nxt is not None:
            self.arm(timeout, nxt)

    def _compact(self, timeout: float, queue: collections.deque[tuple[float, int]]) -> None:
        """Drop the calls that have ended (``lock`` held), keeping the head, for which a timer is
        armed: the queue stays in proportion to the calls pending, not to the calls made within a
        timeout (a minute of small calls is hundreds of thousands)."""
        head = queue.popleft()
        pending = self._pending
        live = [entry for entry in queue if entry[1] in pending]
        queue.clear()
        queue.append(head)
        queue.extend(live)
        self._compact_at[timeout] = max(_COMPACT_MIN, 2 * len(queue))
