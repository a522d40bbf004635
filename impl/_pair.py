"""The pair's own 2-rank gloo process group: how it is made, its tags, and its kill switch.

A process group per pair (not one for the whole world) keeps failures apart: when a peer dies only
its link breaks, and every other peer keeps working (gloo closes the whole context on an IO error).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._same_host import Rings, connect
from ._stores import ScrubbedAddresses

_log = logging.getLogger("twinrpc.impl")

TAG = 0  # header frames (and close frames)
DATA_TAG = 1  # payload and tensor frames up to the staging size, which follow their header in order
KILL_TAG = 2  # a receive posted on it never completes: waiting on it with a timeout closes the pair
LARGE_TAG = 3  # payload and tensor frames over the staging size (a receive of their exact size is posted)
#: the receiver's go-ahead for a LARGE_TAG frame (one byte): it has posted that frame's receive, so
#: the frame lands in place instead of in a buffer gloo makes for a frame no receive was posted for
READY_TAG = 4


class PairGroup:
    """What connecting to a peer made: the pair's gloo process group and the same-host rings (see
    ``_same_host``; both None between hosts)."""

    __slots__ = ("_store", "devices", "pg", "rings")

    def __init__(self, pg: Any, rings: Rings | None = None, store: Any = None, devices: Any = None) -> None:
        self.pg = pg
        self.rings = rings if rings is not None else Rings()
        #: the Python store under ``pg``: C++ holds it by a pointer that does not keep it alive
        self._store = store
        #: the shared gloo devices' generation (see SharedDevices): alive while a pair uses it
        self.devices = devices


class Pair:
    """One peer's end of the pair's process group: the group, the peer's rank in it, the same-host
    rings, and the kill switch that closes the pair's connection at once (see abandon)."""

    def __init__(self, group: PairGroup, me: int, peer: int) -> None:
        self.pg = group.pg
        self.rings = group.rings
        #: keeps the shared gloo devices in use (see SharedDevices)
        self._devices = group.devices
        #: the peer's rank in the 2-rank group (the lower global rank is 0)
        self.peer_rank = 1 if me < peer else 0
        #: the kill switch (see abandon): a receive nobody ever sends to
        self._kill_buf = torch.zeros(1, dtype=torch.uint8)
        self._kill_work: Any = None
        self._abandoned = False

    def arm(self) -> None:
        """Post the kill switch's receive (before the link's receivers start)."""
        try:
            self._kill_work = self.pg.recv([self._kill_buf], self.peer_rank, KILL_TAG)
        except RuntimeError:
            self._kill_work = None  # a pair broken from the start: the receiver reports it

    def release(self) -> None:
        """Let go of the pair's process group and the kill switch's receive (the link has ended and
        its threads have exited): gloo's threads and sockets for the pair end now, not when a garbage
        collection frees the link's parts (they refer to each other), and with the last pair the
        shared gloo device and its event-loop thread (SharedDevices)."""
        self.pg = None
        self._kill_work = None
        self._devices = None

    def abandon(self) -> None:
        """Close the pair's gloo connection now: every thread blocked in a send to or a receive from
        this peer wakes with an error. The pair's process group is unusable afterwards (gloo closes
        every pair of a context on an application timeout). A receiver sleeping on the same-host
        doorbell wakes too. Idempotent; blocks about 1 ms."""
        self.rings.stop()
        work = self._kill_work
        if work is None or self._abandoned:
            return
        self._abandoned = True
        try:
            work.wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass  # expected: "Timed out waiting 1ms for recv operation" (or the pair was closed already)


#: gloo applies a process group's timeout to every receive, including a receiver idling between
#: messages; RPC timeouts are the agent's business, and a dead peer shows as a closed connection.
_LINK_OP_TIMEOUT = timedelta(days=30)


def make_pair_group(store: Any, me: int, peer: int) -> PairGroup:
    """The 2-rank gloo process group of the pair (me, peer), over its own key prefix, and the
    same-host rings when both run on one host (``_same_host.connect``). Every pair group of the
    process shares one gloo device, so one event-loop thread serves all its pairs (SharedDevices;
    the loop runs at a lower priority, see LOOP_NICENESS), and starts no work threads of its own
    (WORK_THREADS). gloo's address entries go to the store scrubbed (``_stores.ScrubbedAddresses``)."""
    low, high = min(me, peer), max(me, peer)
    prefix = dist.PrefixStore(f"pair/{low}-{high}", store)  # type: ignore[attr-defined]
    scrubbed = ScrubbedAddresses(prefix)  # no uninitialised bytes of ours in the store
    devices = SHARED_DEVICES.get()
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = devices.devices
    options._threads = WORK_THREADS
    options._timeout = _LINK_OP_TIMEOUT
    pg = dist.ProcessGroupGloo(scrubbed, 0 if me == low else 1, 2, options)
    SHARED_DEVICES.used(devices)
    return PairGroup(pg, connect(prefix, me, peer), scrubbed, devices)


#: gloo's work threads per process group: they run collectives only (a send or a receive is carried
#: out by the device's event loop, and waited for by the thread that waits on its Work), and a
#: pair's group never runs one; gloo's default (2) would cost two idle threads per peer.
WORK_THREADS = 0


class _Devices:
    """The gloo devices of one generation (see SharedDevices): one per interface named by
    ``GLOO_SOCKET_IFNAME``, else gloo's default device, as ``ProcessGroupGloo`` picks them itself."""

    __slots__ = ("__weakref__", "devices", "loops_before", "pid")

    def __init__(self) -> None:
        self.pid = os.getpid()
        #: gloo's loop threads before these devices were made (None: theirs have been made nicer)
        self.loops_before: set[int] | None = _gloo_loop_threads()
        gloo = dist.ProcessGroupGloo  # type: ignore[attr-defined]
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        self.devices = (
            [gloo.create_device(interface=n) for n in names] if names else [gloo.create_default_device()]
        )


class SharedDevices:
    """The gloo devices all of a process's pair groups share: each device has one event-loop thread
    that serves every pair registered with it, where a device per group (gloo's default) costs a
    loop thread per peer. Each PairGroup and Pair holds its generation; once none is left (every
    link of a stopped world released), the next pair group makes new devices, so nothing keeps
    gloo's loop thread after the groups are gone. A forked child makes its own (the parent's loop thread does
    not exist in it). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: weakref.ref[_Devices] | None = None

    def get(self) -> _Devices:
        with self._lock:
            devices = self._current() if self._current is not None else None
            if devices is None or devices.pid != os.getpid():
                devices = _Devices()
                self._current = weakref.ref(devices)
        return devices

    def used(self, devices: _Devices) -> None:
        """A pair group has connected through ``devices``: their loop threads run by now (each takes
        its name when it starts), so make them LOOP_NICENESS nicer, once."""
        with self._lock:
            before, devices.loops_before = devices.loops_before, None
        if before is not None:
            _lower_priority(_gloo_loop_threads() - before)


SHARED_DEVICES = SharedDevices()


#: How much nicer than the process the event-loop thread of the pairs' shared gloo device runs. gloo's loop
#: waits on level-triggered epoll and only *try*-locks a pair to read from it: while another thread
#: holds that pair's lock (every send, and every receive posted, writes to the socket under it), the
#: loop returns at once and epoll reports the same readable socket again. A lock holder preempted in
#: its socket write (a loopback write wakes the peer, and with few cores the woken thread often takes
#: the holder's core) then has the loop spinning on epoll_wait for the rest of its time slice, taking
#: a core from the thread it waits for. At a lower priority the spinning loop yields to the holder;
#: a loop that sleeps in epoll until data arrives is still scheduled soon when it wakes (the scheduler
#: favours sleepers). The cost shows when other programs keep every core busy, steeply so at niceness
#: 19 (the figures: docs/explanation/benchmarks.md).
LOOP_NICENESS = 10


def _gloo_loop_threads() -> set[int]:
    """Native ids of this process's gloo event-loop threads (Linux; empty where /proc is missing)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return set()
    found = set()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="ascii", errors="replace") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    found.add(int(tid))
        except (OSError, ValueError):
            continue
    return found


def _lower_priority(tids: set[int]) -> None:
    """Make these threads LOOP_NICENESS nicer (best effort: raising niceness needs no privilege)."""
    for tid in tids:
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + LOOP_NICENESS))
        except OSError as exc:
            _log.debug("twinrpc: could not lower the priority of gloo loop thread %d: %s", tid, exc)
