"""Wire framing for the gloo world.

Every message starts with one fixed-size header frame (a ``uint8`` tensor of ``HEADER_BYTES``). For a
small message the pickled payload rides inline in the header, so a small RPC is exactly one gloo send;
a larger payload follows as one more frame. Then each out-of-band storage follows as its own frame,
sent straight from the tensor's memory (no pickling, no copy).

Header layout (little-endian): magic u32, version u16, flags u16, kind u16, reserved u16, src i32,
id i64, payload_len u64, n_tensors u32, then n_tensors u64 storage sizes, then the inline payload.
"""

from __future__ import annotations

import struct

import torch

from twinrpc._errors import RPCError
from twinrpc._message import Kind, Message

HEADER_BYTES = 4096
MAGIC = 0x54574E52  # "TWNR"
VERSION = 1
FLAG_INLINE = 1  # the payload is inside the header
FLAG_CLOSE = 2  # the sender is closing this link (graceful shutdown): no message follows
FLAG_GRACEFUL = 4  # with FLAG_CLOSE: the sender completed graceful shutdown (an orderly departure)

_FIXED = struct.Struct("<IHHHHiqQI")
_SIZE = struct.Struct("<Q")
MAX_TENSORS = (HEADER_BYTES - _FIXED.size) // _SIZE.size
_KINDS = {int(k): k for k in Kind}


class FrameError(RPCError):
    """A malformed or truncated frame arrived; the message is dropped, the link stays usable only if
    the frame boundary can still be trusted (it cannot after a bad header, so the link is closed)."""


def encode_header(buf: memoryview, msg: Message) -> bool:
    """Fill ``buf`` (a view of the header tensor) for ``msg``; returns whether the payload is inline."""
    n = len(msg.tensors)
    if n > MAX_TENSORS:
        raise RPCError(f"a message may carry at most {MAX_TENSORS} distinct tensor storages, got {n}")
    payload = msg.payload
    offset = _FIXED.size + n * _SIZE.size
    inline = offset + len(payload) <= HEADER_BYTES
    _FIXED.pack_into(
        buf,
        0,
        MAGIC,
        VERSION,
        FLAG_INLINE if inline else 0,
        int(msg.kind),
        0,
        msg.src,
        msg.id,
        len(payload),
        n,
    )
    for i, t in enumerate(msg.tensors):
        _SIZE.pack_into(buf, _FIXED.size + i * _SIZE.size, t.numel())
    if inline:
        buf[offset : offset + len(payload)] = payload
    return inline


def encode_close(buf: memoryview, src: int, graceful: bool = False) -> None:
    flags = FLAG_CLOSE | (FLAG_GRACEFUL if graceful else 0)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, flags, 0, 0, src, 0, 0, 0)


class Header:
    """A decoded header."""

    __slots__ = ("closing", "graceful", "id", "inline_payload", "kind", "payload_len", "sizes", "src")

    def __init__(self, buf: memoryview, expected_src: int, dst: int) -> None:
        try:
            magic, version, flags, kind, _, src, msg_id, payload_len, n = _FIXED.unpack_from(buf, 0)
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


def new_header_tensor() -> tuple[torch.Tensor, memoryview]:
    """A header buffer and a writable byte view of it (struct packs straight into the tensor)."""
    t = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    return t, memoryview(t.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
