"""Virtual time and simulated tasks.

Every simulated task is a greenlet; exactly one runs at a time, and it gives control back to the
scheduler (the hub) only by blocking on a world primitive. The event queue is ordered by (virtual time,
a seeded random tie-break, sequence number), so equal-time events run in a seed-dependent but
reproducible order. Nothing here reads the wall clock or global random state.
"""

from __future__ import annotations

import contextvars
import gc
import heapq
import random
import traceback
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import greenlet
import torch

from twinrpc._world import TimerHandle

from .._errors import SimulationDeadlock, SimulationError

_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_heappush = heapq.heappush
_getcurrent = greenlet.getcurrent

if TYPE_CHECKING:
    from .._traces._trace import Trace
    from ._compute import ComputeMeter


#: the fewest timers worth compacting (Scheduler._compact_timers)
_COMPACT_MIN = 1024


def _fire(item: tuple[TimerHandle, Callable[[], None]]) -> None:
    """A timer's event: run its function unless it was cancelled."""
    handle, fn = item
    if not handle.cancelled:
        fn()


class _Spread:
    """Events of one :meth:`Scheduler.schedule_spread_at`: event ``i`` runs ``fn(args[i])`` at key
    ``(times[i], ties[i], first + i)``; ``head`` is the one in the heap, ``live`` the rest in
    reverse order once the first is due."""

    __slots__ = ("args", "dead", "first", "fn", "head", "live", "ties", "times")

    def __init__(
        self,
        fn: Callable[[Any], None],
        args: Sequence[Any],
        dead: Callable[[Any], bool],
        times: array[float],
        ties: array[float],
        first: int,
        head: int,
    ) -> None:
        self.fn = fn
        self.args = args
        self.dead = dead
        self.times = times
        self.ties = ties
        self.first = first
        self.head = head
        self.live: list[int] | None = None


class Task:
    """A simulated task: a worker's main program, a request handler, a delivery, a timer callback."""

    __slots__ = ("done", "g", "id", "name", "waiting_on", "worker")

    def __init__(self, task_id: int, worker: int, name: str) -> None:
        self.id = task_id
        self.worker = worker
        self.name = name
        self.waiting_on: Any = None
        self.done = False
        self.g: greenlet.greenlet | None = None

    def describe(self) -> str:
        where = (
            "".join(traceback.format_stack(self.g.gr_frame)) if self.g is not None and self.g.gr_frame else ""
        )
        return f"task {self.name!r} (worker {self.worker}) waiting on {self.waiting_on!r}\n{where}"


class _TaskGreenlet(greenlet.greenlet):  # type: ignore[misc]
    task: Task


class Scheduler:
    """The event loop of one simulation."""

    def __init__(self, seed: int, *, max_time: float | None = None) -> None:
        self.rng = random.Random(seed)
        #: the tie-break draw of every event (bound once: it runs several times per message)
        self._random = self.rng.random
        self.now = 0.0
        self.max_time = max_time
        self._heap: list[tuple[float, float, int, Callable[[Any], None], Any]] = []
        #: call_later's events: a heap of their own, merged with ``_heap`` in key order when popped, so
        #: the order of events is the one a single heap gives. Timers are mostly far off (RPC timeouts)
        #: and mostly cancelled; apart, they keep the heap every message goes through small.
        self._timers: list[tuple[float, float, int, Callable[[Any], None], Any]] = []
        #: the latest time of a skipped no-op event (:meth:`schedule_spread_at`) at or before
        #: ``max_time``, and whether one was later: what popping them would have done to ``now`` (seen
        #: only in a deadlock's or a max_time error's report), applied when the run stops on one of those
        self._skipped_until = 0.0
        self._skipped_past_max = False
        #: the timers' size at which the cancelled ones are dropped (see :meth:`_compact_timers`)
        self._compact_at = _COMPACT_MIN
        self._seq = 0
        self._task_ids = 0
        self.tasks: dict[int, Task] = {}
        self.hub: greenlet.greenlet | None = None
        self.failure: BaseException | None = None
        self.stopped = False
        self.switches = 0
        #: where task switches are recorded (the simulation's trace when it is on)
        self.trace: Trace | None = None
        self._idle: list[_TaskGreenlet] = []
        #: worker -> the task starts and wake-ups held back while it is paused (Simulation.pause)
        self.paused: dict[int, list[tuple[Callable[[Any], None], Any]]] = {}
        #: counts what tasks compute and books it on their worker (Simulation(compute=...)); None: free
        self.meter: ComputeMeter | None = None

    @property
    def events_scheduled(self) -> int:
        """How many events were scheduled so far (messages, task starts and wake-ups, timers, and
        each event of :meth:`schedule_spread_at`, run or dropped)."""
        return self._seq

    # -- events -----------------------------------------------------------------------------------
    def schedule(self, delay: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        seq = self._seq = self._seq + 1
        _heappush(self._heap, (self.now + delay, self._random(), seq, fn, arg))

    def schedule_spread_at(
        self,
        fn: Callable[[Any], None],
        args: Sequence[Any],
        times: array[float],
        ties: array[float],
        dead: Callable[[Any], bool],
    ) -> None:
        """Run ``fn(arg)`` for each of ``args``, event ``i`` at key ``(times[i], ties[i])`` (a time at
        or after now and a tie-break drawn as :meth:`schedule` draws it), with the order of one
        :meth:`schedule` call per arg, in turn, holding one of them in the heap at a time.

        ``dead(arg)`` says an event has become a no-op for good (e.g. an announcement to a worker that
        has stopped since): such events are dropped unrun instead of being popped one by one. The
        keys are kept as two arrays of floats, not as N tuples each: a departure's news to every
        peer of a large world would otherwise be most of what the garbage collector walks."""
        if not args:
            return
        first = self._seq + 1
        self._seq += len(args)
        head = min(zip(times, ties, range(len(args)), strict=True))[2]  # keys built in C, N per stop
        spread = _Spread(fn, args, dead, times, ties, first, head)
        _heappush(self._heap, (times[head], ties[head], first + head, self._spread_step, spread))

    def _spread_step(self, spread: _Spread) -> None:
        head, args, dead, times = spread.head, spread.args, spread.dead, spread.times
        live = spread.live
        if live is None:  # the first of them is due: drop the dead, order the rest (latest first)
            ties = spread.ties
            live = []
            for i in range(len(args)):
                if i == head:
                    continue
                if dead(args[i]):
                    self._skip(times[i])
                else:
                    live.append(i)
            live = [i for _, _, i in sorted(((times[i], ties[i], i) for i in live), reverse=True)]
            spread.live = live
        while live:
            i = live.pop()
            if dead(args[i]):
                self._skip(times[i])
                continue
            spread.head = i
            _heappush(self._heap, (times[i], spread.ties[i], spread.first + i, self._spread_step, spread))
            break
        spread.fn(args[head])

    def _skip(self, t: float) -> None:
        if self.max_time is not None and t > self.max_time:
            self._skipped_past_max = True
        elif t > self._skipped_until:
            self._skipped_until = t

    def _catch_up(self) -> None:
        """``now`` as if the skipped no-op events before it had been popped (see ``_skipped_until``)."""
        if self._skipped_until > self.now:
            self.now = self._skipped_until

    # -- tasks ------------------------------------------------------------------------------------
    def spawn(
        self,
        worker: int,
        context: contextvars.Context,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
    ) -> Task:
        """Start ``fn(*args)`` as a new task of ``worker``, running in a copy of ``context``."""
        task = self._new_task(worker, name)
        seq = self._seq = self._seq + 1  # schedule(0.0, ...), inlined: a task starts per message
        _heappush(self._heap, (self.now, self._random(), seq, self._start, (task, context, fn, args)))
        return task

    def start_now(
        self,
        worker: int,
        context: contextvars.Context,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
    ) -> None:
        """Start ``fn(*args)`` as a new task of ``worker`` at once, from the hub (an event handler):
        what :meth:`spawn` does without a second event, for a task whose start is decided by the
        event being handled (a message's delivery)."""
        self._start((self._new_task(worker, name), context, fn, args))

    def _new_task(self, worker: int, name: str) -> Task:
        task_id = self._task_ids = self._task_ids + 1
        task = self.tasks[task_id] = Task(task_id, worker, name)
        return task

    def _start(self, item: tuple[Task, contextvars.Context, Callable[..., Any], tuple[Any, ...]]) -> None:
        task, context, fn, args = item
        if task.done:  # stopped before it started (its process was killed): it never runs
            return
        if self.paused and task.worker in self.paused:
            self.paused[task.worker].append((self._start, item))
            return
        # Greenlets are reused: creating one costs more than the switches of a small RPC.
        g = self._idle.pop() if self._idle else _TaskGreenlet(self._task_loop, parent=self.hub)
        g.gr_context = context.copy()
        g.task = task
        task.g = g
        self.switches += 1
        trace = self.trace
        if trace is not None:
            trace.record(self.now, task.worker, "switch", (task.id, task.name))
        if self.meter is None:
            g.switch(task, fn, args)
        else:
            self._metered(task.worker, g.switch, task, fn, args)

    def _task_loop(self, task: Task, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        g = _getcurrent()
        hub = self.hub
        assert hub is not None
        tasks = self.tasks
        idle = self._idle
        while True:
            try:
                _set_grad_enabled(True)  # a new task starts as a new thread does (see park)
                fn(*args)
            except greenlet.GreenletExit:
                raise
            except BaseException as exc:  # a task must not fail silently: stop the simulation with it
                self.fail(f"simulated task {task.name!r} on worker {task.worker}", exc)
            task.done = True
            task.g = None
            tasks.pop(task.id, None)
            g.task = None
            task = fn = args = None  # type: ignore[assignment]  # drop references while idle
            idle.append(g)
            task, fn, args = hub.switch()

    def fail(self, what: str, exc: BaseException) -> None:
        """``what`` raised ``exc``: the run stops with it (the first failure wins)."""
        if self.failure is None:
            self.failure = SimulationError(f"{what} failed at t={self.now:.6f}: {exc!r}")
            self.failure.__cause__ = exc

    def _metered(self, worker: int, switch: Callable[..., Any], *args: Any) -> None:
        """Run a task until it blocks, counting what it computes, then book that on its worker."""
        meter = self.meter
        assert meter is not None
        meter.enter()
        try:
            switch(*args)
        finally:
            meter.exit()
            meter.charge(worker)

    def tasks_of(self, worker: int) -> list[Task]:
        """The live tasks of ``worker``, oldest first: a list of its own, so killing them is safe."""
        return [t for t in self.tasks.values() if t.worker == worker and not t.done]

    def kill(self, task: Task) -> bool:
        """End ``task`` for good, as a SIGKILL ends a thread: it is done and forgotten, and if it has
        started, ``GreenletExit`` unwinds it now (from where it is parked). Returns whether it had
        started (a task not yet started never runs)."""
        task.done = True
        self.tasks.pop(task.id, None)
        g = task.g
        if g is not None and not g.dead:
            g.throw(greenlet.GreenletExit())
        return g is not None

    def current_task(self) -> Task | None:
        return getattr(_getcurrent(), "task", None)

    def park(self, waiting_on: Any) -> None:
        """Block the current task until someone calls :meth:`wake` for it."""
        task: Task | None = getattr(_getcurrent(), "task", None)
        if task is None:
            raise RuntimeError(
                "twinrpc.simulator: a blocking call was made outside a simulated task (for example in a "
                "callback run by the scheduler itself); block only from worker programs and RPC handlers"
            )
        task.waiting_on = waiting_on
        assert self.hub is not None
        # Grad mode is per OS thread in torch and every task shares this one: a task parked inside
        # autograd's engine (a hook waiting for a simulated collective) has it off. Each task keeps
        # its own, as each thread of a real worker does.
        grad_enabled = _is_grad_enabled()
        self.hub.switch()
        _set_grad_enabled(grad_enabled)
        task.waiting_on = None

    def wake(self, task: Task) -> None:
        seq = self._seq = self._seq + 1  # schedule(0.0, ...), inlined
        _heappush(self._heap, (self.now, self._random(), seq, self._resume, task))

    def _resume(self, task: Task) -> None:
        if task.done or task.g is None:
            return
        if self.paused and task.worker in self.paused:
            self.paused[task.worker].append((self._resume, task))
            return
        self.switches += 1
        trace = self.trace
        if trace is not None:
            trace.record(self.now, task.worker, "switch", (task.id, task.name))
        if self.meter is None:
            task.g.switch()
        else:
            self._metered(task.worker, task.g.switch)

    def pause(self, worker: int) -> None:
        """Hold back every task start and wake-up of ``worker`` until :meth:`unpause`."""
        self.paused.setdefault(worker, [])

    def unpause(self, worker: int) -> None:
        """Let ``worker`` run again: what was held back is scheduled now, in its original order."""
        for fn, arg in self.paused.pop(worker, []):
            self.schedule(0.0, fn, arg)

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        handle = TimerHandle()
        seq = self._seq = self._seq + 1
        timers = self._timers
        _heappush(timers, (self.now + delay, self._random(), seq, _fire, (handle, fn)))
        if len(timers) > self._compact_at:
            self._compact_timers()
        return handle

    def _compact_timers(self) -> None:
        """Drop the cancelled timers (an RPC's timeout is cancelled by its reply and would stay in
        the heap, with its closures, until its time, a minute later), as no-op events skipped unrun
        (:meth:`_skip`), as the gloo world's timer compacts its heap."""
        timers = self._timers
        live = []
        for ev in timers:
            if ev[4][0].cancelled:
                self._skip(ev[0])
            else:
                live.append(ev)
        heapq.heapify(live)
        timers[:] = live  # in place: run() holds the list
        self._compact_at = max(_COMPACT_MIN, 2 * len(live))

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, until: Callable[[], bool]) -> None:
        """Run events until ``until()`` holds. Raises SimulationDeadlock when nothing can run.

        What was alive before the run (torch's modules above all, some 200,000 objects) is frozen out
        of the cyclic garbage collector while it lasts, unless the program froze objects itself: the
        trace and the messages of a long run are enough to trigger full collections, each of which
        walked all of it (measured: 7% of the time of a run of small RPCs). The run's own cyclic
        garbage is collected before the thaw, or the next run would freeze it for good (runs back to
        back, as an exploration makes, would keep all of it)."""
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            self._run(until)
        finally:
            if freeze:
                gc.collect()  # only what is not frozen: the run's objects
                gc.unfreeze()

    def _run(self, until: Callable[[], bool]) -> None:
        self.hub = greenlet.getcurrent()
        heap = self._heap
        timers = self._timers
        pop = heapq.heappop
        max_time = self.max_time
        while not until():
            if self.failure is not None:
                raise self.failure
            if timers and (not heap or timers[0] < heap[0]):  # keys are unique: fn is never compared
                t, _, _, fn, arg = pop(timers)
            elif heap:
                t, _, _, fn, arg = pop(heap)
            else:
                self._catch_up()
                if self._skipped_past_max:  # popping the skipped events would have passed max_time
                    raise self._past_max_time()
                raise SimulationDeadlock(self.deadlock_report())
            if max_time is not None and t > max_time:
                self._catch_up()
                raise self._past_max_time()
            self.now = t
            fn(arg)
        if self.failure is not None:
            raise self.failure

    def _past_max_time(self) -> SimulationError:
        return SimulationError(
            f"virtual time passed max_time={self.max_time} s with work still pending:\n"
            + self.deadlock_report()
        )

    def deadlock_report(self) -> str:
        blocked = [t for t in self.tasks.values() if not t.done]
        lines = [f"simulation deadlock at t={self.now:.6f} s: every task is blocked and no event is pending"]
        for t in sorted(blocked, key=lambda t: (t.worker, t.id)):
            lines.append(t.describe())
        return "\n".join(lines)
