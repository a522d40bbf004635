"""Receive buffers for large data, used again once the program has let go of what they held.

A large tensor a peer sends lands in a buffer of its own: a gloo receive posted for the frame, or the
copy out of the same-host ring. A fresh buffer costs a page fault per page as the data is written,
and training loops receive tensors of the same sizes over and over, dropping each before the next
arrives. So the process keeps the buffers it handed out most recently, and when a receive needs a
buffer of a size it keeps and nothing but this cache still refers to that buffer's storage, the
receive writes into it instead of a fresh one, without the page faults (the figures:
docs/explanation/benchmarks.md).

*Nothing but this cache* is checked with the storage's use count: a received tensor is a tensor of
its own over the buffer's storage (``_serialize`` rebuilds it with ``set_``), and so is anything the
program made from it (views, ``numpy()`` arrays, autograd's saved tensors), so a storage whose only
user is the cache's own tensor is one no tensor of the program's refers to; and with the reference
count of the storage's Python object, which the cache holds and torch hands to whoever asks a tensor
over it for its storage. A storage resized or moved into shared memory is never written again. The
buffers are ordinary, resizable allocations, so a received tensor behaves as any other.

Bounded: at most ``TWINRPC_RECV_KEEP_BYTES`` (default 256 MiB) are kept, the oldest let go first; a
buffer kept but in use costs nothing extra (the program holds it anyway), and one the program has
let go is memory this process keeps until a later receive uses it or pushes it out.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable

import torch

from ._framing import recv_buffer

ENV_KEEP_BYTES = "TWINRPC_RECV_KEEP_BYTES"
_DEFAULT_KEEP_BYTES = 256 << 20
#: buffers smaller than this come from the allocator: it often hands back memory already touched
#: there, and keeping them measured no faster
MIN_BYTES = 8 << 20
#: kept buffers of one size at most (a receive looks through them for one no longer in use)
_PER_SIZE = 4

#: how many references a storage has (torch's own, used by its CUDA graph trees); None in a torch
#: without it: then nothing is reused
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _keep_bytes() -> int:
    text = os.environ.get(ENV_KEEP_BYTES, "")
    if not text:
        return _DEFAULT_KEEP_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV_KEEP_BYTES} must be a number of bytes (0: keep none), got {text!r}")
    return value


class RecvBuffers:
    """The buffers this process handed out for large receives, by size, oldest first. Thread-safe."""

    def __init__(self, keep_bytes: int | None = None) -> None:
        self._limit = _keep_bytes() if keep_bytes is None else keep_bytes
        self._lock = threading.Lock()
        #: size -> the kept buffers of that size
        self._by_size: dict[int, list[_Kept]] = {}
        #: every kept buffer, oldest first (what goes first when the bound is reached)
        self._order: deque[_Kept] = deque()
        self._bytes = 0
        #: receives that used a kept buffer again / that took a fresh one (for tests and profiles)
        self.reused = 0
        self.fresh = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` to receive into: a kept one nothing else refers to any
        more, else a fresh one; either way kept from now on (within the bound).

        What it returns is a tensor of its own over the kept one's storage, so the storage counts as
        in use for as long as the message holding it lives, received but perhaps not yet unpickled
        (a request waiting for a free slot), as well as while the program holds what it became."""
        if nbytes < MIN_BYTES or self._limit < nbytes or _use_count is None:
            return recv_buffer(nbytes)
        with self._lock:
            for kept in self._by_size.get(nbytes, ()):
                if kept.free():
                    self.reused += 1
                    return kept.t.view(nbytes)
        t = recv_buffer(nbytes)
        out = t.view(nbytes)
        kept = _Kept(t)
        with self._lock:
            self.fresh += 1
            same = self._by_size.get(nbytes)
            if same is not None and len(same) >= _PER_SIZE:  # all in use: the oldest goes
                self._drop(same[0])
            self._by_size.setdefault(nbytes, []).append(kept)
            self._order.append(kept)
            self._bytes += nbytes
            while self._bytes > self._limit:
                self._drop(self._order[0])
        return out

    def _drop(self, kept: _Kept) -> None:
        """Stop keeping ``kept`` (under the lock)."""
        self._order.remove(kept)
        n = kept.nbytes
        same = self._by_size[n]
        same.remove(kept)
        if not same:
            del self._by_size[n]
        self._bytes -= n

    def clear(self) -> None:
        """Let go of every kept buffer."""
        with self._lock:
            self._by_size.clear()
            self._order.clear()
            self._bytes = 0


class _Kept:
    """A kept buffer: a ``uint8`` tensor over its whole storage, that storage's Python object (which
    torch hands out again to whoever asks the storage of a tensor over it), and the memory it was
    made with."""

    __slots__ = ("nbytes", "ptr", "py_refs", "storage", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.storage = t.untyped_storage()
        self.py_refs = sys.getrefcount(self.storage)
        self.ptr = t.data_ptr()
        self.nbytes = t.numel()

    def free(self) -> bool:
        """Whether nothing but this refers to the storage: no other tensor (its use count: this
        tensor's and the Python object's) and no other reference to the Python object (a program
        may keep a received tensor's ``untyped_storage()`` alone), and the storage still holds the
        memory it was made with: not resized, and not moved into shared memory by
        ``share_memory_()`` (another process may read it)."""
        if sys.getrefcount(self.storage) != self.py_refs:
            return False
        storage = self.storage
        return (
            _use_count is not None
            and _use_count(storage._cdata) == 2
            and storage.data_ptr() == self.ptr
            and storage.nbytes() == self.nbytes
        )


#: the process's receive buffers, shared by every link's receiver
RECV_BUFFERS = RecvBuffers()
