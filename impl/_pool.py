"""The request pool: at most ``num_worker_threads`` requests run at once (like TensorPipe's pool).

Its threads also serve as a link's receivers (PeerLink: two per link): a receiver that gets a request
while a request slot is free runs the request itself, at once, while the link's other receiver, already
waiting in gloo, goes on receiving (an idle pool thread is started only if none is left). That saves the
thread hop (and, under load, the scheduler wake-up latency) between receiving a request and running it,
as the simulator's delivery task becoming the pool task does. A brief request (a builtin operator on a
few plain arguments, ``World.submit``'s ``brief``) runs on the receiver without it handing its role off at all
(``run_inline``): it cannot block, so the link is never left without a receiver. Either way it holds a
slot while it runs, and queued requests still wait their turn, in order, when every slot is busy.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("twinrpc.impl")
_STOP = object()
#: seconds an idle pool thread beyond the pre-started ones waits for a job before it exits: a burst
#: (many peers' requests at once, receivers handing off) leaves no threads behind
IDLE_EXIT = 2.0
_TASK = 1  # a request: counts against the pool size
_JOB = 2  # anything else (a link's receive loop): runs on an idle thread, not counted


class _Worker:
    """One pool thread: it sleeps on its own lock until given a job (cheaper than a shared queue)."""

    __slots__ = ("job", "wake")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.job: Any = None


class RequestPool:
    """Request slots (``size``) and the threads that run requests and receive loops. Thread-safe."""

    def __init__(self, size: int, name: str, prestart: int = 2) -> None:
        self._size = size
        self._name = name
        #: idle threads kept however long they idle (the rest exit after IDLE_EXIT)
        self._keep = prestart
        self._lock = threading.Lock()
        self._busy = 0  # requests running (<= size)
        self._pending: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._idle: list[_Worker] = []
        self._stopped = False
        self._ids = itertools.count()
        #: every thread started (they leave only at stop): see join
        self._threads: list[threading.Thread] = []
        for _ in range(prestart):  # a few idle threads up front, so the first hand-offs start no thread
            worker = _Worker()
            self._idle.append(worker)
            self._thread(worker, wait_first=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread, or queue it while ``size`` requests are running."""
        with self._lock:
            if self._busy >= self._size:
                self._pending.append((fn, args))
                return
            self._busy += 1
            worker = self._idle.pop() if self._idle else None
        self._give(worker, (_TASK, fn, args))

    def _take_slot(self) -> bool:
        """Count this thread as running a request, if a slot is free (and the pool runs)."""
        with self._lock:
            free = self._busy < self._size and not self._stopped
            if free:
                self._busy += 1
        return free

    def run_here(self, fn: Callable[..., Any], args: tuple[Any, ...], before: Callable[[], bool]) -> None:
        """Run the request ``fn(*args)`` on this thread if a slot is free and ``before()`` (which frees
        this thread from its other role) agrees; else submit it as usual."""
        if not self._take_slot():
            self.submit(fn, *args)
            return
        if not before():
            with self._lock:
                self._busy -= 1
            self.submit(fn, *args)
            return
        self._run_requests(fn, args)

    def run_inline(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run the request ``fn(*args)``, which is short and never blocks, on this thread (which keeps
        its other role, e.g. a link's receiver) if a slot is free; else submit it as usual. Requests
        queued meanwhile are not run here: the slot goes to a pool thread with the next of them."""
        if not self._take_slot():
            self.submit(fn, *args)
            return
        try:
            self._run(fn, args)
        finally:
            with self._lock:
                if self._pending:
                    job: tuple[int, Callable[..., Any], tuple[Any, ...]] | None = (
                        _TASK,
                        *self._pending.popleft(),
                    )
                    worker = self._idle.pop() if self._idle else None
                else:
                    job = None
                    self._busy -= 1
            if job is not None:
                self._give(worker, job)

    def run_job(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on an idle pool thread (a new one if none is idle); not a request."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        self._give(worker, (_JOB, fn, ()))

    def stop(self) -> None:
        """Idle threads exit; busy ones exit once the requests queued before stop() have run."""
        with self._lock:
            self._stopped = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.job = _STOP
            worker.wake.release()

    def join(self, timeout: float) -> list[str]:
        """After stop(): wait up to ``timeout`` seconds for every pool thread but the calling one to
        exit (why: GlooWorld._stop_threads); returns the names of those still running (a request that
        has not returned)."""
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        joined = 0
        while True:
            with self._lock:
                threads = self._threads[joined:]  # a job given during the join may start a thread
            if not threads or time.monotonic() >= deadline:
                break
            for thread in threads:
                if thread is not me:
                    thread.join(max(0.0, deadline - time.monotonic()))
            joined += len(threads)
        with self._lock:
            return [t.name for t in self._threads if t is not me and t.is_alive()]

    # -- threads ----------------------------------------------------------------------------------
    def _thread(self, worker: _Worker, wait_first: bool = False) -> threading.Thread:
        thread = threading.Thread(
            target=self._main,
            args=(worker, wait_first),
            name=f"{self._name}-{next(self._ids)}",
            daemon=True,
        )
        with self._lock:
            self._threads.append(thread)
        return thread

    def _give(self, worker: _Worker | None, job: tuple[int, Callable[..., Any], tuple[Any, ...]]) -> None:
        if worker is None:
            worker = _Worker()
            worker.job = job
            self._thread(worker, wait_first=False).start()
        else:
            worker.job = job
            worker.wake.release()

    def _main(self, worker: _Worker, wait_first: bool) -> None:
        # A worker waits on its lock exactly once per time it is put on the idle list (the giver
        # releases it exactly once), so the lock never carries a stale wake-up.
        if wait_first:
            worker.wake.acquire()
        while True:
            job, worker.job = worker.job, None
            if job is _STOP:
                return
            kind, fn, args = job
            if kind == _TASK:
                self._run_requests(fn, args)
            else:
                self._run(fn, args)
            with self._lock:
                if self._stopped:
                    return
                self._idle.append(worker)
            if not self._wait_for_job(worker):
                return

    def _wait_for_job(self, worker: _Worker) -> bool:
        """Wait on the idle list for the next job; False: this thread exits instead (it idled
        IDLE_EXIT seconds while more than ``_keep`` threads were idle)."""
        while not worker.wake.acquire(timeout=IDLE_EXIT):
            with self._lock:
                taken = worker not in self._idle
                if not taken and len(self._idle) > self._keep:
                    self._idle.remove(worker)
                    self._forget(threading.current_thread())
                    return False
            if taken:
                worker.wake.acquire()  # taken off the list for a job: its release comes at once
                return True
        return True

    def _forget(self, thread: threading.Thread) -> None:
        """An exiting idle thread leaves the list join() waits on (under _lock)."""
        try:
            self._threads.remove(thread)
        except ValueError:
            pass

    def _run_requests(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run a request, then queued ones while there are any; then give the slot back."""
        while True:
            self._run(fn, args)
            with self._lock:
                if not self._pending:
                    self._busy -= 1
                    return
                fn, args = self._pending.popleft()

    @staticmethod
    def _run(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception:
            _log.exception("twinrpc: a request task raised")


class CallbackRunner:
    """Runs the user Future callbacks that world threads must not run (twinrpc._future.CALLBACK_ROLE),
    in the order they are given, on pool threads. Thread-safe.

    A link's receivers and outbox and the world's timer complete futures (a reply, a failed send, a
    timeout), and a user callback (``then``, ``add_done_callback``) may block, for instance in an
    ``rpc_sync`` back to the very peer whose reply ran it: on a receiver that would keep every later
    message from that peer, that reply included, waiting. So they only queue the callbacks here. One
    runner (an idle pool thread) at a time drains the queue: a burst of replies costs one wake-up,
    not one per reply, which costs less than handing the receiver role off for each reply's callbacks
    would (docs/explanation/benchmarks.md); replies without user callbacks pay nothing. A runner
    about to block on a twinrpc Future (``wait()``, ``rpc_sync``, ``to_here``...) first hands the
    queue to a new runner (``CALLBACK_ROLE.on_block``),
    so a callback that waits never holds up the ones queued behind it; one that blocks otherwise (a
    lock, a sleep) delays them until it returns, never a reply or a ``wait()``.
    """

    def __init__(self, run_elsewhere: Callable[[Callable[[], None]], None]) -> None:
        self._run_elsewhere = run_elsewhere
        self._lock = threading.Lock()
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        #: a runner is draining the queue
        self._running = False

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` (it must not raise: Future._run_callbacks logs its callbacks' errors)."""
        with self._lock:
            self._queue.append(fn)
            if self._running:
                return
            self._running = True
        self._run_elsewhere(self._drain)

    def _drain(self) -> None:
        from twinrpc._future import CALLBACK_ROLE

        role = CALLBACK_ROLE
        queue = self._queue
        try:
            while True:
                with self._lock:
                    if not queue:
                        self._running = False
                        return
                    fn = queue.popleft()
                role.on_block = self._detach
                fn()
                if role.on_block is None:
                    return  # it blocked: the queue went to another runner (_detach)
        finally:
            role.on_block = None

    def _detach(self) -> None:
        """CALLBACK_ROLE.on_block: this runner is about to block; the queue goes to a new one."""
        from twinrpc._future import CALLBACK_ROLE

        CALLBACK_ROLE.on_block = None
        with self._lock:
            start = bool(self._queue)
            self._running = start
        if start:
            self._run_elsewhere(self._drain)
