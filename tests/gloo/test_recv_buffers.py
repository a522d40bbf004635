"""Large receive buffers are used again only once nothing the program can reach refers to them
(impl/_recv_buffers.py); a buffer still in use, in shared memory or resized is never written again."""

from __future__ import annotations

import gc

import pytest
import torch
from twinrpc.impl._recv_buffers import MIN_BYTES, RecvBuffers

N = MIN_BYTES


def _as_received(buf: torch.Tensor) -> torch.Tensor:
    """What a receiver makes of a buffer: a tensor of its own over the buffer's storage (set_)."""
    return torch.empty(0, dtype=torch.float32).set_(buf.untyped_storage(), 0, (buf.numel() // 4,), (1,))


def test_a_buffer_is_used_again_once_what_it_became_is_dropped() -> None:
    buffers = RecvBuffers(keep_bytes=8 * N)
    first = buffers.take(N)
    received = _as_received(first)
    del first  # the message is done with; the program still holds the tensor
    second = buffers.take(N)
    assert second.data_ptr() != received.data_ptr()
    ptr = received.data_ptr()
    del received, second
    gc.collect()
    assert buffers.take(N).data_ptr() == ptr  # the oldest free one
    assert (buffers.reused, buffers.fresh) == (1, 2)


def test_a_buffer_held_by_a_message_not_yet_unpickled_is_not_used_again() -> None:
    buffers = RecvBuffers(keep_bytes=8 * N)
    queued = [buffers.take(N)]  # a request waiting for a slot: only the message refers to it
    queued[0].fill_(7)
    other = buffers.take(N)
    other.fill_(9)
    assert torch.all(queued[0] == 7)
    assert buffers.reused == 0


@pytest.mark.parametrize("hold", ["view", "numpy", "storage", "autograd"])
def test_anything_made_from_a_received_tensor_keeps_its_buffer_in_use(hold: str) -> None:
    buffers = RecvBuffers(keep_bytes=8 * N)
    received = _as_received(buffers.take(N))
    received.fill_(1.0)
    if hold == "view":
        kept: object = received[10:20]
    elif hold == "numpy":
        kept = received.numpy()
    elif hold == "storage":
        kept = received.untyped_storage()
    else:
        w = torch.ones(received.numel(), requires_grad=True)
        kept = (w * received).sum()  # autograd saves ``received`` for the backward
    del received
    gc.collect()
    again = buffers.take(N)
    again.fill_(0)
    assert buffers.reused == 0
    assert kept is not None


def test_a_buffer_moved_to_shared_memory_or_resized_is_never_used_again() -> None:
    buffers = RecvBuffers(keep_bytes=8 * N)
    shared = _as_received(buffers.take(N))
    shared.share_memory_()  # another process may map it now
    resized = _as_received(buffers.take(N))
    resized.resize_(N)  # a bigger storage: new memory
    del shared, resized
    gc.collect()
    again = [buffers.take(N), buffers.take(N)]  # held: neither can be the other's
    assert buffers.reused == 0 and len({t.data_ptr() for t in again}) == 2


def test_kept_buffers_stay_within_their_bound_oldest_first() -> None:
    buffers = RecvBuffers(keep_bytes=2 * N)
    a, b, c = buffers.take(N), buffers.take(N), buffers.take(N)  # a is let go to stay within 2 N
    ptr_a = a.data_ptr()
    del a, b, c
    gc.collect()
    assert buffers.take(N).data_ptr() != ptr_a
    assert buffers.reused == 1
    assert RecvBuffers(keep_bytes=N - 1).take(N).numel() == N  # larger than the bound: never kept


def test_small_buffers_and_a_zero_bound_are_left_to_the_allocator() -> None:
    buffers = RecvBuffers(keep_bytes=0)
    for _ in range(3):
        buffers.take(N)
    small = RecvBuffers(keep_bytes=8 * N)
    for _ in range(3):
        small.take(MIN_BYTES - 1)
    assert (buffers.fresh, buffers.reused, small.fresh, small.reused) == (0, 0, 0, 0)
