"""Wire framing for the gloo world.

Every message starts with one fixed-size header frame (a ``uint8`` tensor of ``HEADER_BYTES``). For a
small message the pickled payload rides inline in the header, so a small RPC is exactly one gloo send;
a larger payload follows as one more frame. Then each out-of-band storage follows as its own frame,
sent straight from the tensor's memory (no pickling, no copy). The receiver takes frames of up to
1 MiB into a receive it posted ahead and copies them out (see ``_STAGED_BYTES`` in ``_link``), and
receives larger ones in place.

Header layout (little-endian): magic u32, version u16, flags u16, kind u16, reserved u16, src i32,
id i64, payload_len u64, n_tensors u32, ack u64, then n_tensors u64 storage sizes, then the inline
payload. ``ack`` counts the header frames the sender has taken from its receive ring (and posted a
receive again for): the peer's credit for sends that cannot block (see PeerLink.try_send_now).
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from twinrpc._errors import RPCError
from twinrpc._message import Kind, Message

HEADER_BYTES = 4096
MAGIC = 0x54574E52  # "TWNR"
VERSION = 2
FLAG_INLINE = 1  # the payload is inside the header
FLAG_CLOSE = 2  # the sender is closing this link (graceful shutdown): no message follows
FLAG_GRACEFUL = 4  # with FLAG_CLOSE: the sender completed graceful shutdown (an orderly departure)
FLAG_INLINE_TENSORS = 8  # the storages follow the inline payload inside the header (small ones)

_FIXED = struct.Struct("<IHHHHiqQIQ")
_SIZE = struct.Struct("<Q")
MAX_TENSORS = (HEADER_BYTES - _FIXED.size) // _SIZE.size
_KINDS = {int(k): k for k in Kind}


class FrameError(RPCError):
    """A malformed or truncated frame arrived; the message is dropped, the link stays usable only if
    the frame boundary can still be trusted (it cannot after a bad header, so the link is closed)."""


def encode_header(buf: memoryview, msg: Message, ack: int = 0) -> tuple[bool, bool]:
    """Fill ``buf`` (a view of the header tensor) for ``msg``; returns whether the payload is inline
    and whether the storages are inline too (then the header is the whole message: one gloo send
    instead of one per storage, each of which would wait for the peer to post its receive)."""
    tensors = msg.tensors
    n = len(tensors)
    if n > MAX_TENSORS:
        raise RPCError(f"a message may carry at most {MAX_TENSORS} distinct tensor storages, got {n}")
    payload = msg.payload
    offset = _FIXED.size + n * _SIZE.size
    end = offset + len(payload)
    inline = end <= HEADER_BYTES
    sizes = [t.numel() for t in tensors]
    inline_tensors = inline and n > 0 and end + sum(sizes) <= HEADER_BYTES
    _FIXED.pack_into(
        buf,
        0,
        MAGIC,
        VERSION,
        (FLAG_INLINE if inline else 0) | (FLAG_INLINE_TENSORS if inline_tensors else 0),
        int(msg.kind),
        0,
        msg.src,
        msg.id,
        len(payload),
        n,
        ack,
    )
    for i, size in enumerate(sizes):
        _SIZE.pack_into(buf, _FIXED.size + i * _SIZE.size, size)
    if inline:
        buf[offset:end] = payload
    if inline_tensors:
        for t, size in zip(tensors, sizes, strict=True):
            if size:
                buf[end : end + size] = t.numpy()  # type: ignore[call-overload]  # a contiguous uint8 buffer
                end += size
    return inline, inline_tensors


def encode_close(buf: memoryview, src: int, graceful: bool = False) -> None:
    flags = FLAG_CLOSE | (FLAG_GRACEFUL if graceful else 0)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, flags, 0, 0, src, 0, 0, 0, 0)


class Header:
    """A decoded header."""

    __slots__ = (
        "ack",
        "closing",
        "graceful",
        "id",
        "inline_payload",
        "inline_tensors",
        "kind",
        "payload_len",
        "sizes",
        "src",
    )

    def __init__(
        self, buf: memoryview, expected_src: int, dst: int, frame: torch.Tensor | None = None
    ) -> None:
        """Decode ``buf``; ``frame`` is the header tensor ``buf`` views (storages sent inline are
        copied out of it into tensors of their own)."""
        try:
            magic, version, flags, kind, _, src, msg_id, payload_len, n, ack = _FIXED.unpack_from(buf, 0)
        except struct.error as exc:
            raise FrameError(f"truncated header frame: {exc}") from exc
        if magic != MAGIC or version != VERSION:
            raise FrameError(
                f"bad header frame (magic {magic:#x}, version {version}) from rank {expected_src}"
            )
        if src != expected_src:
            raise FrameError(
                f"header says source rank {src} but arrived on the link from rank {expected_src}"
            )
        self.src = src
        self.ack = ack
        self.closing = bool(flags & FLAG_CLOSE)
        self.graceful = bool(flags & FLAG_GRACEFUL)
        if self.closing:
            return
        if kind not in _KINDS:
            raise FrameError(f"unknown message kind {kind} from rank {src}")
        if n > MAX_TENSORS:
            raise FrameError(f"header from rank {src} claims {n} tensors (at most {MAX_TENSORS})")
        self.kind = _KINDS[kind]
        self.id = msg_id
        self.payload_len = payload_len
        offset = _FIXED.size + n * _SIZE.size
        self.sizes = [_SIZE.unpack_from(buf, _FIXED.size + i * _SIZE.size)[0] for i in range(n)]
        if flags & FLAG_INLINE:
            if offset + payload_len > HEADER_BYTES:
                raise FrameError(f"inline payload of {payload_len} B overflows the header from rank {src}")
            self.inline_payload: bytes | None = buf[offset : offset + payload_len].tobytes()
        else:
            self.inline_payload = None
        self.inline_tensors: list[torch.Tensor] | None = None
        if flags & FLAG_INLINE_TENSORS:
            pos = offset + payload_len
            if not flags & FLAG_INLINE or pos + sum(self.sizes) > HEADER_BYTES:
                raise FrameError(f"inline storages overflow the header from rank {src}")
            if frame is None:
                frame = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
            tensors = []
            for size in self.sizes:
                tensors.append(frame[pos : pos + size].clone())
                pos += size
            self.inline_tensors = tensors


#: receive buffers at least this big are fresh mmap()s every time (glibc's largest mmap threshold), so
#: each receive would take a page fault per 4 KiB page; they are asked to use transparent huge pages
#: instead (a 64 MiB receive: ~22 ms of faults down to ~7 ms, measured; reused memory costs ~5 ms).
_HUGEPAGE_MIN_BYTES = 32 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _load_madvise() -> Any:
    try:
        import ctypes
        import sys

        if not sys.platform.startswith("linux"):
            return None
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        return madvise
    except (OSError, AttributeError):
        return None


_madvise = _load_madvise()


def recv_buffer(nbytes: int) -> torch.Tensor:
    """A ``uint8`` tensor to receive a frame of ``nbytes`` into (an ordinary, resizable allocation)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= _HUGEPAGE_MIN_BYTES and _madvise is not None:
        start = t.data_ptr()
        first = (start + _HUGE - 1) & ~(_HUGE - 1)
        last = (start + nbytes) & ~(_HUGE - 1)
        if last > first:
            _madvise(first, last - first, _MADV_HUGEPAGE)  # advice only: failure changes nothing
    return t


def new_header_tensor() -> tuple[torch.Tensor, memoryview]:
    """A header buffer and a writable byte view of it (struct packs straight into the tensor)."""
    t = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    return t, memoryview(t.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
