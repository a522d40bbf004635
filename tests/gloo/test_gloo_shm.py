"""The gloo world's same-host path (impl/_same_host.py, impl/_doorbell.py): header frames and data
through a shared-memory ring per direction, the reader woken by a doorbell, discovered per link,
falling back to gloo, and nothing left behind.

Unit tests of the rings and the header format, a live pair of links in one process, and worlds of
spawned processes for shutdown and for a peer's kill -9.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _gloo_pair import Inbox, close_links, make_links, started_links
from _spawn_world import report, run_world
from hypothesis import given, settings
from hypothesis import strategies as st
from twinrpc.impl import _same_host
from twinrpc.impl._doorbell import Bell, Doorbell
from twinrpc.impl._framing import (
    FLAG_INLINE_TENSORS,
    FLAG_SHM,
    HEADER_BYTES,
    FrameError,
    Header,
    encode_header,
)
from twinrpc.impl._link_state import LinkBroken
from twinrpc.impl._same_host import HEADER_SLOTS, InRing, OutRing, Rings

from twinrpc._message import Kind, Message

RING_NAME = "twinrpc-ring"


@pytest.fixture(autouse=True)
def _path_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the path: on, whatever the run's TWINRPC_SHM (CI also runs the gloo tests
    with it off); a test that wants it off sets it again."""
    monkeypatch.setenv("TWINRPC_SHM", "1")


WORLD_TIMEOUT = 120.0


def _ring_handles() -> tuple[int, int]:
    """This process's mappings of ring files and open descriptors of them (after collecting garbage:
    rings of earlier links that nothing references any more)."""
    gc.collect()
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        maps = sum(RING_NAME in line for line in f)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += RING_NAME in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return maps, fds


def _doorbell_fds() -> int:
    """This process's open eventfds and pidfds (a link's doorbell, its copy of the peer's, and the
    pidfds that watch the peer)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") in ("anon_inode:[eventfd]", "anon_inode:[pidfd]")
        except OSError:
            continue
    return n


def _named_segments() -> set[str]:
    """twinrpc's entries in /dev/shm (other programs' come and go meanwhile)."""
    return {name for name in os.listdir("/dev/shm") if "twinrpc" in name}


def _pair_of_rings(capacity: int = 1 << 20) -> tuple[OutRing, InRing]:
    out = OutRing(capacity)
    inbound = InRing(out.offer())
    out.close_fd()
    return out, inbound


def _fresh(n: int) -> torch.Tensor:
    """A buffer to copy a piece of the ring into."""
    return torch.empty(n, dtype=torch.uint8)


def _message(payload: bytes, *sizes: int) -> Message:
    tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    return Message(Kind.CALL, 7, 0, 1, payload, tensors)


# -- the rings ---------------------------------------------------------------------------------------
def test_a_ring_gives_back_exactly_what_was_placed_across_wrap_arounds() -> None:
    out, inbound = _pair_of_rings(1 << 20)
    for round_ in range(12):  # 12 x ~300 KB through a 1 MiB ring: wraps several times
        payload = bytes([round_]) * 1000
        tensors = [
            torch.full((300_000 + round_,), round_, dtype=torch.uint8),
            torch.arange(17, dtype=torch.uint8),
        ]
        positions = out.place(payload, tensors)
        assert positions is not None
        assert inbound.take_bytes(positions[0], len(payload)) == payload
        for pos, t in zip(positions[1:], tensors, strict=True):
            got = inbound.take(pos, t.numel(), _fresh, in_place=False)
            assert torch.equal(got, t)


def test_a_full_ring_refuses_without_placing_and_takes_again_once_read() -> None:
    out, inbound = _pair_of_rings(1 << 20)
    first = out.place(None, [torch.ones(700_000, dtype=torch.uint8)])
    assert first is not None
    big = [torch.ones(700_000, dtype=torch.uint8)]
    assert not out.fits([700_000])
    assert out.place(None, big) is None  # the sender never waits for room: the caller uses gloo
    inbound.take(first[0], 700_000, _fresh, in_place=False)
    assert out.place(None, big) is not None
    assert out.place(None, [torch.ones(2 << 20, dtype=torch.uint8)]) is None  # larger than the ring


def test_an_emptied_ring_takes_a_piece_as_large_as_the_ring_whatever_came_before() -> None:
    # A small piece leaves the sender mid-lap; once it is read the ring is empty, so the next piece
    # may be as large as the whole ring (the sender starts again at the ring's start). It once had to
    # fit in what the small piece left behind, so a large message after a small one went over gloo.
    out, inbound = _pair_of_rings(1 << 20)
    for small, large in ((100, 600_000), (300_000, 1 << 20), (64, (1 << 20) - 64)):
        pos = out.place(None, [torch.ones(small, dtype=torch.uint8)])
        assert pos is not None
        inbound.take(pos[0], small, _fresh, in_place=False)
        data = torch.randint(0, 255, (large,), dtype=torch.uint8)
        where = out.place(None, [data])
        assert where is not None, f"{large} B after {small} B did not fit an empty {1 << 20} B ring"
        assert torch.equal(inbound.take(where[0], large, _fresh, in_place=False), data)


def test_a_ring_restarted_at_its_start_takes_more_before_the_first_piece_is_read() -> None:
    """A ring that ran empty mid-lap starts again at its start; the rest of that lap is free, so a
    second message placed before the reader took the first still fits (a sender that does not wait
    for its reader, as with the doorbell, places several messages ahead)."""
    out, inbound = _pair_of_rings(1 << 20)
    first = torch.full((300_000,), 1, dtype=torch.uint8)
    [pos] = out.place(None, [first]) or [None]
    inbound.take(pos, 300_000, _fresh, in_place=False)  # empty, mid-lap
    pieces = [torch.full((300_000,), i, dtype=torch.uint8) for i in (2, 3, 4)]
    placed = [out.place(None, [t]) for t in pieces]
    assert all(p is not None for p in placed), placed
    assert out.place(None, [first]) is None  # the ring's 1 MiB is taken now
    for t, p in zip(pieces, placed, strict=True):
        assert p is not None
        got = inbound.take(p[0], 300_000, _fresh, in_place=False)
        assert torch.equal(got, t)


# -- storages received in place ---------------------------------------------------------------------
def _ring_ranges() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of ring files."""
    ranges = []
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        for line in f:
            if RING_NAME in line:
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def _over_a_ring(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are a ring's (received in place), not a copy."""
    ptr = t.data_ptr()
    return any(lo <= ptr and ptr + t.nbytes <= hi for lo, hi in _ring_ranges())


def _read_position(out: OutRing) -> int:
    """The read position the receiver has published to the sender (the ring's first word)."""
    return int(out._read[0])


#: storages from this size are received in place in the ring tests below (small enough that a 1 MiB
#: ring holds several; the product's threshold is ``_same_host.ALIAS_MIN_BYTES``)
LARGE = 64 << 10


@pytest.fixture
def in_place_from_large(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_same_host, "ALIAS_MIN_BYTES", LARGE)


def test_a_large_storage_is_received_over_the_ring_and_frees_its_room_only_when_freed(
    in_place_from_large: None,
) -> None:
    out, inbound = _pair_of_rings(1 << 20)
    data = torch.randint(0, 255, (LARGE,), dtype=torch.uint8)
    [pos] = out.place(None, [data]) or [None]
    got = inbound.take(pos, LARGE, _fresh)
    assert _over_a_ring(got) and torch.equal(got, data)
    assert _read_position(out) == 0 and not out.fits([1 << 20])  # held: the sender keeps off it
    got[0] = got[0] + 1  # the program's own, writable
    del got
    assert _read_position(out) == LARGE and out.fits([1 << 20])


def test_a_storage_below_the_threshold_is_copied_and_frees_its_room_at_once() -> None:
    small = _same_host.ALIAS_MIN_BYTES - 1
    out, inbound = _pair_of_rings(4 << 20)
    data = torch.randint(0, 255, (small,), dtype=torch.uint8)
    [pos] = out.place(None, [data]) or [None]
    got = inbound.take(pos, small, _fresh)
    assert not _over_a_ring(got) and torch.equal(got, data)
    assert _read_position(out) == _same_host.ALIAS_MIN_BYTES  # its aligned span


@given(order=st.permutations(range(6)))
@settings(max_examples=40, deadline=None)
def test_storages_freed_in_any_order_publish_the_end_of_the_freed_prefix(order: list[int]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_same_host, "ALIAS_MIN_BYTES", LARGE)
        _free_in_order(order)


def _free_in_order(order: list[int]) -> None:
    out, inbound = _pair_of_rings(4 << 20)
    sizes = [LARGE + 1000 * i for i in range(6)]
    positions = out.place(None, [torch.full((n,), i, dtype=torch.uint8) for i, n in enumerate(sizes)])
    assert positions is not None
    held: dict[int, torch.Tensor] = {
        i: inbound.take(pos, n, _fresh) for i, (pos, n) in enumerate(zip(positions, sizes, strict=True))
    }
    assert all(_over_a_ring(t) for t in held.values())
    ends = [pos + (n + 63) // 64 * 64 for pos, n in zip(positions, sizes, strict=True)]
    freed: set[int] = set()
    for i in order:
        del held[i]
        freed.add(i)
        prefix = next(j for j in range(7) if j not in freed)
        assert _read_position(out) == (ends[prefix - 1] if prefix else 0)
        assert all(torch.all(t == j) for j, t in held.items())


def test_a_forked_child_freeing_a_storage_does_not_free_its_room_for_the_parent(
    in_place_from_large: None,
) -> None:
    out, inbound = _pair_of_rings(1 << 20)
    [pos] = out.place(None, [torch.ones(LARGE, dtype=torch.uint8)]) or [None]
    kept = inbound.take(pos, LARGE, _fresh)
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the reference, collects, and leaves
        code = 0
        try:
            del kept
            gc.collect()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _read_position(out) == 0 and torch.all(kept == 1)  # still the parent's
    del kept
    assert _read_position(out) == LARGE


def test_a_forked_child_keeps_the_bytes_of_a_storage_the_parent_frees_and_the_peer_overwrites(
    in_place_from_large: None,
) -> None:
    out, inbound = _pair_of_rings(1 << 20)
    [pos] = out.place(None, [torch.full((LARGE,), 7, dtype=torch.uint8)]) or [None]
    kept = inbound.take(pos, LARGE, _fresh)
    go_on, done = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # waits until the parent freed the storage and the peer wrote over its room
        code = 1
        try:
            os.read(go_on[0], 1)
            code = 0 if bool((kept.numpy() == 7).all()) else 2  # no torch kernel after a fork
        finally:
            os._exit(code)
    del kept
    again = out.place(None, [torch.full((1 << 20,), 9, dtype=torch.uint8)])  # the whole ring
    assert again is not None
    os.write(go_on[1], b"x")
    _, status = os.waitpid(pid, 0)
    for fd in (*go_on, *done):
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_kept_storage_never_changes_while_later_pieces_flow_and_the_sender_falls_back(
    in_place_from_large: None,
) -> None:
    import random

    out, inbound = _pair_of_rings(1 << 20)
    rng = random.Random(32)
    [pos] = out.place(None, [torch.randint(0, 255, (LARGE,), dtype=torch.uint8)]) or [None]
    kept = inbound.take(pos, LARGE, _fresh)
    assert _over_a_ring(kept)
    expected = kept.clone()
    placed = refused = 0
    for _ in range(300):
        n = rng.randrange(1, 300_000)
        data = torch.randint(0, 255, (n,), dtype=torch.uint8)
        where = out.place(None, [data])
        if where is None:  # no room left beside the kept storage: the caller sends over gloo
            refused += 1
        else:
            placed += 1
            assert torch.equal(inbound.take(where[0], n, _fresh), data)
        assert torch.equal(kept, expected)
    assert placed and refused
    del kept
    assert out.place(None, [torch.ones(1 << 20, dtype=torch.uint8)]) is not None  # all free again


def test_a_position_outside_the_ring_is_refused() -> None:
    _, inbound = _pair_of_rings(1 << 20)
    with pytest.raises(ValueError, match="overflow"):
        inbound.take_bytes(0, (1 << 20) + 1)


def test_a_position_other_than_where_the_sender_put_its_next_piece_is_refused() -> None:
    out, inbound = _pair_of_rings(1 << 20)
    first, second = out.place(b"a" * 100, [torch.ones(1000, dtype=torch.uint8)]) or []
    with pytest.raises(ValueError, match="out of order"):
        inbound.take_bytes(second, 1000)  # the payload at ``first`` comes first
    with pytest.raises(ValueError, match="out of order"):
        inbound.take_bytes(2**64 - 100, 100)  # where no sender puts anything
    assert inbound.take_bytes(first, 100) == b"a" * 100


def test_an_offer_from_another_host_is_not_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    out = OutRing(1 << 20)
    try:
        offer = out.offer()
        assert _same_host._same_host_offer(offer)
        monkeypatch.setattr(_same_host, "host_identity", lambda: b"another-boot|1|2|0")
        assert not _same_host._same_host_offer(offer)
        monkeypatch.setenv("TWINRPC_SHM", "0")
        assert not _same_host._same_host_offer(offer)
    finally:
        out.release()


# -- the header ----------------------------------------------------------------------------------------
def _header_with_ring(msg: Message, ring: OutRing) -> tuple[memoryview, Header]:
    t = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    view = memoryview(t.numpy())
    assert encode_header(view, msg, ring=ring) == (True, True)  # nothing follows the header
    return view, Header(view, 0, 1, t)


def test_a_header_carries_ring_positions_for_payload_and_storages() -> None:
    out, inbound = _pair_of_rings()
    msg = _message(b"p" * 9000, 5000, 0, 70_000)
    _, header = _header_with_ring(msg, out)
    assert header.positions is not None and header.inline_payload is None
    assert header.sizes == [5000, 0, 70_000]
    assert inbound.take_bytes(header.positions[0], header.payload_len) == msg.payload
    for pos, t in zip(header.positions[1:], msg.tensors, strict=True):
        assert torch.equal(inbound.take(pos, t.numel(), _fresh, in_place=False), t)


def test_a_small_payload_stays_inline_beside_ring_storages() -> None:
    out, _ = _pair_of_rings()
    _, header = _header_with_ring(_message(b"small", 100_000), out)
    assert header.inline_payload == b"small"
    assert header.positions is not None and len(header.positions) == 2


def test_a_whole_message_does_not_use_the_ring() -> None:
    out, _ = _pair_of_rings()
    t = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    encode_header(memoryview(t.numpy()), _message(b"tiny", 10), ring=out)
    assert Header(memoryview(t.numpy()), 0, 1, t).positions is None


def test_a_ring_header_that_also_claims_inline_storages_is_malformed() -> None:
    out, _ = _pair_of_rings()
    view, _ = _header_with_ring(_message(b"", 100_000), out)
    flags = int.from_bytes(view[6:8], "little")
    view[6:8] = (flags | FLAG_SHM | FLAG_INLINE_TENSORS).to_bytes(2, "little")
    with pytest.raises(FrameError, match="shared-memory header"):
        Header(view, 0, 1)


# -- the doorbell ------------------------------------------------------------------------------------
def _ring_with_doorbell() -> tuple[OutRing, InRing]:
    """A ring whose header frames go through its slots, with a doorbell, both ends in this process."""
    out, inbound = _pair_of_rings()
    door = Doorbell()
    inbound.door = door
    out.bell = Bell(os.getpid(), door.fd)
    return out, inbound


def _frame(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * HEADER_BYTES)


def test_a_sleeping_reader_is_woken_for_every_header_and_takes_them_in_order() -> None:
    """A writer thread puts headers while the reader sleeps between them and while it is busy: no
    wake-up is lost (each wait returns), and every header is the one put in that slot."""
    out, inbound = _ring_with_doorbell()
    n = 5 * HEADER_SLOTS
    got: list[int] = []
    buf = memoryview(bytearray(HEADER_BYTES))

    def write() -> None:
        for i in range(n):
            while not out.header_room():
                time.sleep(0.0001)
            out.put_header(_frame(i))
            if i % 7 == 0:
                time.sleep(0.001)  # the reader runs dry and sleeps

    writer = threading.Thread(target=write)
    writer.start()
    for slot in range(n):
        inbound.wait_header(slot)
        inbound.take_header(slot, buf)
        got.append(buf[0])
    writer.join(10)
    assert got == [i % 256 for i in range(n)]


def test_a_writer_never_overwrites_a_slot_not_taken() -> None:
    out, inbound = _ring_with_doorbell()
    for i in range(HEADER_SLOTS):
        assert out.header_room()
        out.put_header(_frame(i))
    assert not out.header_room()
    inbound.take_header(0, memoryview(bytearray(HEADER_BYTES)))
    assert out.header_room()


def test_a_header_count_beyond_the_window_is_refused() -> None:
    """A peer that claims more headers than there are slots overwrote some: refused, not read."""
    _, inbound = _ring_with_doorbell()
    inbound._words.written[0] = HEADER_SLOTS + 1
    with pytest.raises(ValueError, match="ahead"):
        inbound.take_header(0, memoryview(bytearray(HEADER_BYTES)))


def test_a_reader_wakes_with_an_error_when_the_writer_hangs_up_or_the_link_stops() -> None:
    out, inbound = _ring_with_doorbell()
    out.put_header(_frame(1))
    out.hang_up()
    inbound.wait_header(0)  # what came before the hang-up is still read
    with pytest.raises(LinkBroken, match="closed without a close frame"):
        inbound.wait_header(1)
    _, inbound = _ring_with_doorbell()
    assert inbound.door is not None
    timer = threading.Timer(0.05, inbound.door.stop)
    timer.start()
    with pytest.raises(RuntimeError, match="closed while waiting"):
        inbound.wait_header(0)


def test_a_reader_wakes_with_an_error_when_the_writer_process_dies() -> None:
    """The doorbell's poll watches the peer's pidfd: a kill -9 wakes a sleeping reader."""
    _, inbound = _ring_with_doorbell()
    door = inbound.door
    assert door is not None
    child = subprocess.Popen(["sleep", "60"])
    door.watch(child.pid)
    threading.Timer(0.05, child.kill).start()
    with pytest.raises(LinkBroken, match=f"process {child.pid} end"):
        inbound.wait_header(0)
    child.wait()


# -- a live pair of links --------------------------------------------------------------------------------
SIZES = [0, 1, 3000, 5000, 300_000, 1 << 20, (1 << 20) + 1, 5 << 20]


def _exchange(sender: Any, inbox: Inbox) -> None:
    for i, n in enumerate(SIZES):
        msg = Message(
            Kind.CALL,
            i,
            0,
            1,
            bytes([i % 256]) * (i * 2500),
            [torch.randint(0, 255, (n,), dtype=torch.uint8)],
        )
        sender.send(msg)
        got = inbox.wait_for(i + 1)[-1]
        assert got.id == i and got.payload == msg.payload
        assert torch.equal(got.tensors[0], msg.tensors[0])


def test_a_link_on_one_host_moves_data_through_its_rings() -> None:
    with started_links() as (sender, listener, inbox):
        assert sender.same_host == (True, True) and listener.same_host == (True, True)
        _exchange(sender, inbox)
        assert sender.sender.headers_sent >= len(SIZES)


class _CountingGroup:
    """A pair's process group that counts the sends and receives made through it."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self.calls: list[str] = []

    def send(self, tensors: Any, dst: int, tag: int) -> Any:
        self.calls.append(f"send tag {tag}")
        return self._pg.send(tensors, dst, tag)

    def recv(self, tensors: Any, src: int, tag: int) -> Any:
        self.calls.append(f"recv tag {tag}")
        return self._pg.recv(tensors, src, tag)


def test_on_one_host_messages_both_ways_make_no_gloo_call() -> None:
    """Header frames take the ring's slots and the doorbell wakes the reader: with data that fits
    the ring, neither side sends, or posts a receive, on the pair's gloo group."""
    failures: list[BaseException] = []
    inbox, back = Inbox(), Inbox()
    sender, listener = make_links(inbox, failures, back)
    groups = []
    for link in (sender, listener):
        assert link.pair.rings.out is not None and link.pair.rings.out.bell is not None
        assert link.pair.rings.inbound is not None and link.pair.rings.inbound.door is not None
        group = _CountingGroup(link.pg)
        link.sender._pg = link.receiver._pg = group
        groups.append(group)
    sender.start()
    listener.start()
    try:
        for i in range(200):  # more than the header slots: the window goes round
            payload = bytes([i % 256]) * (i * 40)
            tensors = [torch.full((i * 1000,), i % 256, dtype=torch.uint8)]
            sender.send(Message(Kind.CALL, i, 0, 1, payload, tensors))
            listener.send(Message(Kind.RESPONSE, i, 1, 0, payload))
        got, got_back = inbox.wait_for(200), back.wait_for(200)
        assert [m.id for m in got] == [m.id for m in got_back] == list(range(200))
        assert all(
            torch.equal(m.tensors[0], torch.full((m.id * 1000,), m.id % 256, dtype=torch.uint8)) for m in got
        )
        assert HEADER_SLOTS < 200
    finally:
        close_links(sender, listener)
    assert [g.calls for g in groups] == [[], []]
    assert not failures


def test_with_the_doorbell_off_headers_go_over_gloo_and_data_through_the_rings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TWINRPC_SHM_DOORBELL", "0")
    with started_links() as (sender, _, inbox):
        assert sender.same_host == (True, True)
        assert sender.pair.rings.out is not None and sender.pair.rings.out.bell is None
        _exchange(sender, inbox)


def test_with_the_path_off_the_same_messages_arrive_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINRPC_SHM", "0")
    with started_links() as (sender, _, inbox):
        assert sender.same_host == (False, False)
        _exchange(sender, inbox)


def test_data_larger_than_the_ring_falls_back_to_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINRPC_SHM_RING_BYTES", str(1 << 20))
    with started_links() as (sender, _, inbox):
        assert sender.same_host == (True, True)
        _exchange(sender, inbox)  # 5 MiB goes in data frames, the rest through the ring


def test_a_received_large_tensor_is_the_ring_s_bytes_until_freed() -> None:
    with started_links() as (sender, _, inbox):
        data = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        sender.send(Message(Kind.CALL, 1, 0, 1, b"p", [data]))
        [got] = inbox.wait_for(1)
        assert _over_a_ring(got.tensors[0]) and torch.equal(got.tensors[0], data)
        out = sender.pair.rings.out
        assert out is not None and _read_position(out) == 0
        inbox.got.clear()
        del got
        assert _read_position(out) > 0


def test_keeping_received_tensors_does_not_stall_a_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """100 received 1 MiB tensors kept through a 16 MiB ring: those received in place fill the ring,
    the sender sends over gloo what no longer fits, and no kept tensor changes."""
    monkeypatch.setenv("TWINRPC_SHM_RING_BYTES", str(16 << 20))
    with started_links() as (sender, _, inbox):
        assert sender.same_host == (True, True)
        for i in range(100):
            sender.send(Message(Kind.CALL, i, 0, 1, b"p", [torch.full((1 << 20,), i, dtype=torch.uint8)]))
        got = inbox.wait_for(100)
        assert [m.id for m in got] == list(range(100))
        assert all(torch.all(m.tensors[0] == m.id) for m in got)
        in_place = sum(_over_a_ring(m.tensors[0]) for m in got)
        assert 1 <= in_place <= 16
        for i in range(100, 140):  # more traffic while they are kept
            sender.send(
                Message(Kind.CALL, i, 0, 1, b"p", [torch.full((1 << 20,), i % 256, dtype=torch.uint8)])
            )
        later = inbox.wait_for(140)[100:]
        assert all(torch.all(m.tensors[0] == m.id % 256) for m in later)
        assert all(torch.all(m.tensors[0] == m.id) for m in got)


def test_rings_beyond_the_process_budget_stay_on_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINRPC_SHM_MAX_BYTES", str(1 << 19))  # less than the smallest ring
    with started_links() as (sender, _, inbox):
        assert sender.same_host == (False, False)
        _exchange(sender, inbox)


def test_a_closed_link_leaves_no_mapping_and_no_descriptor() -> None:
    before = _ring_handles()
    bells_before = _doorbell_fds()
    failures: list[BaseException] = []
    inbox = Inbox()
    sender, listener = make_links(inbox, failures)
    maps, _ = _ring_handles()
    assert maps == before[0] + 4  # each side maps its ring and the peer's
    # each side: its doorbell, its copy of the peer's, and a pidfd of the peer with each
    assert _doorbell_fds() == bells_before + 8
    sender.start()
    listener.start()
    sender.send(_message(b"x", 200_000))
    inbox.wait_for(1)
    close_links(sender, listener)
    sender.join_threads(5.0)
    listener.join_threads(5.0)
    del sender, listener, inbox
    assert _ring_handles() == before
    assert _doorbell_fds() == bells_before
    assert not failures


def test_rings_of_a_failed_link_are_released() -> None:
    before = _ring_handles()
    bells_before = _doorbell_fds()
    failures: list[BaseException] = []
    inbox = Inbox()
    sender, listener = make_links(inbox, failures)
    sender.start()
    listener.start()
    sender.send(_message(b"x", 200_000))
    inbox.wait_for(1)
    # the program lets go of what it received (the failures' tracebacks reach the inbox, and a kept
    # tensor keeps the ring it was received in mapped: see the test with a killed peer)
    inbox.got.clear()
    sender.fail(RuntimeError("test: the link broke"))  # closes the pair: the listener fails too
    assert sender.same_host == (False, False)
    deadline = time.monotonic() + 10
    while listener.same_host != (False, False) and time.monotonic() < deadline:
        time.sleep(0.01)  # the listener fails once gloo reports the closed pair, then lets go
    assert listener.failed is not None and listener.same_host == (False, False)
    for link in (sender, listener):
        link.join(5.0)
        link.join_threads(5.0)
    del sender, listener, inbox
    assert _ring_handles() == before
    assert _doorbell_fds() == bells_before
    assert len(failures) == 2


def test_a_ring_gives_its_budget_back_once_whether_released_or_dropped() -> None:
    used = _same_host.BUDGET.used
    reserved = _same_host.BUDGET.take(1 << 20)
    ring = OutRing(1 << 20, reserved=reserved)
    assert _same_host.BUDGET.used == used + reserved
    ring.release()
    ring.release()
    assert _same_host.BUDGET.used == used
    dropped = OutRing(1 << 20, reserved=_same_host.BUDGET.take(1 << 20))
    del dropped
    gc.collect()
    assert _same_host.BUDGET.used == used
    OutRing(1 << 20).release()  # a ring made without the budget gives nothing back
    assert _same_host.BUDGET.used == used


def test_rings_hold_together() -> None:
    rings = Rings(OutRing(1 << 20))
    rings.release()
    rings.release()  # idempotent
    assert rings.out is None and rings.inbound is None


# -- worlds of processes ---------------------------------------------------------------------------------
def _world_program(rank: int, init_file: str, shared: dict[str, Any]) -> Any:
    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent

    options = rpc.RpcBackendOptions(
        init_method=f"file://{init_file}", heartbeat_interval=0.2, heartbeat_misses=5
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    world = current_agent().world
    found: dict[str, Any] = {}
    if rank == 0:
        t = torch.arange(1 << 18, dtype=torch.float32)
        assert torch.equal(rpc.rpc_sync("worker1", torch.neg, args=(t,)), -t)
        kept = rpc.rpc_sync("worker2", torch.neg, args=(t,))  # 1 MiB: over rank 2's ring
        found["kept_over_ring"] = _over_a_ring(kept)
        links = world.links  # made by the calls (links are made on first use)
        found["same_host"] = {peer: link.same_host for peer, link in links.items()}
        found["maps_live"] = _ring_handles()
        shared["kill_me"].put(2)  # the operator kill -9s rank 2
        deadline = time.monotonic() + 30
        while links[2].failed is None and time.monotonic() < deadline:
            time.sleep(0.05)
        found["rank2_failed"] = links[2].failed is not None
        found["maps_after_kill"] = _ring_handles()
        found["kept_after_kill"] = bool(torch.equal(kept, -t))
        assert torch.equal(rpc.rpc_sync("worker1", torch.neg, args=(t,)), -t)  # the other link works
    elif rank == 1:  # serves rank 0 until it leaves
        deadline = time.monotonic() + WORLD_TIMEOUT
        while time.monotonic() < deadline:
            link = world.links.get(0)
            if link is not None and link.state.closed_by_peer:
                break
            time.sleep(0.05)
    else:
        time.sleep(WORLD_TIMEOUT)  # until killed
    rpc.shutdown(graceful=False)
    if rank == 0:  # the kept tensor still holds the dead peer's ring, and reads as it did
        found["maps_while_kept"] = _ring_handles()
        found["kept_after_shutdown"] = bool(torch.equal(kept, -t))
        del kept
    found["maps_after_shutdown"] = _ring_handles()
    return found


def _world_child(rank: int, init_file: str, shared: dict[str, Any]) -> None:
    report(shared, rank, _world_program, rank, init_file, shared)


def test_a_killed_peer_leaves_no_segment_and_shutdown_releases_every_ring_a_kept_tensor_does_not_hold(
    tmp_path: Path,
) -> None:
    mp = multiprocessing.get_context("spawn")
    shared: dict[str, Any] = {"results": mp.Queue(), "kill_me": mp.Queue()}
    shm_before = _named_segments()

    def kill_when_asked(procs: list[Any]) -> None:  # the operator kill -9s the rank worker0 names
        os.kill(procs[shared["kill_me"].get(timeout=WORLD_TIMEOUT)].pid, signal.SIGKILL)

    args = [(r, str(tmp_path / "rdv"), shared) for r in range(3)]
    out = run_world(mp, _world_child, args, shared, WORLD_TIMEOUT, reporting=[0, 1], started=kill_when_asked)
    zero = out[0]
    assert zero["same_host"] == {1: (True, True), 2: (True, True)}
    maps_live, fds_live = zero["maps_live"]
    assert maps_live == 4  # two rings for each of the two links
    assert zero["rank2_failed"]
    # the dead peer's link let go of both rings (and of the descriptors the mappings hold) but for
    # the mapping of rank 2's ring that a tensor received from it in place still holds
    assert zero["kept_over_ring"]
    assert zero["maps_after_kill"] == (maps_live - 1, fds_live - 1)
    assert zero["kept_after_kill"] and zero["kept_after_shutdown"]
    assert zero["maps_while_kept"] == (1, 1)
    assert zero["maps_after_shutdown"] == (0, 0)  # the mapping went with the tensor
    assert out[1]["maps_after_shutdown"] == (0, 0)
    assert _named_segments() == shm_before  # nothing named was ever created
