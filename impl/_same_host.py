"""The same-host data path: a link's payloads and tensor bytes through shared memory, when both ends
of the link run on one host.

Each direction of a link has a *ring*: an anonymous shared-memory file (``memfd_create``) that the
sending process creates and maps, and that the receiving process maps too, by opening it through
``/proc/<sender pid>/fd/<fd>`` once, at connection time. The sender copies a message's data into its
ring and sends only the header frame over gloo, with the data's positions in the ring; the receiver
takes the data in the order the headers arrive and publishes how far the sender may write again (the
first eight bytes of the file). Gloo keeps every control frame and stays the only path between hosts.

* **Zero-copy receives.** A large storage (``ALIAS_MIN_BYTES`` and up) is received *in place*: the
  tensor is built over the receiver's mapping of the ring, and its bytes stay the tensor's until its
  storage is freed; only then does the published read position move past them. Storages are freed in
  any order, so the receiver keeps the spans freed ahead of the oldest one still held and publishes
  the contiguous freed prefix (``_Releases``). The sender writes only into room that position frees,
  so a received tensor never sees its bytes change. A program that keeps received tensors does not
  stall the link: a sender whose data does not fit the free room sends it over gloo, as it always
  did. (Copying rather than aliasing past some share of the ring would not help: the read position
  cannot pass the oldest storage still held, whatever is freed after it.) The payload and smaller
  storages are copied out and their room freed at once (see ``ALIAS_MIN_BYTES``). A tensor received
  in place cannot grow (``resize_``); ``TWINRPC_SHM_IN_PLACE=0`` copies every storage out instead.
  The mapping lives while any tensor over it does, after the link has ended or the peer has died.

* **Discovery** (``connect``, when a pair's process group is made): each end posts an *offer* in the
  pair's store keys (its host identity, pid, the memfd and its size), maps the peer's ring if the
  identities match and the file opens, and says whether it did. A sender uses its ring only once the
  receiver has said it mapped it; anything else (another host, another pid or network namespace, no
  ``memfd_create``, ``TWINRPC_SHM=0`` on either end, a peer that does not answer in
  ``_ANSWER_WAIT``) leaves that direction on gloo.
* **Nothing to leave behind.** A memfd has no name: the file exists while a process holds it open or
  mapped, so no segment outlives the processes, whatever ends them (shutdown, an exception, kill -9).
  The sender closes its own descriptor as soon as the peer has answered; each mapping (and the
  descriptor Python's ``mmap`` keeps with it) goes when the link ends.
* **Bounded memory.** A ring holds ``TWINRPC_SHM_RING_BYTES`` (default 128 MiB, touched only as it is
  used), and a process's rings together at most ``TWINRPC_SHM_MAX_BYTES`` (default 1 GiB); the data of
  a link that would exceed it stays on gloo, and its ring holds only the header slots (264 KiB, see
  ``_CONTROL_BYTES``), so its header frames still take the doorbell (``_doorbell``). A message that does not fit in the ring's free space right now
  goes over gloo as before: a sender never waits for ring space, so no new way to block appears.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from ._byte_view import byte_view
from ._doorbell import Bell, Doorbell, _fence
from ._doorbell import available as _doorbell_available
from ._peer_process import PeerProcess

_log = logging.getLogger("twinrpc.impl")

#: ``TWINRPC_SHM=0`` turns the same-host path off (every byte over gloo, as between hosts)
ENV_SWITCH = "TWINRPC_SHM"
ENV_RING_BYTES = "TWINRPC_SHM_RING_BYTES"
ENV_MAX_BYTES = "TWINRPC_SHM_MAX_BYTES"
#: ``TWINRPC_SHM_DOORBELL=0`` keeps the header frames on gloo while the data still takes the rings
ENV_DOORBELL = "TWINRPC_SHM_DOORBELL"
_DEFAULT_RING_BYTES = 128 << 20
_DEFAULT_MAX_BYTES = 1 << 30
#: the smallest ring worth having (smaller budgets leave the link on gloo)
_MIN_RING_BYTES = 1 << 20
#: header slots in a ring (the window of headers a writer may be ahead of its reader)
HEADER_SLOTS = 64
#: one header slot: a whole header frame (``_framing.HEADER_BYTES``, which checks that they agree)
SLOT_BYTES = 4096
#: the file's first page holds the counters, each on a cache line of its own: the receiver's read
#: position of the data (u64 at 0), headers written (u64 at 64, by the writer), headers taken (u64 at
#: 128, by the reader), the reader's *asleep* flag (u64 at 192, see ``_doorbell``) and the writer's
#: *hung up* flag (u64 at 256: it abandoned the link); the header slots follow it, then the data
_PAGE = 4096
_WRITTEN_AT, _TAKEN_AT, _ASLEEP_AT, _HUNG_UP_AT = 64, 128, 192, 256
_CONTROL_BYTES = _PAGE + HEADER_SLOTS * SLOT_BYTES
#: each piece of data starts on this boundary (cache lines; keeps tensor data aligned for copies)
_ALIGN = 64
#: how long discovery waits for the peer's offer and answer (it posts them right after the pair's
#: process group is made, which both ends finish together)
_ANSWER_WAIT = timedelta(seconds=30)
#: a storage at least this large is received in place (over the ring until freed, see the module
#: docstring). Smaller ones are copied: a storage received in place is often still held when the
#: next message is placed, so the sender cannot start again at the ring's start and walks the whole
#: ring through memory no cache holds; with 256 KiB storages that cost the distributed-autograd
#: iteration more CPU than the copies it saved (docs/explanation/benchmarks.md)
ALIAS_MIN_BYTES = 1 << 20
#: ``TWINRPC_SHM_IN_PLACE=0``: copy every storage out of the ring. A storage received in place is
#: shared memory, which torch cannot resize: ``resize_`` past its size (or an ``out=`` that must grow
#: it) raises "Trying to resize storage that is not resizable", where PyTorch's copy would resize
ENV_IN_PLACE = "TWINRPC_SHM_IN_PLACE"
_OFFER = struct.Struct("<64sIiQi")  # host identity, pid, fd, file size, doorbell fd (-1: none)
_NO_OFFER = b"-"


def _aligned(n: int) -> int:
    """The room ``n`` bytes take in a ring (each piece starts on an ``_ALIGN`` boundary)."""
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def enabled() -> bool:
    """Whether this process offers the same-host path (Linux with ``memfd_create``, not switched off)."""
    return (
        os.environ.get(ENV_SWITCH, "1").strip() != "0"
        and sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
    )


def doorbell_enabled() -> bool:
    """Whether this process sends and takes header frames through the rings (see ``_doorbell``)."""
    return os.environ.get(ENV_DOORBELL, "1").strip() != "0" and _doorbell_available()


class _Counters:
    """The words of a ring's first page (see ``_CONTROL_BYTES``), over its mapping."""

    def __init__(self, mm: mmap.mmap) -> None:
        words = np.frombuffer(mm, dtype=np.uint64, count=_PAGE // 8)
        self.read = words[0:1]
        self.written = words[_WRITTEN_AT // 8 : _WRITTEN_AT // 8 + 1]
        self.taken = words[_TAKEN_AT // 8 : _TAKEN_AT // 8 + 1]
        self.asleep = words[_ASLEEP_AT // 8 : _ASLEEP_AT // 8 + 1]
        self.hung_up = words[_HUNG_UP_AT // 8 : _HUNG_UP_AT // 8 + 1]


def host_identity() -> bytes:
    """Who can map this process's memfds through /proc: same boot, same pid and network namespaces
    (two network namespaces stand for two hosts in tests), same user."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append(os.uname().nodename)
    for ns in ("pid", "net"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("?")
    parts.append(str(os.getuid()))
    return "|".join(parts).encode()[:64]


def _env_bytes(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {text!r}")
    return value


class _Budget:
    """Ring bytes this process holds, against ``TWINRPC_SHM_MAX_BYTES``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.used = 0

    def take(self, want: int) -> int:
        """Reserve up to ``want`` bytes; returns what was reserved (0: not enough left)."""
        limit = _env_bytes(ENV_MAX_BYTES, _DEFAULT_MAX_BYTES)
        with self._lock:
            size = min(want, limit - self.used)
            if size < _MIN_RING_BYTES:
                return 0
            self.used += size
            return size

    def give_back(self, size: int) -> None:
        with self._lock:
            self.used -= size


BUDGET = _Budget()


class OutRing:
    """The sending end of a ring: places a message's data in it, in order, never waiting for space.

    Thread safety: ``place`` is called under the link's send lock only (one writer); the receiver
    only ever advances the read position.
    """

    def __init__(self, capacity: int, reserved: int = 0) -> None:
        """``reserved``: bytes of ``BUDGET`` taken for this ring, given back when it goes."""
        self.capacity = capacity
        self.fd: int | None = os.memfd_create("twinrpc-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, _CONTROL_BYTES + capacity)
            mm = mmap.mmap(self.fd, _CONTROL_BYTES + capacity)
        except OSError:
            os.close(self.fd)
            raise
        self._words = _Counters(mm)
        self._read = self._words.read
        self._slots = memoryview(mm)[_PAGE:_CONTROL_BYTES]
        self._view = memoryview(mm)[_CONTROL_BYTES:]
        #: the peer's doorbell (None: our header frames go over gloo); set by ``connect``
        self.bell: Bell | None = None
        #: header frames put in the slots so far (under the link's send lock)
        self._headers = 0
        #: bytes placed so far (a position: the data at ``p`` lives at ``p % capacity``)
        self._head = 0
        #: the last restart at the ring's start (see _plan): from the position where the ring ran
        #: empty to the start of the next lap; until the reader moves on from there, the bytes
        #: between are free, not a lap's worth of data still to read
        self._restart = (-1, -1)
        #: gives the ring's bytes back to the budget once: at release, or when the ring is collected
        #: (a link dropped without being released must not keep the process's budget for ever)
        self._give_back = weakref.finalize(self, BUDGET.give_back, reserved)

    def offer(self, doorbell_fd: int = -1) -> bytes:
        """What the peer needs to map this ring, and the doorbell it rings us with (-1: none)."""
        assert self.fd is not None
        return _OFFER.pack(host_identity(), os.getpid(), self.fd, _CONTROL_BYTES + self.capacity, doorbell_fd)

    def hang_up(self) -> None:
        """The link ends here without close frames (failed or abandoned): tell a peer that takes our
        header frames from this ring, as a closed gloo connection tells one that takes them there."""
        if self.bell is not None and not self._words.hung_up[0]:
            self._words.hung_up[0] = 1
            _fence()
            self.bell.ring()

    def header_room(self) -> bool:
        """Whether a header slot is free (the reader has taken all but fewer than HEADER_SLOTS)."""
        return self._headers - int(self._words.taken[0]) < HEADER_SLOTS

    def put_header(self, frame: memoryview) -> None:
        """Put one header frame in the next slot (there is room: ``header_room``), publish it, and
        ring the peer if it sleeps (see ``_doorbell``). Under the link's send lock."""
        n = self._headers
        off = (n % HEADER_SLOTS) * SLOT_BYTES
        self._slots[off : off + SLOT_BYTES] = frame
        self._headers = n + 1
        words = self._words
        words.written[0] = n + 1  # after the slot's bytes: x86 keeps stores in order
        _fence()
        if words.asleep[0]:
            assert self.bell is not None
            self.bell.ring()

    def close_fd(self) -> None:
        """The peer has opened the file (or never will): the mapping keeps it alive."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def release(self) -> None:
        """The link has ended: give the ring's bytes back to the budget (the mapping goes with the
        last reference to it)."""
        self.close_fd()
        self._give_back()

    def fits(self, sizes: list[int]) -> bool:
        """Whether data of these sizes would fit now (the same test ``place`` makes)."""
        return self._plan(sizes) is not None

    def _plan(self, sizes: list[int]) -> tuple[list[int], int, tuple[int, int] | None] | None:
        """Where pieces of these sizes would go now: their positions, the head after them, and the
        restart at the ring's start they make (None: none); None if they do not fit."""
        cap = self.capacity
        if not cap:  # header slots only
            return None
        head = self._head
        free_from = int(self._read[0])
        restart = None
        if free_from == self._restart[0]:
            free_from = self._restart[1]  # the reader has not taken the piece at the restart yet
        elif head == free_from:
            # all read: start again at the ring's start, whose pages are mapped and likely cached (a
            # request-reply pattern then reuses the same few pages instead of walking the whole ring).
            # The ring is empty, so the whole of it is free from there (the rest of this lap is not
            # in use: the reader's position passes it when it takes the piece at the start)
            if head % cap:
                restart = (head, head + cap - head % cap)
                head = restart[1]
            free_from = head
        positions = []
        for n in sizes:
            step = _aligned(n)
            off = head % cap
            if off + step > cap:  # it does not fit before the end: skip to the start
                head += cap - off
            positions.append(head)
            head += step
            if head - free_from > cap:
                return None
        return positions, head, restart

    def place(self, payload: bytes | None, tensors: list[torch.Tensor]) -> list[int] | None:
        """Copy ``payload`` (if given) and then each tensor's bytes into the ring; their positions, in
        that order, or None (nothing placed) when they do not all fit now."""
        sizes = [len(payload)] if payload is not None else []
        sizes += [t.numel() for t in tensors]
        plan = self._plan(sizes)
        if plan is None:
            return None
        positions, self._head, restart = plan
        if restart is not None:
            self._restart = restart
        cap = self.capacity
        i = 0
        if payload is not None:
            off = positions[0] % cap
            self._view[off : off + len(payload)] = payload
            i = 1
        view = self._view
        for t in tensors:
            n = t.numel()
            off = positions[i] % cap
            if n:
                # one memcpy on this thread: torch's copy_ splits a large copy over its intra-op
                # threads, which on a small busy machine makes it slower
                # (docs/explanation/benchmarks.md)
                view[off : off + n] = byte_view(
                    t
                )  # a contiguous uint8 buffer (not t.numpy(): see _byte_view)
            i += 1
        return positions


class InRing:
    """The receiving end of a peer's ring: copies data out, in order, and tells the sender how far it
    has read. Used by the link's dispatching receiver only (one reader at a time, in order)."""

    def __init__(self, offer: bytes) -> None:
        _host, pid, fd, size, _door = _OFFER.unpack(offer)
        capacity = int(size) - _CONTROL_BYTES
        if 0 < capacity < _MIN_RING_BYTES or capacity < 0:
            raise OSError(f"a ring of {capacity} B is too small")
        fd_here = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd_here).st_size != size:
                raise OSError(f"/proc/{pid}/fd/{fd} is not the offered {size} B ring")
            mm = mmap.mmap(fd_here, size)
        finally:
            os.close(fd_here)
        self.capacity = capacity
        self.pid = int(pid)
        self._words = _Counters(mm)
        self._read = self._words.read
        self._slots = memoryview(mm)[_PAGE:_CONTROL_BYTES]
        self._view = memoryview(mm)[_CONTROL_BYTES:]
        #: our doorbell for this ring (None: the peer's header frames come over gloo); set by ``connect``
        self.door: Doorbell | None = None
        #: where the sender's next piece starts: it places pieces in order (OutRing._plan) and we take
        #: them in the same order, so any other position is a malformed header
        self._next = 0
        #: what the sender may write again (a tensor over the ring holds this, not the ring itself:
        #: its doorbell and the rest go with the link)
        self._releases = _Releases(self._read)

    def _where(self, pos: int, n: int) -> int:
        """The offset of the ``n`` bytes at ``pos``, which must be where the sender put its next piece
        (else a header with a made-up position could read anything, move the read position the sender
        trusts past data not yet read, or beyond 2**64). The piece's span, from where the previous
        one ended (any room the sender skipped is freed with it), ends at ``self._next``."""
        expected = self._next
        step = _aligned(n)
        cap = self.capacity
        if not cap:
            raise ValueError(f"{n} B at ring position {pos} in a ring of header slots only")
        off = expected % cap
        lap = expected + (cap - off if off else 0)  # where the sender starts over (OutRing._plan)
        if pos == expected and off + step <= cap:
            pass
        elif pos == lap:  # it skipped the rest of the lap: its piece did not fit, or the ring was empty
            off = 0
        else:
            raise ValueError(
                f"{n} B at ring position {pos} are out of order (the sender's next piece starts at "
                f"{expected} or {lap})"
            )
        if off + n > cap:
            raise ValueError(f"{n} B at ring position {pos} overflow the {cap} B ring")
        self._next = pos + step
        return off

    def take(
        self, pos: int, n: int, new_buffer: Callable[[int], torch.Tensor], in_place: bool = True
    ) -> torch.Tensor:
        """The storage of ``n`` bytes at ``pos``, as a ``uint8`` tensor: over the ring itself when it
        is large enough (its span is freed when its storage is), else (or with ``in_place`` False)
        copied into ``new_buffer(n)``, its span freed now."""
        start = self._next
        off = self._where(pos, n)
        end = self._next
        releases = self._releases
        if in_place and n >= ALIAS_MIN_BYTES and os.environ.get(ENV_IN_PLACE) != "0":
            arr = np.frombuffer(self._view[off : off + n], dtype=np.uint8)
            key = id(arr)
            _IN_PLACE[key] = weakref.ref(arr)
            weakref.finalize(arr, _let_go, key, releases, start, end).atexit = False
            return torch.from_numpy(arr)
        out = new_buffer(n)
        if n:
            byte_view(out)[:] = self._view[off : off + n]  # one memcpy: see place
        releases.free(start, end)
        return out

    def wait_header(
        self, slot: int, until: float | None = None, stop: Callable[[], bool] | None = None
    ) -> bool:
        """Return True once the peer has written header ``slot`` (counting from 0), sleeping on the
        doorbell meanwhile; False: not written by ``until`` (monotonic; None: no bound), or ``stop()``
        held first (looked at whenever the sleeper wakes: ``Doorbell.nudge`` wakes it for that).
        Raises as ``Doorbell.wait`` does. One thread at a time, slots in order."""
        assert self.door is not None
        written = self._words.written

        def ready() -> bool:
            return int(written[0]) > slot or (stop is not None and stop())

        if not self.door.wait(ready, self._words.asleep, self._words.hung_up, until):
            return False
        return int(written[0]) > slot

    def has_news(self, slot: int) -> bool:
        """Whether a parked link needs a receiver now: header ``slot`` is written, the peer hung up,
        or the link was stopped here."""
        door = self.door
        return (
            int(self._words.written[0]) > slot or bool(self._words.hung_up[0]) or door is None or door.stopped
        )

    def arm(self, slot: int) -> bool:
        """Before the link's doorbell is parked (``_door_watch``): have the peer ring it for header
        ``slot``; False: ``has_news`` already (see ``Doorbell.arm``)."""
        assert self.door is not None
        written = self._words.written
        return self.door.arm(lambda: int(written[0]) > slot, self._words.asleep, self._words.hung_up)

    def disarm(self) -> None:
        """The link's doorbell is back from the watcher (see ``Doorbell.disarm``)."""
        if self.door is not None:
            self.door.disarm(self._words.asleep)

    def take_header(self, slot: int, out: memoryview) -> None:
        """Copy header ``slot`` (written: ``wait_header``) into ``out`` and free its slot for the writer.

        Raises:
            ValueError: the peer claims to have written past slots not taken yet (it overwrote them).
        """
        ahead = int(self._words.written[0]) - slot
        if not 0 < ahead <= HEADER_SLOTS:
            raise ValueError(
                f"the peer's header count is {ahead} ahead of header {slot} (at most {HEADER_SLOTS})"
            )
        off = (slot % HEADER_SLOTS) * SLOT_BYTES
        out[:SLOT_BYTES] = self._slots[off : off + SLOT_BYTES]
        self._words.taken[0] = slot + 1

    def take_bytes(self, pos: int, n: int) -> bytes:
        """The ``n`` bytes at ``pos``, released."""
        start = self._next
        off = self._where(pos, n)
        data = self._view[off : off + n].tobytes()
        self._releases.free(start, self._next)
        return data


#: the buffers under this process's tensors received in place, by ``id`` (see ``_ForkSnapshot``)
_IN_PLACE: dict[int, weakref.ref[np.ndarray]] = {}


def _let_go(key: int, releases: _Releases, start: int, end: int) -> None:
    """The storage of a tensor received in place was freed: its span is free again."""
    _IN_PLACE.pop(key, None)
    releases.free(start, end)


class _ForkSnapshot:
    """A process forked while it holds tensors received in place gets its own copy of their bytes,
    as it does of any other memory: the ring is shared, so once the parent freed such a tensor the
    peer could write over the child's. The parent copies the held pages before the fork (after it,
    the parent may free them and the peer write there before the child has copied anything); the
    child puts private pages with those bytes at the same addresses. Best effort: where ``mmap``
    with ``MAP_FIXED`` is refused, the child keeps the shared pages."""

    _PROT_RW = 0x1 | 0x2  # PROT_READ | PROT_WRITE
    _FLAGS = 0x02 | 0x20 | 0x10  # MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED

    def __init__(self) -> None:
        self._saved: list[tuple[int, bytes]] = []

    def before(self) -> None:
        spans = []
        for ref in list(_IN_PLACE.values()):
            arr = ref()
            if arr is not None and arr.nbytes:
                addr = arr.ctypes.data
                spans.append((addr // _PAGE * _PAGE, -(-(addr + arr.nbytes) // _PAGE) * _PAGE))
        merged: list[list[int]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._saved = [(lo, ctypes.string_at(lo, hi - lo)) for lo, hi in merged]

    def in_parent(self) -> None:
        self._saved = []

    def in_child(self) -> None:
        saved, self._saved = self._saved, []
        for lo, data in saved:
            if _mmap_fn is not None and _mmap_fn(lo, len(data), self._PROT_RW, self._FLAGS, -1, 0) == lo:
                ctypes.memmove(lo, data, len(data))


def _load_mmap() -> Any:
    """libc's ``mmap``, loaded now: a forked child must not load libraries (another thread may have
    held the loader's lock at the fork)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).mmap
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return fn


_mmap_fn = _load_mmap()


if hasattr(os, "register_at_fork"):
    _snapshot = _ForkSnapshot()
    os.register_at_fork(
        before=_snapshot.before, after_in_parent=_snapshot.in_parent, after_in_child=_snapshot.in_child
    )


class _Releases:
    """Which spans of a ring the receiver has freed, and the read position it publishes from them:
    the end of the contiguous freed prefix (spans are taken in order but freed in any order).

    ``free`` runs in whatever thread drops a tensor's last reference, a garbage collection included
    (possibly while this thread is inside ``free`` already): it queues the span without a lock, and
    whoever gets the lock, without waiting for it, merges every queued span; a thread that finds the
    lock taken leaves its span to the holder, which looks at the queue again after letting go.
    """

    def __init__(self, read: np.ndarray) -> None:
        self._read = read
        #: the published read position (the sender writes only below it plus the ring's size)
        self.published = int(read[0])
        #: start -> end of spans freed ahead of ``published``
        self._ahead: dict[int, int] = {}
        self._queued: collections.deque[tuple[int, int]] = collections.deque()
        self._lock = threading.Lock()
        #: a process forked from ours shares the mapping but not the link: its frees must not move
        #: the read position (the parent may still hold what the child let go of)
        self._pid = os.getpid()

    def free(self, start: int, end: int) -> None:
        """The span from ``start`` to ``end`` is free again (in this process: see ``_pid``)."""
        if os.getpid() != self._pid:
            return
        queued = self._queued
        queued.append((start, end))
        while queued and self._lock.acquire(blocking=False):
            try:
                ahead = self._ahead
                published = self.published
                while queued:
                    s, e = queued.popleft()
                    ahead[s] = e
                while published in ahead:
                    published = ahead.pop(published)
                if published != self.published:
                    self.published = published
                    self._read[0] = published
            finally:
                self._lock.release()


@dataclass
class Rings:
    """A link's rings: ``out`` carries our data to the peer (None: our data goes over gloo), ``inbound``
    is the peer's ring we read from (None: the peer's data comes over gloo)."""

    out: OutRing | None = None
    inbound: InRing | None = None
    #: the peer's process when it runs on this host (whatever path its data takes): a silent peer
    #: whose process still runs is slow, not dead (see ``_peer_process``)
    peer_process: PeerProcess | None = None

    def stop(self) -> None:
        """The link ends (see Pair.abandon): tell the peer (``OutRing.hang_up``), and wake a receiver
        sleeping on our doorbell, for good."""
        if self.out is not None:
            self.out.hang_up()
        inbound = self.inbound
        if inbound is not None and inbound.door is not None:
            inbound.door.stop()

    def release(self) -> None:
        self.stop()
        if self.out is not None:
            self.out.release()
        self.out = self.inbound = None


def _same_host_offer(offer: bytes) -> bool:
    """Whether ``offer`` is a ring this process may map (it offers the path itself, same host)."""
    if offer == _NO_OFFER or len(offer) != _OFFER.size or not enabled():
        return False
    return bool(_OFFER.unpack(offer)[0].rstrip(b"\0") == host_identity())


def connect(store: Any, me: int, peer: int) -> Rings:
    """Discover the same-host path with ``peer`` through the pair's store (see the module docstring);
    never raises for a path that cannot be set up, only leaves that direction (or its header frames)
    on gloo.

    Each end offers its ring and its doorbell, maps the peer's ring and takes a copy of the peer's
    doorbell, then answers two things: whether it mapped the peer's ring, and whether it will send
    its header frames through its own ring (it has the peer's doorbell). A direction carries header
    frames in its ring only when both hold."""
    out: OutRing | None = None
    door: Doorbell | None = None
    if enabled():
        size = BUDGET.take(_env_bytes(ENV_RING_BYTES, _DEFAULT_RING_BYTES))
        if size:
            try:
                out = OutRing(size, reserved=size)
            except OSError as exc:
                BUDGET.give_back(size)
                _log.debug("twinrpc: no shared-memory ring to rank %d: %s", peer, exc)
        elif doorbell_enabled():  # beyond the budget: the header frames still take a ring of slots
            try:
                out = OutRing(0)
            except OSError as exc:
                _log.debug("twinrpc: no header ring to rank %d: %s", peer, exc)
        if doorbell_enabled():
            try:
                door = Doorbell()
            except OSError as exc:
                _log.debug("twinrpc: no doorbell for rank %d: %s", peer, exc)
    rings = Rings(out)
    bell: Bell | None = None
    try:
        store.set(f"shm/{me}", out.offer(door.fd if door else -1) if out is not None else _NO_OFFER)
        store.wait([f"shm/{peer}"], _ANSWER_WAIT)
        offer = store.get(f"shm/{peer}")
        if _same_host_offer(offer):
            _, pid, _, _, peer_door = _OFFER.unpack(offer)
            rings.peer_process = PeerProcess.of(pid)
            try:
                rings.inbound = InRing(offer)
            except (OSError, ValueError) as exc:
                _log.debug("twinrpc: cannot map the ring of rank %d: %s", peer, exc)
            if out is not None and peer_door >= 0 and doorbell_enabled():
                try:
                    bell = Bell(pid, peer_door)
                except OSError as exc:
                    _log.debug("twinrpc: cannot take the doorbell of rank %d: %s", peer, exc)
        answer = (b"1" if rings.inbound is not None else b"0") + (b"1" if bell is not None else b"0")
        store.set(f"shm-ok/{me}", answer)
        store.wait([f"shm-ok/{peer}"], _ANSWER_WAIT)
        peer_answer = store.get(f"shm-ok/{peer}")
        if out is not None and (peer_answer[:1] != b"1" or (bell is None and not out.capacity)):
            rings.out = None
            out.release()
        elif out is not None and bell is not None:
            out.bell = bell  # our header frames go through our ring
        if rings.inbound is not None and door is not None and peer_answer[1:2] == b"1":
            door.watch(rings.inbound.pid)
            rings.inbound.door = door  # the peer's header frames come through its ring
        elif rings.inbound is not None and not rings.inbound.capacity:
            rings.inbound = None  # header slots only, and the peer's header frames go over gloo
    except (RuntimeError, OSError) as exc:  # the store did not answer in time: stay on gloo
        _log.debug("twinrpc: same-host discovery with rank %d failed: %s", peer, exc)
        if rings.out is not None:
            rings.out.release()
            rings.out = None
        if rings.inbound is not None:
            rings.inbound.door = None
    if rings.out is not None:
        rings.out.close_fd()
    return rings
