"""The same-host data path: a link's payloads and tensor bytes through shared memory, when both ends
of the link run on one host.

Each direction of a link has a *ring*: an anonymous shared-memory file (``memfd_create``) that the
sending process creates and maps, and that the receiving process maps too, by opening it through
``/proc/<sender pid>/fd/<fd>`` once, at connection time. The sender copies a message's data into its
ring and sends only the header frame over gloo, with the data's positions in the ring; the receiver
copies the data out, in the order the headers arrive, and publishes how far it has read (the first
eight bytes of the file). Gloo keeps every control frame and stays the only path between hosts.

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
  used), and a process's rings together at most ``TWINRPC_SHM_MAX_BYTES`` (default 1 GiB); a link
  that would exceed it stays on gloo. A message that does not fit in the ring's free space right now
  goes over gloo as before: a sender never waits for ring space, so no new way to block appears.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import sys
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

_log = logging.getLogger("twinrpc.impl")

#: ``TWINRPC_SHM=0`` turns the same-host path off (every byte over gloo, as between hosts)
ENV_SWITCH = "TWINRPC_SHM"
ENV_RING_BYTES = "TWINRPC_SHM_RING_BYTES"
ENV_MAX_BYTES = "TWINRPC_SHM_MAX_BYTES"
_DEFAULT_RING_BYTES = 128 << 20
_DEFAULT_MAX_BYTES = 1 << 30
#: the smallest ring worth having (smaller budgets leave the link on gloo)
_MIN_RING_BYTES = 1 << 20
#: the file's first page: the receiver's read position (u64 at offset 0); the data starts after it
_CONTROL_BYTES = 4096
#: each piece of data starts on this boundary (cache lines; keeps tensor data aligned for copies)
_ALIGN = 64
#: how long discovery waits for the peer's offer and answer (it posts them right after the pair's
#: process group is made, which both ends finish together)
_ANSWER_WAIT = timedelta(seconds=30)
_OFFER = struct.Struct("<64sIiQ")  # host identity, pid, fd, file size
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
        self._read = np.frombuffer(mm, dtype=np.uint64, count=1)
        self._view = memoryview(mm)[_CONTROL_BYTES:]
        #: bytes placed so far (a position: the data at ``p`` lives at ``p % capacity``)
        self._head = 0
        #: gives the ring's bytes back to the budget once: at release, or when the ring is collected
        #: (a link dropped without being released must not keep the process's budget for ever)
        self._give_back = weakref.finalize(self, BUDGET.give_back, reserved)

    def offer(self) -> bytes:
        assert self.fd is not None
        return _OFFER.pack(host_identity(), os.getpid(), self.fd, _CONTROL_BYTES + self.capacity)

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

    def _plan(self, sizes: list[int]) -> tuple[list[int], int] | None:
        cap = self.capacity
        head = self._head
        free_from = int(self._read[0])
        if head == free_from:
            # all read: start again at the ring's start, whose pages are mapped and likely cached (a
            # request-reply pattern then reuses the same few pages instead of walking the whole ring).
            # The ring is empty, so the whole of it is free from there (the rest of this lap is not
            # in use: the reader's position passes it when it takes the piece at the start)
            if head % cap:
                head += cap - head % cap
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
        return positions, head

    def place(self, payload: bytes | None, tensors: list[torch.Tensor]) -> list[int] | None:
        """Copy ``payload`` (if given) and then each tensor's bytes into the ring; their positions, in
        that order, or None (nothing placed) when they do not all fit now."""
        sizes = [len(payload)] if payload is not None else []
        sizes += [t.numel() for t in tensors]
        plan = self._plan(sizes)
        if plan is None:
            return None
        positions, self._head = plan
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
                view[off : off + n] = t.numpy()  # type: ignore[call-overload]  # a contiguous uint8 buffer
            i += 1
        return positions


class InRing:
    """The receiving end of a peer's ring: copies data out, in order, and tells the sender how far it
    has read. Used by the link's dispatching receiver only (one reader at a time, in order)."""

    def __init__(self, offer: bytes) -> None:
        _host, pid, fd, size = _OFFER.unpack(offer)
        capacity = int(size) - _CONTROL_BYTES
        if capacity < _MIN_RING_BYTES:
            raise OSError(f"a ring of {capacity} B is too small")
        fd_here = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd_here).st_size != size:
                raise OSError(f"/proc/{pid}/fd/{fd} is not the offered {size} B ring")
            mm = mmap.mmap(fd_here, size)
        finally:
            os.close(fd_here)
        self.capacity = capacity
        self._read = np.frombuffer(mm, dtype=np.uint64, count=1)
        self._view = memoryview(mm)[_CONTROL_BYTES:]
        #: where the sender's next piece starts: it places pieces in order (OutRing._plan) and we take
        #: them in the same order, so any other position is a malformed header
        self._next = 0

    def _where(self, pos: int, n: int) -> int:
        """The offset of the ``n`` bytes at ``pos``, which must be where the sender put its next piece
        (else a header with a made-up position could read anything, move the read position the sender
        trusts past data not yet read, or beyond 2**64)."""
        expected = self._next
        step = _aligned(n)
        cap = self.capacity
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

    def take(self, pos: int, n: int, out: torch.Tensor) -> torch.Tensor:
        """Copy ``n`` bytes at ``pos`` into ``out`` (a fresh ``uint8`` tensor of ``n``) and release them."""
        off = self._where(pos, n)
        if n:
            np.copyto(out.numpy(), np.frombuffer(self._view[off : off + n], dtype=np.uint8))  # see place
        self._read[0] = pos + _aligned(n)
        return out

    def take_bytes(self, pos: int, n: int) -> bytes:
        """The ``n`` bytes at ``pos``, released."""
        off = self._where(pos, n)
        data = self._view[off : off + n].tobytes()
        self._read[0] = pos + _aligned(n)
        return data


@dataclass
class Rings:
    """A link's rings: ``out`` carries our data to the peer (None: our data goes over gloo), ``inbound``
    is the peer's ring we read from (None: the peer's data comes over gloo)."""

    out: OutRing | None = None
    inbound: InRing | None = None

    def release(self) -> None:
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
    never raises for a path that cannot be set up, only leaves that direction on gloo."""
    out: OutRing | None = None
    if enabled():
        size = BUDGET.take(_env_bytes(ENV_RING_BYTES, _DEFAULT_RING_BYTES))
        if size:
            try:
                out = OutRing(size, reserved=size)
            except OSError as exc:
                BUDGET.give_back(size)
                _log.debug("twinrpc: no shared-memory ring to rank %d: %s", peer, exc)
    rings = Rings(out)
    try:
        store.set(f"shm/{me}", out.offer() if out is not None else _NO_OFFER)
        store.wait([f"shm/{peer}"], _ANSWER_WAIT)
        offer = store.get(f"shm/{peer}")
        if _same_host_offer(offer):
            try:
                rings.inbound = InRing(offer)
            except (OSError, ValueError) as exc:
                _log.debug("twinrpc: cannot map the ring of rank %d: %s", peer, exc)
        store.set(f"shm-ok/{me}", b"1" if rings.inbound is not None else b"0")
        if out is not None:
            store.wait([f"shm-ok/{peer}"], _ANSWER_WAIT)
            if store.get(f"shm-ok/{peer}") != b"1":
                rings.out = None
                out.release()
    except RuntimeError as exc:  # the store did not answer in time: stay on gloo
        _log.debug("twinrpc: same-host discovery with rank %d failed: %s", peer, exc)
        if rings.out is not None:
            rings.out.release()
            rings.out = None
    if rings.out is not None:
        rings.out.close_fd()
    return rings
