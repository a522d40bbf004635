"""Data frames of up to 1 MiB land in a receive the peer posted ahead (its staging buffer), on a real
gloo pair in one process.

Without it a gloo send of a payload or tensor frame waits until the receiving process has woken up,
decoded the message's header and posted a receive for that frame. With it the sender writes the frame
right behind its header, even while the receiver is still busy with an earlier message; only frames
over ``_STAGED_BYTES`` still wait for their own receive. Contents and order are unchanged either way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from twinrpc.impl._link import _STAGED_BYTES, PeerLink, make_pair_group

from twinrpc._message import Kind, Message

WAIT = 10.0  # seconds: a bound for things that should take milliseconds


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
    store = dist.HashStore()
    groups: dict[int, Any] = {}

    def make(me: int) -> None:
        groups[me] = make_pair_group(store, me, 1 - me)

    threads = [threading.Thread(target=make, args=(me,)) for me in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    receiver = _Receiver(block_id=1)
    failures: list[BaseException] = []
    sender = PeerLink(0, 1, groups[0], lambda m: None, lambda peer, exc: failures.append(exc))
    listener = PeerLink(1, 0, groups[1], receiver, lambda peer, exc: failures.append(exc))
    sender.start()
    listener.start()
    yield sender, receiver
    receiver.release.set()
    for link in (sender, listener):  # both first: a close frame to a link not closing is a failure
        link.closing = True
    for link in (sender, listener):
        link.send_close()
    for link in (sender, listener):
        link.join(WAIT)
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
        _message(3, _STAGED_BYTES + 4096),
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
