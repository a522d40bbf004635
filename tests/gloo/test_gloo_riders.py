"""Deferrable messages ride in the next header frame to their peer (the gloo world's riders).

A message nothing waits on soon (a context's release, its ack) is marked ``Message.deferrable``; the
gloo world lets it wait to travel at the end of the next header frame to the same peer, which delivers
it first, or sends it in a frame of its own once ``RIDER_WAIT`` has passed. It then costs no frame and
no wake-up of the peer's receiver of its own. Order per link is kept either way.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _gloo_pair import WAIT, Inbox, make_links, started_links
from twinrpc.impl._framing import MAX_RIDER_BYTES, FrameError, Header, encode_header, new_header_tensor
from twinrpc.impl._link import PeerLink

from twinrpc._message import Kind, Message


def _cleanup(msg_id: int) -> Message:
    return Message(Kind.CONTEXT_CLEANUP, msg_id, 0, 1, b"release %d" % msg_id, deferrable=True)


@pytest.fixture
def links() -> Iterator[tuple[PeerLink, PeerLink, Inbox]]:
    with started_links() as started:
        yield started


def test_riders_are_decoded_in_order_and_leave_the_message_its_inline_payload() -> None:
    _, view = new_header_tensor()
    riders = [_cleanup(1), _cleanup(2)]
    main = Message(Kind.CALL, 9, 0, 1, b"p" * 100, [torch.arange(8, dtype=torch.uint8)])
    inline, inline_tensors = encode_header(view, main, 5, riders)
    header = Header(view, 0, 1)
    assert (inline, inline_tensors) == (True, True)
    assert header.riders == [(Kind.CONTEXT_CLEANUP, 1, b"release 1"), (Kind.CONTEXT_CLEANUP, 2, b"release 2")]
    assert (header.kind, header.id, header.ack, header.inline_payload) == (Kind.CALL, 9, 5, b"p" * 100)
    assert header.inline_tensors is not None and torch.equal(header.inline_tensors[0], main.tensors[0])


def test_riders_take_room_from_the_inline_payload_but_never_overlap_it() -> None:
    _, view = new_header_tensor()
    big = Message(Kind.CALL, 9, 0, 1, b"q" * 3500)
    assert encode_header(view, big)[0] is True
    riders = [Message(Kind.CONTEXT_CLEANUP, i, 0, 1, b"r" * 100) for i in range(8)]  # ~900 B of riders
    inline, _ = encode_header(view, big, 0, riders)
    header = Header(view, 0, 1)
    assert inline is False and header.inline_payload is None  # the payload goes in a frame of its own
    assert [r[1] for r in header.riders] == list(range(8))
    with pytest.raises(Exception, match="riders of"):
        encode_header(view, big, 0, [Message(Kind.CONTEXT_CLEANUP, 1, 0, 1, b"x" * MAX_RIDER_BYTES)])


def test_a_rider_whose_payload_overflows_its_block_is_rejected() -> None:
    import struct

    _, view = new_header_tensor()
    encode_header(view, Message(Kind.CALL, 9, 0, 1, b"x"), 0, [_cleanup(1)])
    start = len(view) - 4 - (14 + len(b"release 1"))
    struct.pack_into("<I", view, start + 10, 500)  # the rider's payload length
    with pytest.raises(FrameError, match="overflows"):
        Header(view, 0, 1)


def test_deferred_messages_are_delivered_before_the_message_they_ride_with_in_one_frame(
    links: tuple[PeerLink, PeerLink, Inbox],
) -> None:
    sender, _listener, inbox = links
    assert sender.defer(_cleanup(1), _never) and sender.defer(_cleanup(2), _never)
    frames_before = sender.sender.headers_sent
    sender.send(
        Message(Kind.CALL, 3, 0, 1, b"call", [torch.arange(300_000, dtype=torch.int64).to(torch.uint8)])
    )
    got = inbox.wait_for(3)
    assert [(m.kind, m.id) for m in got] == [
        (Kind.CONTEXT_CLEANUP, 1),
        (Kind.CONTEXT_CLEANUP, 2),
        (Kind.CALL, 3),
    ]
    assert got[0].payload == b"release 1" and got[0].tensors == []
    assert sender.sender.headers_sent - frames_before == 1
    assert torch.equal(got[2].tensors[0], torch.arange(300_000, dtype=torch.int64).to(torch.uint8))


def test_riders_left_waiting_go_in_a_heartbeat_frame_of_their_own(
    links: tuple[PeerLink, PeerLink, Inbox],
) -> None:
    sender, _listener, inbox = links
    assert sender.defer(_cleanup(1), _never)
    time.sleep(0.2)
    assert inbox.got == []  # a link never sends a rider by itself: the world's timer flushes it
    sender.flush_riders()
    assert [(m.kind, m.id) for m in inbox.wait_for(1)] == [(Kind.CONTEXT_CLEANUP, 1)]


def test_a_message_queued_on_the_outbox_keeps_its_place_behind_earlier_riders(
    links: tuple[PeerLink, PeerLink, Inbox],
) -> None:
    sender, _listener, inbox = links
    assert sender.defer(_cleanup(1), _never)
    sender.send_later(Message(Kind.CALL, 2, 0, 1, b"later"), _never)
    assert [m.id for m in inbox.wait_for(2)] == [1, 2]


def test_a_message_with_tensors_or_a_large_payload_does_not_wait() -> None:
    inbox = Inbox()
    sender, _listener = make_links(inbox, [])
    assert not sender.defer(Message(Kind.CONTEXT_CLEANUP, 1, 0, 1, b"", [torch.ones(1)], True), _never)
    assert not sender.defer(
        Message(Kind.CONTEXT_CLEANUP, 1, 0, 1, b"x" * MAX_RIDER_BYTES, deferrable=True), _never
    )


def test_riders_waiting_on_a_link_that_fails_are_reported() -> None:
    inbox = Inbox()
    failures: list[BaseException] = []
    sender, _listener = make_links(inbox, failures)
    reported: list[tuple[int, str]] = []
    assert sender.defer(_cleanup(1), lambda msg, exc: reported.append((msg.id, str(exc))))
    sender.fail(RuntimeError("the pair broke"))
    # in twinrpc's words first, the transport's after (impl/_link.py link_broken)
    assert reported == [(1, "its connection to this worker failed; gloo said: the pair broke")]
    assert [str(e) for e in failures] == ["its connection to this worker failed; gloo said: the pair broke"]


def _never(msg: Message, exc: BaseException) -> None:
    raise AssertionError(f"{msg.describe()} failed: {exc}")


# -- in a world: a context's release ---------------------------------------------------------------
def _context_exists(context_id: int) -> bool:
    import twinrpc.autograd as dist_autograd

    try:
        dist_autograd._retrieve_context(context_id)
    except RuntimeError:
        return False
    return True


def _release_program(rank: int, init_file: str, shared: dict[str, Any]) -> None:
    import twinrpc.autograd as dist_autograd
    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent

    options = rpc.RpcBackendOptions(init_method=f"file://{init_file}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    try:
        if rank == 0:
            t = torch.ones(2, requires_grad=True)
            with dist_autograd.context() as cid:
                rpc.rpc_sync("worker1", torch.add, args=(t, 1))
                link = current_agent().world.links[1]  # type: ignore[attr-defined]  # made by the call
                frames = link.sender.headers_sent  # from here: the release, then one call
            gone = not rpc.rpc_sync("worker1", _context_exists, args=(cid,))
            shared["out"].put(("rode", gone, link.sender.headers_sent - frames))
            with dist_autograd.context() as cid:  # then nothing more is sent to worker1
                rpc.rpc_sync("worker1", torch.add, args=(t, 1))
            shared["cid"].put(cid)
            shared["done"].wait(WAIT)
        else:
            cid = shared["cid"].get(timeout=WAIT * 6)
            start = time.monotonic()
            while _context_exists(cid) and time.monotonic() - start < WAIT:
                time.sleep(0.005)
            shared["out"].put(("alone", not _context_exists(cid), time.monotonic() - start))
            shared["done"].set()
    finally:
        rpc.shutdown()


def test_a_context_release_rides_with_the_next_call_or_goes_alone_soon_after(tmp_path: Path) -> None:
    """The release of a context that reached worker1 travels in the next call's frame (worker1 has
    released it when that call runs, and the call took one frame); with no next call it goes alone
    within ``RIDER_WAIT``, here bounded loosely for a busy machine."""
    ctx = multiprocessing.get_context("spawn")
    shared = {"out": ctx.Queue(), "cid": ctx.Queue(), "done": ctx.Event()}
    procs = [
        ctx.Process(target=_release_program, args=(rank, str(tmp_path / "init"), shared)) for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(
            (kind, (ok, value)) for kind, ok, value in (shared["out"].get(timeout=120) for _ in range(2))
        )
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got["rode"] == (True, 1)
    released, seconds = got["alone"]
    assert released, f"worker1 still had the context after {seconds:.1f} s"
    assert seconds < 5.0


# -- in a world: dead RRefs' deletes ---------------------------------------------------------------
def _owned() -> tuple[int, int]:
    """On the owner: the owner RRefs and forks it still keeps."""
    import gc

    import twinrpc.rpc as rpc

    gc.collect()
    info = rpc._get_debug_info()
    return int(info["num_owner_rrefs"]), int(info["num_forks"])


def _delete_program(rank: int, init_file: str, calls: int, out: Any) -> None:
    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent

    options = rpc.RpcBackendOptions(init_method=f"file://{init_file}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    try:
        if rank == 0:
            one = torch.ones(1)
            rpc.remote("worker1", torch.add, args=(one, 1)).to_here()  # warm up (makes the link)
            sender = current_agent().world.links[1].sender  # type: ignore[attr-defined]
            ours, theirs = sender.headers_sent, rpc.rpc_sync("worker1", _headers_to, args=(0,))
            for i in range(calls):  # each RRef dies right after its to_here()
                assert rpc.remote("worker1", torch.add, args=(one, i)).to_here().item() == i + 1
            ours, theirs = (
                sender.headers_sent - ours,
                rpc.rpc_sync("worker1", _headers_to, args=(0,)) - theirs,
            )
            start = time.monotonic()
            left = rpc.rpc_sync("worker1", _owned)
            while left != (0, 0) and time.monotonic() - start < WAIT:
                time.sleep(0.01)
                left = rpc.rpc_sync("worker1", _owned)
            out.put((ours, theirs, left))
    finally:
        rpc.shutdown()


def _headers_to(peer: int) -> int:
    from twinrpc._current import current_agent

    return int(current_agent().world.links[peer].sender.headers_sent)  # type: ignore[attr-defined]


def test_dead_rrefs_deletes_and_their_acks_ride_the_calls_frames(tmp_path: Path) -> None:
    """A loop of ``remote()`` + ``to_here()`` that drops each RRef sends two frames each way per
    iteration (the call and the fetch, their two replies): each dead RRef's delete rides a later
    frame to the owner and its ack a later reply, instead of a frame and a receiver's wake-up each.
    Every delete still arrives: the owner ends with no RRef and no fork."""
    calls = 200
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_delete_program, args=(rank, str(tmp_path / "init"), calls, out))
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        ours, theirs, left = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert left == (0, 0)
    # 2 frames per iteration each way, plus a few for riders that waited RIDER_WAIT on a busy machine
    # (a delete and its ack in frames of their own would make it 3 each way)
    assert ours <= 2.2 * calls + 2, f"worker0 sent {ours} frames for {calls} iterations"
    assert theirs <= 2.2 * calls + 2, f"worker1 sent {theirs} frames for {calls} iterations"
