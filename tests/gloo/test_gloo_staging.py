"""Data frames of up to 1 MiB land in a receive the peer posted ahead (its staging buffer), on a real
gloo pair in one process.

Without it a gloo send of a payload or tensor frame waits until the receiving process has woken up,
decoded the message's header and posted a receive for that frame. With it the sender writes the frame
right behind its header, even while the receiver is still busy with an earlier message; only frames
over ``STAGED_BYTES`` still wait for their own receive. Contents and order are unchanged either way.
These are data frames over gloo, as between hosts: the same-host path (which needs no data frame) is
off here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from _gloo_pair import WAIT, Inbox, close_links, make_links
from twinrpc.impl._link import PeerLink
from twinrpc.impl._receiver import GO_AHEAD_BYTES, RING, STAGED_BYTES

from twinrpc._message import Kind, Message


@pytest.fixture(autouse=True)
def _between_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINRPC_SHM", "0")


class _Receiver:
    """Rank 1's side: records messages; the one with id ``block_id`` blocks its receiver until released."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.release = threading.Event()
        self.blocked = threading.Event()
        self.got: list[Message] = []
        self.all_in = threading.Event()
        self.expected = 0

    def __call__(self, msg: Message) -> None:
        if msg.id == self.block_id:
            self.blocked.set()
            self.release.wait(WAIT)
        self.got.append(msg)
        if len(self.got) == self.expected:
            self.all_in.set()


@pytest.fixture
def pair() -> Iterator[tuple[PeerLink, _Receiver]]:
    receiver = _Receiver(block_id=1)
    failures: list[BaseException] = []
    sender, listener = make_links(receiver, failures)
    sender.start()
    listener.start()
    yield sender, receiver
    receiver.release.set()
    close_links(sender, listener)
    assert not failures, failures


def _message(msg_id: int, nbytes: int, payload: bytes = b"") -> Message:
    data = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    return Message(Kind.CALL, msg_id, 0, 1, payload, [data])


def _send_in_thread(link: PeerLink, msg: Message) -> threading.Event:
    sent = threading.Event()

    def run() -> None:
        link.send(msg)
        sent.set()

    threading.Thread(target=run, daemon=True).start()
    return sent


def test_a_frame_up_to_the_staging_size_is_taken_while_the_receiver_is_busy_a_larger_one_waits(
    pair: tuple[PeerLink, _Receiver],
) -> None:
    sender, receiver = pair
    messages = [
        Message(Kind.CALL, 1, 0, 1, b"first"),
        _message(2, 256 << 10),
        _message(3, STAGED_BYTES + 4096),
        _message(4, 64 << 10, bytes(range(256)) * 64),  # a 16 KiB payload: a frame of its own too
    ]
    receiver.expected = len(messages)
    sender.send(messages[0])
    assert receiver.blocked.wait(WAIT)  # rank 1's only receiver now sits in message 1's handler
    # returns: its header and its 256 KiB frame both have a receive posted ahead
    assert _send_in_thread(sender, messages[1]).wait(WAIT)
    third = _send_in_thread(sender, messages[2])
    assert not third.wait(0.5)  # its frame needs a receive of its own, posted only when dispatched
    receiver.release.set()
    assert third.wait(WAIT)
    sender.send(messages[3])
    assert receiver.all_in.wait(WAIT)
    assert [m.id for m in receiver.got] == [1, 2, 3, 4]
    for sent, got in zip(messages, receiver.got, strict=True):
        assert got.payload == sent.payload
        assert len(got.tensors) == len(sent.tensors)
        for a, b in zip(sent.tensors, got.tensors, strict=True):
            assert torch.equal(a, b)


def test_a_send_before_the_receiver_has_started_leaves_one_staging_receive_posted() -> None:
    """A worker may send on a link before its receiver thread has posted the link's receives; the
    send then posts the staging receive itself (receives of taken frames are posted again after a
    send). The receiver must not post a second one: the next data frame would land in the first,
    while the receiver waited for it on the second, for good."""
    receiver = _Receiver(block_id=-1)
    failures: list[BaseException] = []
    sender, listener = make_links(receiver, failures)
    listener.receiver.repost_after_send()  # what a send from rank 1 does, here before its receiver started
    sender.start()
    listener.start()
    messages = [_message(1, 4096), _message(2, 256 << 10)]
    receiver.expected = len(messages)
    try:
        for msg in messages:
            assert _send_in_thread(sender, msg).wait(WAIT)
        assert receiver.all_in.wait(WAIT)
        for sent, got in zip(messages, receiver.got, strict=True):
            assert torch.equal(sent.tensors[0], got.tensors[0])
    finally:
        close_links(sender, listener)
    assert not failures, failures


def test_a_receiver_that_never_sends_keeps_taking_a_stream_longer_than_its_ring(
    pair: tuple[PeerLink, _Receiver],
) -> None:
    """Receives of taken frames are posted again after this worker's next send; a worker that sends
    nothing back (here rank 1) posts them itself, so a stream of many times ``RING`` messages, with
    and without data frames, still gets through in order and intact."""
    sender, receiver = pair
    receiver.release.set()  # message 1 does not block
    messages = [
        _message(i, 64 << 10) if i % 3 == 0 else Message(Kind.CALL, i, 0, 1, b"m%d" % i)
        for i in range(1, 8 * RING)
    ]
    receiver.expected = len(messages)
    for msg in messages:
        assert _send_in_thread(sender, msg).wait(WAIT)
    assert receiver.all_in.wait(WAIT)
    assert [m.id for m in receiver.got] == [m.id for m in messages]
    for sent, got in zip(messages, receiver.got, strict=True):
        assert got.payload == sent.payload
        for a, b in zip(sent.tensors, got.tensors, strict=True):
            assert torch.equal(a, b)


def test_frames_over_the_go_ahead_size_arrive_whole_both_ways_at_once() -> None:
    """A data frame over GO_AHEAD_BYTES goes once the receiver has posted its receive (its go-ahead),
    so that gloo does not take it into a buffer of its own first. Both sides sending such frames to
    each other at the same time must not wait on each other, and every message arrives unchanged,
    in order, among smaller ones (a payload frame over the size too)."""
    to_one, to_zero = Inbox(), Inbox()
    failures: list[BaseException] = []
    zero, one = make_links(to_one, failures, back=to_zero)
    zero.start()
    one.start()
    big = GO_AHEAD_BYTES + 4096
    try:
        batches = {
            zero: [_message(1, big), _message(2, 4096), _message(3, 2 * big), _message(4, big, bytes(big))],
            one: [_back(_message(11, big)), _back(_message(12, STAGED_BYTES + 1)), _back(_message(13, big))],
        }
        done = [_send_all(link, msgs) for link, msgs in batches.items()]
        assert all(d.wait(WAIT) for d in done)
        for link, inbox in ((zero, to_one), (one, to_zero)):
            sent = batches[link]
            got = inbox.wait_for(len(sent))
            assert [m.id for m in got] == [m.id for m in sent]
            for a, b in zip(sent, got, strict=True):
                assert b.payload == a.payload
                assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))
    finally:
        close_links(zero, one)
    assert not failures, failures


def _back(msg: Message) -> Message:
    """``msg`` from rank 1 to rank 0."""
    return Message(msg.kind, msg.id, 1, 0, msg.payload, msg.tensors)


def _send_all(link: PeerLink, messages: list[Message]) -> threading.Event:
    done = threading.Event()

    def run() -> None:
        for msg in messages:
            link.send(msg)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def test_an_unexpected_error_in_the_receive_path_fails_the_link_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault in the receiver's own code (not the peer's) fails the link with that error, so calls
    to the peer fail naming it, instead of the receiver thread dying and the link going silent."""

    def broken(self: object, nbytes: int, as_bytes: bool = False) -> None:
        raise TypeError("a bug in the receive path")

    monkeypatch.setattr("twinrpc.impl._receiver.Receiver._recv_data", broken)
    failures: list[BaseException] = []  # both sides' (rank 0's link fails too once the pair closes)
    failed = threading.Event()
    zero, one = make_links(Inbox(), failures)
    mine: list[BaseException] = []
    one._on_failure = lambda peer, exc: (mine.append(exc), failed.set())  # type: ignore[method-assign]
    zero.start()
    one.start()
    try:
        zero.send(_message(1, 64 << 10))  # its storage needs a data frame
        assert failed.wait(WAIT)
        assert [type(e) for e in mine] == [TypeError]
        assert one.failed is mine[0]
    finally:
        close_links(zero, one)


def test_large_frames_received_while_earlier_ones_are_held_never_share_their_memory() -> None:
    """Large receive buffers are used again once nothing refers to them (impl/_recv_buffers.py): a
    message still held (here by the inbox, as by a request waiting for a slot) keeps its data while
    later messages of the same size arrive, and once let go its buffer takes a later message."""
    from twinrpc.impl._recv_buffers import MIN_BYTES, RECV_BUFFERS

    inbox = Inbox()
    failures: list[BaseException] = []
    zero, one = make_links(inbox, failures)
    zero.start()
    one.start()
    size = MIN_BYTES
    try:
        reused = RECV_BUFFERS.reused
        for i in range(4):
            zero.send(Message(Kind.CALL, i, 0, 1, b"", [torch.full((size,), i, dtype=torch.uint8)]))
        held = inbox.wait_for(4)
        assert [int(m.tensors[0][0]) for m in held] == [0, 1, 2, 3]
        assert all(bool((m.tensors[0] == i).all()) for i, m in enumerate(held))
        assert RECV_BUFFERS.reused == reused
        inbox.got.clear()
        del held
        zero.send(Message(Kind.CALL, 9, 0, 1, b"", [torch.full((size,), 9, dtype=torch.uint8)]))
        (last,) = inbox.wait_for(1)
        assert bool((last.tensors[0] == 9).all())
        assert RECV_BUFFERS.reused == reused + 1
    finally:
        close_links(zero, one)
    assert not failures, failures
