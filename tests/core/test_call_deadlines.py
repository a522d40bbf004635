"""Call deadlines (src/twinrpc/_call_deadlines.py): one timer per distinct timeout, not one per call."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from twinrpc._call_deadlines import CallDeadlines


class _ManualWorld:
    """A clock moved by hand and a timer list fired by hand: just what CallDeadlines uses."""

    def __init__(self) -> None:
        self.time = 0.0
        self.timers: list[tuple[float, Callable[[], Any]]] = []

    def now(self) -> float:
        return self.time

    def call_later(self, delay: float, fn: Callable[[], Any]) -> None:
        self.timers.append((self.time + delay, fn))

    def advance_to(self, t: float) -> None:
        """Move the clock to ``t``, firing every timer due by then in time order."""
        while True:
            due = sorted((at, i) for i, (at, _) in enumerate(self.timers) if at <= t)
            if not due:
                break
            at, i = due[0]
            fn = self.timers.pop(i)[1]
            self.time = at
            fn()
        self.time = t


class _Agent:
    """The agent's side: a lock, the pending table, and what expired."""

    def __init__(self) -> None:
        self.world = _ManualWorld()
        self.lock = threading.Lock()
        self.pending: dict[int, str] = {}
        self.expired: list[tuple[int, float, float]] = []
        self.deadlines = CallDeadlines(self.world, self.lock, self.pending, self._expire)  # type: ignore[arg-type]

    def _expire(self, call_id: int, timeout: float) -> None:
        with self.lock:
            del self.pending[call_id]
        self.expired.append((call_id, timeout, self.world.now()))

    def call(self, call_id: int, timeout: float) -> None:
        with self.lock:
            self.pending[call_id] = "pending"
            arm = self.deadlines.add(call_id, timeout)
        if arm is not None:
            self.deadlines.arm(timeout, arm)

    def end(self, call_id: int) -> None:
        with self.lock:
            del self.pending[call_id]


def test_a_call_still_pending_at_its_deadline_expires_once_at_that_time() -> None:
    agent = _Agent()
    agent.call(1, 5.0)
    agent.world.advance_to(4.9)
    assert agent.expired == []
    agent.world.advance_to(100.0)
    assert agent.expired == [(1, 5.0, 5.0)]


def test_a_call_that_ended_before_its_deadline_never_expires() -> None:
    agent = _Agent()
    agent.call(1, 5.0)
    agent.call(2, 5.0)
    agent.end(1)
    agent.world.advance_to(100.0)
    assert [e[0] for e in agent.expired] == [2]


def test_calls_with_one_timeout_share_one_timer_armed_for_the_earliest() -> None:
    agent = _Agent()
    for i in range(100):
        agent.world.time = i * 0.01
        agent.call(i, 60.0)
    assert len(agent.world.timers) == 1
    agent.world.advance_to(60.5)  # the first 51 calls are due (made at 0.00 .. 0.50)
    assert [e[0] for e in agent.expired] == list(range(51))
    assert all(at == call_id * 0.01 + 60.0 for call_id, _, at in agent.expired)
    assert len(agent.world.timers) == 1  # re-armed for the next one


def test_a_shorter_timeout_made_later_expires_first() -> None:
    agent = _Agent()
    agent.call(1, 60.0)
    agent.world.time = 1.0
    agent.call(2, 2.0)
    agent.world.advance_to(100.0)
    assert [(e[0], e[2]) for e in agent.expired] == [(2, 3.0), (1, 60.0)]


def test_a_call_made_after_its_queue_emptied_arms_a_new_timer() -> None:
    agent = _Agent()
    agent.call(1, 1.0)
    agent.world.advance_to(2.0)
    agent.call(2, 1.0)
    agent.world.advance_to(10.0)
    assert [(e[0], e[2]) for e in agent.expired] == [(1, 1.0), (2, 3.0)]


def test_ended_calls_are_dropped_so_memory_follows_the_calls_pending() -> None:
    agent = _Agent()
    for i in range(20_000):  # a minute's worth of quick calls, each ended by its reply
        agent.call(i, 60.0)
        agent.end(i)
    agent.call(-1, 60.0)  # one still pending
    with agent.lock:
        held = agent.deadlines.held()
    assert held <= 2048, held
    agent.world.advance_to(1000.0)
    assert [e[0] for e in agent.expired] == [-1]


def test_a_timeout_whose_calls_are_all_due_keeps_nothing_behind() -> None:
    agent = _Agent()
    for i in range(500):  # a deadline budget computed per call: every timeout differs
        agent.call(i, 1.0 + i * 1e-3)
        agent.end(i)
    agent.world.advance_to(10.0)
    with agent.lock:
        assert agent.deadlines.timeouts() == 0 and agent.deadlines.held() == 0
    agent.call(500, 1.0)  # a timeout seen before queues and fires again
    agent.world.advance_to(20.0)
    assert [e[0] for e in agent.expired] == [500]
