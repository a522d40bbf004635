"""Messages that wait for the same peer travel in one header frame (the gloo link's coalescing).

Whoever holds a link's send lock sends every message queued for that peer meanwhile in one frame (the
first message, then each whole one that fits), as a group commit does; a message that finds the lock
free goes at once, alone. The receiver decodes the frame in one pass and dispatches its messages in
order. The tests hold the send lock to make messages queue up deterministically.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from _gloo_pair import WAIT, Inbox, make_links, started_links
from twinrpc.impl._framing import (
    HEADER_BYTES,
    SIZES_AT,
    FrameEncoder,
    FrameError,
    Header,
    encode_header,
    fits_whole,
    new_header_tensor,
)
from twinrpc.impl._link import PeerLink

from twinrpc._message import Kind, Message


@pytest.fixture
def links() -> Iterator[tuple[PeerLink, PeerLink, Inbox]]:
    with started_links() as started:
        yield started


def _call(i: int, extra: bytes = b"") -> Message:
    return Message(Kind.CALL, i, 0, 1, b"call %d " % i + extra, [torch.full((4,), i, dtype=torch.uint8)])


def _wait_queued(link: PeerLink, n: int) -> None:
    deadline = time.monotonic() + WAIT
    while len(link.sender._queue) < n:
        assert time.monotonic() < deadline, f"{len(link.sender._queue)} of {n} messages queued"
        time.sleep(0.001)


# -- the frame format --------------------------------------------------------------------------------
def test_a_frame_of_several_messages_decodes_in_one_pass_in_order() -> None:
    t, view = new_header_tensor()
    enc = FrameEncoder(view)
    first = Message(Kind.CALL, 1, 0, 1, b"first", [torch.arange(300_000, dtype=torch.int64).to(torch.uint8)])
    rider = Message(Kind.CONTEXT_CLEANUP, 9, 0, 1, b"release")
    assert enc.first(first, 5, [rider]) == (True, False)  # the large storage follows as a data frame
    for i in range(2, 6):
        assert enc.add(_call(i))
    header = Header(view, 0, 1, t)
    assert [r[1] for r in header.riders] == [9]
    assert (header.kind, header.id, header.ack, header.inline_payload) == (Kind.CALL, 1, 5, b"first")
    assert header.inline_tensors is None and header.sizes == [300_000]
    assert [(r.kind, r.id, r.inline_payload) for r in header.more] == [
        (Kind.CALL, i, b"call %d " % i) for i in range(2, 6)
    ]
    for i, record in enumerate(header.more, start=2):
        assert record.inline_tensors is not None
        assert torch.equal(record.inline_tensors[0], torch.full((4,), i, dtype=torch.uint8))


def test_a_message_that_does_not_fit_whole_is_left_for_the_next_frame() -> None:
    t, view = new_header_tensor()
    enc = FrameEncoder(view)
    enc.first(_call(1), 0, None)
    added = 0
    while enc.add(_call(2 + added, b"x" * 500)):
        added += 1
    before = bytes(view)
    assert not enc.add(_call(99, b"x" * 500))
    assert bytes(view) == before  # a refused message leaves the frame as it was
    assert len(Header(view, 0, 1, t).more) == added == enc.count
    assert 4 <= added < 10


def test_a_lone_message_frame_is_the_same_as_before() -> None:
    _, view = new_header_tensor()
    encode_header(view, _call(1))
    header = Header(view, 0, 1)
    assert header.more == [] and header.id == 1


def test_whole_messages_are_the_small_ones() -> None:
    assert fits_whole(_call(1))
    assert not fits_whole(Message(Kind.CALL, 1, 0, 1, b"x" * HEADER_BYTES))
    assert not fits_whole(Message(Kind.CALL, 1, 0, 1, b"", [torch.zeros(HEADER_BYTES, dtype=torch.uint8)]))


def _two_record_frame() -> tuple[torch.Tensor, memoryview, int]:
    """A frame of three messages; returns where the record count sits."""
    t, view = new_header_tensor()
    enc = FrameEncoder(view)
    enc.first(Message(Kind.CALL, 1, 0, 1, b"a"), 0, None)
    count_at = SIZES_AT + 1  # after the fixed part and the first message's 1-byte payload
    enc.add(Message(Kind.CALL, 2, 0, 1, b"b"))
    enc.add(Message(Kind.CALL, 3, 0, 1, b"c"))
    assert struct.unpack_from("<H", view, count_at)[0] == 2
    return t, view, count_at


@pytest.mark.parametrize(
    ("what", "offset", "fmt", "value", "match"),
    [
        ("a count of further messages that cannot fit", 0, "<H", 4000, "further messages"),
        ("a zero count", 0, "<H", 0, "further messages"),
        ("a record of an unknown kind", 2, "<H", 999, "unknown message kind 999 in a record"),
        ("a record whose payload is not inside the frame", 4, "<H", 0, "not whole"),
        ("a record whose payload overflows the frame", 2 + 12, "<Q", 1 << 40, "overflows"),
        ("a record claiming too many tensors", 2 + 20, "<I", 10_000, "tensors"),
    ],
)
def test_a_malformed_multi_message_header_is_refused_naming_the_peer(
    what: str, offset: int, fmt: str, value: int, match: str
) -> None:
    t, view, count_at = _two_record_frame()
    struct.pack_into(fmt, view, count_at + offset, value)
    with pytest.raises(FrameError, match=match) as info:
        Header(view, 0, 1, t)
    assert "rank 0" in str(info.value), what


def test_a_malformed_multi_message_frame_is_dropped_and_the_link_keeps_working(
    links: tuple[PeerLink, PeerLink, Inbox], caplog: pytest.LogCaptureFixture
) -> None:
    sender, listener, inbox = links
    t, view, count_at = _two_record_frame()
    struct.pack_into("<H", view, count_at, 4000)
    with caplog.at_level(logging.ERROR, logger="twinrpc.impl"):
        with sender.sender.lock:  # test-only injection of a raw frame
            sender.sender.send_raw_header(t)
        sender.send(_call(7))
        assert [m.id for m in inbox.wait_for(1)] == [7]  # none of the bad frame's three messages
    assert listener.bad_frames == 1
    assert any("rejected a malformed frame from rank 0" in r.getMessage() for r in caplog.records)


# -- on a link ---------------------------------------------------------------------------------------
def test_a_lone_message_goes_at_once_in_a_frame_of_its_own(links: tuple[PeerLink, PeerLink, Inbox]) -> None:
    sender, _, inbox = links
    for i in range(3):
        frames = sender.sender.headers_sent
        sender.send(_call(i), _never)  # may ride: but the lock is free, so it goes now
        assert sender.sender.headers_sent == frames + 1 and not sender.sender._queue
        assert inbox.wait_for(i + 1)[-1].id == i  # before the next one is sent: nothing waited for company
    assert sender.sender.messages_sent == sender.sender.headers_sent


def test_concurrent_sends_to_one_peer_share_frames_and_arrive_in_order(
    links: tuple[PeerLink, PeerLink, Inbox],
) -> None:
    sender, _, inbox = links
    n = 8
    errors: list[BaseException] = []

    def send(i: int) -> None:
        try:
            sender.send(_call(i))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    frames = sender.sender.headers_sent
    threads = []
    with sender.sender.lock:  # a frame is "being sent": the senders queue behind it
        for i in range(n):
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()
            _wait_queued(sender, i + 1)  # in this order
    for thread in threads:
        thread.join(WAIT)
    got = inbox.wait_for(n)
    assert not errors
    assert [m.id for m in got] == list(range(n))
    for m in got:
        assert m.payload == b"call %d " % m.id and torch.equal(
            m.tensors[0], torch.full((4,), m.id, dtype=torch.uint8)
        )
    assert sender.sender.headers_sent - frames == 1  # all eight in one header frame


def test_messages_that_find_a_frame_going_out_ride_the_next_and_return_at_once(
    links: tuple[PeerLink, PeerLink, Inbox],
) -> None:
    sender, _, inbox = links
    frames = sender.sender.headers_sent
    big = Message(Kind.CALL, 0, 0, 1, b"big", [torch.arange(200_000, dtype=torch.int64).to(torch.uint8)])
    with sender.sender.lock:
        tensor = torch.full((4,), 1, dtype=torch.uint8)
        sender.send(Message(Kind.CALL, 1, 0, 1, b"rides", [tensor]), _never)  # returns: it rode
        tensor.fill_(99)  # the caller may reuse its tensor at once: the message kept a copy
        assert sender.try_send_now(_call(2), _never)  # a receiver's reply rides too
        assert not sender.try_send_now(_call(3))  # without a way to report a failure it cannot
        assert len(sender.sender._queue) == 2
    sender.send(big)  # the lock's next holder sends what waits, then this one
    got = inbox.wait_for(3)
    assert [m.id for m in got] == [1, 2, 0]
    assert torch.equal(got[0].tensors[0], torch.full((4,), 1, dtype=torch.uint8))
    assert torch.equal(got[2].tensors[0], big.tensors[0])
    assert sender.sender.headers_sent - frames <= 2


def test_a_failed_frame_fails_every_message_in_it_with_the_links_error() -> None:
    inbox = Inbox()
    failures: list[BaseException] = []
    sender, listener = make_links(inbox, failures)
    sender.start()
    listener.start()
    reported: list[tuple[int, BaseException]] = []
    raised: list[BaseException] = []

    def blocking() -> None:
        try:
            sender.send(_call(9))
        except RuntimeError as exc:
            raised.append(exc)

    try:
        with sender.sender.lock:
            for i in range(4):
                sender.send(_call(i), lambda msg, exc: reported.append((msg.id, exc)))
            thread = threading.Thread(target=blocking)
            thread.start()
            _wait_queued(sender, 5)
            sender.abandon()  # the connection breaks under the frame about to go out
        thread.join(WAIT)
        assert sender.failed is not None and sender.failed in failures
        assert [i for i, _ in reported] == [0, 1, 2, 3]
        assert all(exc is sender.failed for _, exc in reported)
        assert raised == [sender.failed]
        with pytest.raises(RuntimeError):
            sender.send(_call(10))  # the link stays failed
    finally:
        listener.closing = True
        listener.abandon()
        listener.join(WAIT)


def _never(msg: Message, exc: BaseException) -> None:
    raise AssertionError(f"{msg.describe()} failed: {exc}")


def test_closing_sends_the_messages_still_riding_first_and_fails_later_ones() -> None:
    inbox = Inbox()
    failures: list[BaseException] = []
    sender, listener = make_links(inbox, failures)
    sender.start()
    listener.start()
    reported: list[tuple[int, str]] = []

    def report(msg: Message, exc: BaseException) -> None:
        reported.append((msg.id, str(exc)))

    sender.closing = listener.closing = True  # a close frame is then no failure
    with sender.sender.lock:
        sender.send(_call(1), report)  # rides: the lock is taken
        closer = threading.Thread(target=sender.send_close, kwargs={"deadline": time.monotonic() + WAIT})
        closer.start()
        time.sleep(0.1)  # send_close waits for the lock's holder: it must not drop what rides
    closer.join(WAIT)
    assert [m.id for m in inbox.wait_for(1)] == [1] and reported == []
    assert listener.join(WAIT)  # the close frames came after it
    with pytest.raises(RuntimeError, match=r"closed \(this worker is shutting down\)"):
        sender.send(_call(2))
    assert sender.try_send_now(_call(3), report)  # taken, and failed at once: never lost
    assert reported == [(3, reported[0][1])] and "rank 1" in reported[0][1]
    sender.abandon()
    sender.join(WAIT)
    assert not failures, failures
