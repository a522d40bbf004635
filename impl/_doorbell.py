"""The same-host doorbell: how a process sleeping on a peer's ring is woken when a header lands in it,
and how either end learns that the other's process has gone.

The reader of a ring owns an ``eventfd`` (its *doorbell*); the writer holds a copy of it, taken with
``pidfd_getfd`` at connection time (an eventfd cannot be opened through ``/proc/<pid>/fd`` as a memfd
can). The classic protocol keeps wake-ups rare and never lost:

* the writer copies the header into its slot, publishes the new count of headers written, then reads
  the reader's *asleep* flag and rings only if it is set;
* the reader sets *asleep*, then looks at the count once more, and only if nothing new is there
  sleeps in ``poll`` on the doorbell.

Each side's store and the load after it are separated by a full memory barrier (``_fence``), so at
least one of them sees the other's store: the writer rings, or the reader finds the header. ``poll``
also watches the peer's *pidfd*, which becomes readable when the peer's process ends however it ends
(kill -9 included): a reader with nothing left to read then fails the link, as a closed gloo
connection does. A writer whose slots are all taken waits the same way, on the pidfd with a short
timeout, until the reader frees one.

One doorbell serves one link direction. An idle link's doorbell is watched, with every other idle
link's, by one thread of the process (``_door_watch``), under the same protocol (``arm``).
"""

from __future__ import annotations

import ctypes
import os
import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ._link_state import LinkBroken

#: ``pidfd_getfd``'s system call number (the same on every Linux architecture: added after the tables
#: were unified)
_SYS_PIDFD_GETFD = 438
#: the longest a sleeper stays in ``poll`` before it looks again by itself: a belt to the protocol's
#: braces (on a CPU whose barrier were weaker than ``_fence`` assumes, a wake-up could be missed)
_SAFETY_MS = 1000
_ONE = (1).to_bytes(8, "little")
_barrier = threading.Lock()


def _fence() -> None:
    """A full memory barrier: taking a free lock is an atomic read-modify-write (``lock cmpxchg`` on
    x86), which orders every store before it with every load after it."""
    _barrier.acquire()
    _barrier.release()


def _load_syscall() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
        fn.restype = ctypes.c_long
        return fn
    except (OSError, AttributeError):
        return None


_syscall = _load_syscall()


def available() -> bool:
    """Whether this process can make doorbells and watch its peers (Linux 5.6+)."""
    return hasattr(os, "eventfd") and hasattr(os, "pidfd_open") and _syscall is not None


def take_fd(pid: int, fd: int) -> int:
    """A descriptor of this process for the descriptor ``fd`` of process ``pid`` (``pidfd_getfd``).

    Raises:
        OSError: the kernel refused (an older kernel, a seccomp filter, or no ptrace permission).
    """
    pidfd = os.pidfd_open(pid)
    try:
        got = int(_syscall(ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(fd), 0))
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd of fd {fd} in process {pid}: {os.strerror(err)}")
        return got
    finally:
        os.close(pidfd)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _peer_gone(pid: int) -> LinkBroken:
    return LinkBroken(
        "its connection to this worker closed without a close frame (its process exited or died); "
        f"the same-host doorbell saw process {pid} end"
    )


class Doorbell:
    """The reading end: an eventfd the peer rings, and the peer's pidfd.

    ``wait`` is called by one thread at a time (the receiver's door lock); ``stop`` by any thread. The
    descriptors close when the object goes (a ``poll`` in progress holds a reference to it), never
    while a thread may still be polling them.
    """

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._fds = [self.fd]
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self._pidfd: int | None = None
        self._peer_pid = 0
        self._stopped = False
        weakref.finalize(self, _close_all, self._fds)

    def watch(self, pid: int) -> None:
        """Also wake when process ``pid`` (the peer) ends."""
        self._pidfd = os.pidfd_open(pid)
        self._fds.append(self._pidfd)
        self._peer_pid = pid
        self._poll.register(self._pidfd, select.POLLIN)

    def stop(self) -> None:
        """The link ends here (abandoned or failed): a waiting thread wakes and raises, and so does
        every later wait."""
        self._stopped = True
        try:
            os.write(self.fd, _ONE)
        except OSError:
            pass

    def nudge(self) -> None:
        """Wake the thread sleeping on the doorbell (if any) so that it looks at its ``ready()`` again
        (a caller waiting for its reply whose future was completed elsewhere, see
        ``Receiver.receive_until``); a later sleeper wakes once for nothing."""
        try:
            os.write(self.fd, _ONE)
        except OSError:
            pass

    @property
    def stopped(self) -> bool:
        """Whether the link was stopped here (``stop``)."""
        return self._stopped

    @property
    def fds(self) -> tuple[int, ...]:
        """The descriptors a sleeper waits on: the doorbell, and the peer's pidfd once watched."""
        return (self.fd,) if self._pidfd is None else (self.fd, self._pidfd)

    def wait(self, ready: Callable[[], bool], asleep: Any, hung_up: Any, until: float | None = None) -> bool:
        """Return True once ``ready()``; sleep on the doorbell meanwhile, with ``asleep[0]`` (a word of
        the ring the writer reads) set while sleeping. False: still not ready at ``until`` (monotonic;
        None: wait as long as it takes).

        Raises:
            LinkBroken: the peer's process ended, or the peer abandoned the link (``hung_up[0]``, a
                word of the ring it writes), and nothing is left to read.
            RuntimeError: the link was stopped here (``stop``).
        """
        fd, pidfd = self.fd, self._pidfd
        while True:
            if ready():
                return True
            if self._stopped:
                raise RuntimeError("the link was closed while waiting for the peer's next header")
            if hung_up[0]:
                raise LinkBroken(
                    "its connection to this worker closed without a close frame (it abandoned the link)"
                )
            timeout_ms = _SAFETY_MS
            if until is not None:  # past it, one look (the peer's end included) without sleeping
                timeout_ms = max(0, min(_SAFETY_MS, int((until - time.monotonic()) * 1000) + 1))
            asleep[0] = 1
            _fence()
            if ready():
                asleep[0] = 0
                return True
            try:
                events = self._poll.poll(timeout_ms)
            finally:  # a KeyboardInterrupt in the poll included: the writer must stop ringing
                asleep[0] = 0
            try:
                os.read(fd, 8)  # reset the counter (nothing there after a time-out: EAGAIN)
            except BlockingIOError:
                pass
            if pidfd is not None and any(e[0] == pidfd for e in events):
                _fence()
                if ready():
                    return True  # what it wrote before it went is still read, in order
                if not self._stopped:
                    raise _peer_gone(self._peer_pid)
            if until is not None and time.monotonic() >= until:
                return ready()

    def arm(self, ready: Callable[[], bool], asleep: Any, hung_up: Any) -> bool:
        """Before the doorbell is handed to a watcher (``_door_watch``) rather than waited on: reset
        its counter and set ``asleep[0]``, so that the peer rings it for its next header. False (and
        ``asleep[0]`` cleared): there is something to do already (``ready()``, stopped, hung up),
        which the caller must not leave to the watcher. As in ``wait``, the flag is set before the
        last look, so either the writer rings or the look finds its header."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        asleep[0] = 1
        _fence()
        if ready() or self._stopped or hung_up[0]:
            asleep[0] = 0
            return False
        return True

    def disarm(self, asleep: Any) -> None:
        """The doorbell is back from the watcher: the peer need not ring for every header any more
        (a receiver looks at the ring before it sleeps again)."""
        asleep[0] = 0
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass


class Bell:
    """The writing end: a copy of the peer's doorbell, and the peer's pidfd to wait for room on."""

    def __init__(self, pid: int, doorbell_fd: int) -> None:
        self.fd = take_fd(pid, doorbell_fd)
        self._pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:
            os.close(self.fd)
            raise
        self._poll = select.poll()
        self._poll.register(self._pidfd, select.POLLIN)
        weakref.finalize(self, _close_all, [self.fd, self._pidfd])

    def ring(self) -> None:
        """Wake the peer (it is asleep, or about to look again)."""
        try:
            os.write(self.fd, _ONE)
        except BlockingIOError:
            pass  # the counter is at its maximum: the peer has been rung already

    def wait_room(self, room: Callable[[], bool], give_up: Callable[[], bool], timeout: float | None) -> None:
        """Return once ``room()``; meanwhile sleep on the peer's pidfd in short, growing steps (the
        reader frees slots without ringing back: this wait is rare, the reader is at most a window of
        headers behind).

        Raises:
            LinkBroken: the peer's process ended.
            RuntimeError: ``give_up()`` (the link failed meanwhile) or ``timeout`` seconds passed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        step_ms = 0
        while not room():
            if give_up():
                raise RuntimeError("the link failed while waiting for room in the same-host ring")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.1f} s waiting for room in the same-host ring")
            if step_ms == 0:
                time.sleep(0)
            elif self._poll.poll(step_ms):
                if room():
                    return
                raise _peer_gone(self._pid)
            step_ms = min(2 * step_ms + 1, 10)
