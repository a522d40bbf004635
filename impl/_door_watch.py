"""One thread per process that watches the doorbells of every idle same-host link, so that an idle
link holds no thread of its own.

A same-host link's receiver sleeps on its doorbell (``_doorbell.Doorbell``: an eventfd the peer
rings, and the peer's pidfd). Once the link has been idle for a while, its last receiver *parks* it
here instead (``Receiver._park``): it arms the doorbell (the peer rings it for its next header), hands
it to this watcher and leaves. The watcher waits for all parked doorbells at once (``epoll``); when
one rings, or the peer's process ends, or the link is stopped here (``Doorbell.stop`` rings it too),
it takes the doorbell off its list and calls the link back (``Receiver._unpark``), which starts a
receiver again or ends receiving. What the peer wrote meanwhile stays in its ring, in order, for that
receiver; the doorbell's protocol (the reader's *asleep* flag, set before it looks once more) is the
same as for a receiver sleeping in ``poll``, and an eventfd that was rung before it was added is still
readable, so no wake-up is lost. Like a sleeping receiver, the watcher also looks at each parked link
every ``_SAFETY_S`` by itself (the belt to the protocol's braces). A caller blocking on a reply from
a parked link's peer takes its doorbell back (``take_back``) and sleeps on it itself
(``Receiver.receive_until``).

gloo offers nothing like this (a receive's ``Work`` cannot be waited on together with others), so
links between hosts, and same-host links whose header frames go over gloo, keep their receiver.

The thread runs while a world of the process runs (``hold``/``let_go``) or a doorbell is parked; the
last world's stop ends it, with its descriptors (``let_go``). A forked child starts its own.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("twinrpc.impl")

#: seconds the watcher waits before it looks at every parked link by itself (see ``_doorbell``)
_SAFETY_S = 1.0


class _Parked:
    """One parked doorbell: what to look at, and whom to call when it rings."""

    __slots__ = ("check", "door", "fds", "wake")

    def __init__(
        self, door: Any, fds: tuple[int, ...], check: Callable[[], bool], wake: Callable[[], None]
    ) -> None:
        #: the Doorbell (held, so its descriptors stay open while they are in the epoll set)
        self.door = door
        self.fds = fds
        #: whether the link needs a receiver, looked at without a ring (see _SAFETY_S)
        self.check = check
        self.wake = wake


class DoorWatch:
    """The process's doorbell watcher (``DOOR_WATCH``). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: worlds running in this process (the thread stays while any does)
        self._holders = 0
        self._by_fd: dict[int, _Parked] = {}
        self._epoll: Any = None
        #: wakes the thread (a world stopped: it may have to exit)
        self._nudge = -1
        self._thread: threading.Thread | None = None
        #: doorbell links receiving, not parked (see over_cap)
        self.awake = 0

    def hold(self) -> None:
        """A world of this process started: the watcher stays until it stops (``let_go``)."""
        with self._lock:
            self._holders += 1

    def let_go(self, timeout: float) -> bool:
        """A world stopped (its links have ended): with the last one, the thread exits once nothing
        is parked; wait up to ``timeout`` for that. False: it is still running."""
        with self._lock:
            self._holders = max(0, self._holders - 1)
            thread = self._thread
            if self._holders or thread is None:
                return True
            os.eventfd_write(self._nudge, 1)
        if thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def counted_awake(self, delta: int) -> None:
        """A doorbell link started (+1), parked (-1), was woken (+1) or ended (-1)."""
        with self._lock:
            self.awake += delta

    def park(
        self, door: Any, fds: tuple[int, ...], check: Callable[[], bool], wake: Callable[[], None]
    ) -> object:
        """Watch ``fds`` (the doorbell's eventfd and the peer's pidfd) until one is readable, or
        ``check()`` holds when the watcher looks by itself; then forget them and call ``wake()`` on
        the watcher's thread (it must not block). Returns the handle ``take_back`` takes."""
        parked = _Parked(door, fds, check, wake)
        with self._lock:
            self._start()
            for fd in fds:
                self._by_fd[fd] = parked
                self._epoll.register(fd, select.EPOLLIN)
        return parked

    def take_back(self, handle: object) -> bool:
        """Stop watching a doorbell parked with ``park`` without calling its ``wake``: a thread takes
        its link over (a caller receiving its own reply, ``Receiver.receive_until``). False: the
        doorbell had rung already, and its ``wake`` is called (or running) on the watcher's thread."""
        with self._lock:
            if not isinstance(handle, _Parked) or self._by_fd.get(handle.fds[0]) is not handle:
                return False
            self._take(handle)
            return True

    # -- the thread --------------------------------------------------------------------------------
    def _start(self) -> None:
        """Under _lock: make sure the thread runs (a new one after it exited)."""
        if self._thread is not None:
            return
        self._epoll = select.epoll()
        self._nudge = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._epoll.register(self._nudge, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="twinrpc-doorwatch", daemon=True)
        self._thread.start()

    def forget_parent(self) -> None:
        """In a forked child: the parent's thread does not exist here, its lock may have been held
        at the fork, and its epoll set is the parent's (a copy of the descriptor refers to the same
        set): close our copies and start afresh."""
        self._lock = threading.Lock()
        if self._epoll is not None:
            self._epoll.close()
            os.close(self._nudge)
        self._epoll, self._nudge, self._thread = None, -1, None
        self._by_fd = {}
        self._holders = 0
        self.awake = 0

    def _take(self, parked: _Parked) -> None:
        """Under _lock: stop watching ``parked``."""
        for fd in parked.fds:
            if self._by_fd.pop(fd, None) is not None:
                self._epoll.unregister(fd)

    def _run(self) -> None:
        epoll, nudge = self._epoll, self._nudge
        while True:
            events = epoll.poll(_SAFETY_S)
            woken: dict[int, _Parked] = {}
            with self._lock:
                for fd, _ in events:
                    if fd == nudge:
                        try:
                            os.eventfd_read(nudge)
                        except BlockingIOError:
                            pass
                        continue
                    parked = self._by_fd.get(fd)
                    if parked is not None:
                        woken[id(parked)] = parked
                if not events:
                    for parked in self._by_fd.values():
                        if parked.check():
                            woken[id(parked)] = parked
                for parked in woken.values():
                    self._take(parked)
                leave = not self._by_fd and not self._holders
                if leave:
                    self._thread = None
                    self._epoll, self._nudge = None, -1
            for parked in woken.values():
                try:
                    parked.wake()
                except Exception:  # one link's fault must not leave the others parked for good
                    _log.exception("twinrpc: waking a parked link failed")
            if leave:
                epoll.close()
                os.close(nudge)
                return


DOOR_WATCH = DoorWatch()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=DOOR_WATCH.forget_parent)
