"""Wire framing for the gloo world.

Every message starts with one fixed-size header frame (a ``uint8`` tensor of ``HEADER_BYTES``). For a
small message the pickled payload rides inline in the header, so a small RPC is exactly one gloo send;
a larger payload follows as one more frame. Then each out-of-band storage follows as its own frame,
sent straight from the tensor's memory (no pickling, no copy). The receiver takes frames of up to
1 MiB into a receive it posted ahead and copies them out (see ``STAGED_BYTES`` in ``_receiver``), and
receives larger ones in place; one over ``GO_AHEAD_BYTES`` is sent only after the receiver's go-ahead
(``READY_TAG``), a frame of one byte that carries nothing else and so needs no tag of its own.

Header layout (little-endian): magic u32, version u16, flags u16, kind u16, used u16, src i32,
id i64, payload_len u64, n_tensors u32, ack u64, the frame's tag (16 bytes), the payload's tag (16
bytes), then n_tensors u64 storage sizes, then the inline payload. ``used`` and the two tags are set
only with a job key (``_auth``): ``used`` is where the frame's leading part ends (the tag covers that
part and the riders), the payload's tag authenticates a payload that travels apart from the header (as
a frame of its own or in the same-host ring); without a key they stay zero and nothing reads them.
``ack`` counts the header frames the sender has taken from its receive ring (and posted a receive again
for): the peer's credit for sends that cannot block (see Sender.try_send_now).

A header may also carry *riders* (``FLAG_RIDERS``): small payload-only messages that were sent
earlier but allowed to wait for the next frame to the same peer (``Message.deferrable``), delivered
before the header's own message. They sit at the end of the frame: each rider is kind u16, id i64,
payload_len u32 and the payload; the last four bytes say how many riders there are (u16) and how many
bytes they take (u16).

A header frame may carry further whole messages (``FLAG_MORE``: *coalescing*, when several messages
wait for the same peer): right after the first message's inline part, a u16 count, then one record per
message: kind u16, flags u16 (``FLAG_INLINE``, ``FLAG_INLINE_TENSORS``), id i64, payload_len u64,
n_tensors u32, the n_tensors u64 storage sizes, the payload and the storages. Senders only add
messages that fit whole (no data frame of their own); the receiver dispatches the riders, the first
message, then the records, in that order.

Between processes on one host the first message's data may travel through the sender's shared-memory
ring instead of data frames (``FLAG_SHM``, see ``_same_host``): then u64 ring positions follow the
storage sizes, one for the payload (unused when the payload is inline) and one for each storage; the
storages are all in the ring, and no data frame follows the header.

With a job key (``_auth``), a message whose data frames include one over ``GO_AHEAD_BYTES`` (the
receiver's ``_recv_data``) is sent *tag after* (``FLAG_TAG_AFTER``): its data tag travels in a frame of
its own (``TAG_BYTES``, a staged data frame) after its data instead of inside the header, and each data
frame over ``GO_AHEAD_BYTES`` travels in pieces of at most ``PIECE_BYTES`` (one gloo send and receive
each), so that both ends hash the data while gloo moves it, instead of before (the sender) and after
(the receiver).
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from twinrpc._errors import RPCError
from twinrpc._message import Kind, Message

from ._byte_view import byte_view
from ._same_host import SLOT_BYTES, OutRing

HEADER_BYTES = 4096
assert HEADER_BYTES == SLOT_BYTES, "a same-host header slot holds one header frame"
MAGIC = 0x54574E52  # "TWNR"
VERSION = 7
FLAG_INLINE = 1  # the payload is inside the header
FLAG_CLOSE = 2  # the sender is closing this link (graceful shutdown): no message follows
FLAG_GRACEFUL = 4  # with FLAG_CLOSE: the sender completed graceful shutdown (an orderly departure)
FLAG_INLINE_TENSORS = 8  # the storages follow the inline payload inside the header (small ones)
FLAG_RIDERS = 16  # earlier small messages ride at the end of the header (delivered first)
FLAG_MORE = 32  # further whole messages follow the first one's inline part (see the module docstring)
FLAG_SHM = 64  # the first message's data is in the sender's shared-memory ring (see the module docstring)
FLAG_TAG_AFTER = 128  # with a job key: the data tag follows the data (see the module docstring)
#: with FLAG_TAG_AFTER, a large data frame travels in pieces of at most this many bytes
PIECE_BYTES = 8 << 20

_FIXED = struct.Struct("<IHHHHiqQIQ")
#: the ``used`` field's offset (see the module docstring)
USED_AT = 10
TAG_BYTES = 16
#: where the frame's tag and the payload's tag sit (after the fixed fields), and the sizes after them
TAG_AT = _FIXED.size
PAYLOAD_TAG_AT = TAG_AT + TAG_BYTES
SIZES_AT = PAYLOAD_TAG_AT + TAG_BYTES
_SIZE = struct.Struct("<Q")
MAX_TENSORS = (HEADER_BYTES - SIZES_AT) // _SIZE.size
_RIDER = struct.Struct("<HqI")  # kind, id, payload length; the payload follows
_TRAILER = struct.Struct("<HH")  # riders, bytes they take (the last bytes of the header frame)
#: bytes of riders one header frame takes at most (the rest stays for the message's own inline payload)
MAX_RIDER_BYTES = 1024
_KINDS = {int(k): k for k in Kind}
_COUNT = struct.Struct("<H")  # records after the first message
_FLAGS = struct.Struct("<H")
_FLAGS_AT = 6  # the flags' offset in _FIXED (after magic u32 and version u16)
_RECORD = struct.Struct("<HHqQI")  # kind, flags, id, payload length, storages; then sizes, payload, storages
#: a message this small travels whole in a header frame even beside a full riders' block
WHOLE_BYTES = HEADER_BYTES - MAX_RIDER_BYTES - _TRAILER.size - _COUNT.size - _RECORD.size


class FrameError(RPCError):
    """A malformed or truncated frame arrived; the message is dropped, the link stays usable only if
    the frame boundary can still be trusted (it cannot after a bad header, so the link is closed)."""


class FrameTooLarge(FrameError):
    """A header announced more bytes than this worker accepts in one message (MAX_MESSAGE_BYTES):
    refused before anything is allocated for them, and the link to that peer fails (the frames that
    would follow cannot be told apart from the next header)."""


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """The spans of the pieces a data frame of ``nbytes`` travels in when sent tag after
    (``FLAG_TAG_AFTER``; each at most ``PIECE_BYTES``)."""
    return [(at, min(at + PIECE_BYTES, nbytes)) for at in range(0, nbytes, PIECE_BYTES)]


def _max_message_bytes() -> int:
    """The most bytes one message may announce: ``TWINRPC_MAX_MESSAGE_BYTES``, else this machine's
    physical memory (no message larger than that can be received, so no legitimate sender is
    refused)."""
    import os

    text = os.environ.get("TWINRPC_MAX_MESSAGE_BYTES", "")
    if text:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"TWINRPC_MAX_MESSAGE_BYTES must be a positive number of bytes, got {text!r}")
        return value
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


#: read once per process: what a receiver allows one message to announce (payload and storages)
MAX_MESSAGE_BYTES = _max_message_bytes()


def check_announced(record: Record, peer: str, limit: int) -> None:
    """Refuse a message whose header announces more bytes still to come than ``limit`` (checked
    before any receive buffer is allocated for them).

    Raises:
        FrameTooLarge: naming the peer, what it announced and the limit.
    """
    payload = record.payload_len if record.inline_payload is None else 0
    storages = sum(record.sizes) if record.inline_tensors is None else 0
    if payload + storages > limit:
        raise FrameTooLarge(
            f"{peer} announced a {record.kind.name} message of {payload + storages} B still to come "
            f"(payload {payload} B, {len(record.sizes)} storages), more than the {limit} B this worker "
            "accepts in one message (TWINRPC_MAX_MESSAGE_BYTES, default: physical memory); the link to "
            "it is closed"
        )


def rider_bytes(msg: Message) -> int:
    """Bytes ``msg`` takes as a rider (see the module docstring)."""
    return _RIDER.size + len(msg.payload)


def can_ride(msg: Message) -> bool:
    """Whether ``msg`` can travel as a rider: payload only, and small."""
    return not msg.tensors and rider_bytes(msg) <= MAX_RIDER_BYTES


def encode_header(
    buf: memoryview,
    msg: Message,
    ack: int = 0,
    riders: list[Message] | None = None,
    ring: OutRing | None = None,
) -> tuple[bool, bool]:
    """Fill ``buf`` (a view of the header tensor) for ``msg``; returns whether the payload is inline
    and whether the storages are inline too (then the header is the whole message: one gloo send
    instead of one per storage, each of which would wait for the peer to post its receive).
    ``riders`` (each :func:`can_ride`, together at most ``MAX_RIDER_BYTES``) travel at its end.
    With ``ring``, data that would follow as frames goes into it if it fits (``FLAG_SHM``): then
    nothing follows the header either, and both are returned True."""
    inline, inline_tensors, _, _ = _encode_first(buf, msg, ack, riders, ring)
    return inline, inline_tensors


def _ring_sizes(msg: Message, limit: int) -> tuple[bool, list[int]]:
    """With ring positions in the header: whether ``msg``'s payload is still inline, and the sizes of
    what goes into the ring (the payload unless inline, then every storage)."""
    n = len(msg.tensors)
    inline = SIZES_AT + (2 * n + 1) * _SIZE.size + len(msg.payload) <= limit
    sizes = [] if inline else [len(msg.payload)]
    return inline, sizes + [t.numel() for t in msg.tensors]


def ring_fits(msg: Message, ring: OutRing) -> bool:
    """Whether ``msg`` can go with its data in ``ring`` now, whatever riders share its frame (then it
    needs no data frame: a send that cannot wait for the peer's receiver)."""
    if 2 * len(msg.tensors) + 1 > MAX_TENSORS:
        return False
    _, sizes = _ring_sizes(msg, HEADER_BYTES - MAX_RIDER_BYTES - _TRAILER.size)
    return ring.fits(sizes)


def _encode_first(
    buf: memoryview, msg: Message, ack: int, riders: list[Message] | None, ring: OutRing | None = None
) -> tuple[bool, bool, int, int]:
    """encode_header, also returning where the frame's used part ends and where the riders start."""
    tensors = msg.tensors
    n = len(tensors)
    if n > MAX_TENSORS:
        raise RPCError(f"a message may carry at most {MAX_TENSORS} distinct tensor storages, got {n}")
    limit = HEADER_BYTES
    if riders:
        limit = _encode_riders(buf, riders)
    payload = msg.payload
    offset = SIZES_AT + n * _SIZE.size
    end = offset + len(payload)
    inline = end <= limit
    sizes = [t.numel() for t in tensors]
    inline_tensors = inline and n > 0 and end + sum(sizes) <= limit
    positions = None
    if ring is not None and not (inline and (inline_tensors or n == 0)) and 2 * n + 1 <= MAX_TENSORS:
        ring_inline, _ = _ring_sizes(msg, limit)
        positions = ring.place(None if ring_inline else payload, tensors)
        if positions is not None:
            inline, inline_tensors = ring_inline, False
            if inline:
                positions.insert(0, 0)  # the payload's slot, unused
            offset += (n + 1) * _SIZE.size
            end = offset + len(payload)
    _FIXED.pack_into(
        buf,
        0,
        MAGIC,
        VERSION,
        (FLAG_INLINE if inline else 0)
        | (FLAG_INLINE_TENSORS if inline_tensors else 0)
        | (FLAG_RIDERS if riders else 0)
        | (FLAG_SHM if positions is not None else 0),
        int(msg.kind),
        0,
        msg.src,
        msg.id,
        len(payload),
        n,
        ack,
    )
    at = SIZES_AT
    for size in sizes:
        _SIZE.pack_into(buf, at, size)
        at += _SIZE.size
    for pos in positions or ():
        _SIZE.pack_into(buf, at, pos)
        at += _SIZE.size
    if inline:
        buf[offset:end] = payload
    else:
        end = offset
    if inline_tensors:
        end = _put_storages(buf, end, tensors, sizes)
    if positions is not None:
        return True, True, end, limit
    return inline, inline_tensors, end, limit


def _put_storages(buf: memoryview, pos: int, tensors: list[torch.Tensor], sizes: list[int]) -> int:
    for t, size in zip(tensors, sizes, strict=True):
        if size:
            buf[pos : pos + size] = byte_view(t)  # a contiguous uint8 buffer (not t.numpy(): see _byte_view)
            pos += size
    return pos


def fits_whole(msg: Message) -> bool:
    """Whether ``msg`` travels whole inside a header frame (payload and storages), whatever riders
    share it: such a message can ride the next frame (see ``FrameEncoder.add``)."""
    size = len(msg.payload) + _SIZE.size * len(msg.tensors)
    if size > WHOLE_BYTES:
        return False
    for t in msg.tensors:
        size += t.numel()
    return size <= WHOLE_BYTES


class FrameEncoder:
    """Fills one header frame with several messages: the first one (as encode_header does), then
    further whole messages while they fit (``FLAG_MORE``). One per send buffer; not thread-safe (the
    sender uses it under its send lock)."""

    __slots__ = ("_buf", "_count_at", "_limit", "_pos", "count")

    def __init__(self, buf: memoryview) -> None:
        self._buf = buf
        self._pos = self._limit = self._count_at = 0
        #: messages added after the first one
        self.count = 0

    @property
    def used(self) -> int:
        """Where the frame's leading part (the messages, not the riders) ends so far."""
        return self._pos

    def first(
        self, msg: Message, ack: int, riders: list[Message] | None, ring: OutRing | None = None
    ) -> tuple[bool, bool]:
        """Start the frame with ``msg`` (see encode_header); raises if ``msg`` cannot be framed."""
        inline, inline_tensors, self._pos, self._limit = _encode_first(self._buf, msg, ack, riders, ring)
        self.count = 0
        return inline, inline_tensors

    def add(self, msg: Message) -> bool:
        """Append ``msg`` whole (payload and storages inside the frame) if it fits; False: it does not,
        and the frame is unchanged."""
        buf, tensors, payload = self._buf, msg.tensors, msg.payload
        n = len(tensors)
        pos = self._pos if self.count else self._pos + _COUNT.size
        head = pos + _RECORD.size + n * _SIZE.size
        if n > MAX_TENSORS or head + len(payload) > self._limit:
            return False
        sizes = [t.numel() for t in tensors]
        end = head + len(payload) + sum(sizes)
        if end > self._limit:
            return False
        if not self.count:
            self._count_at = self._pos
            flags = _FLAGS.unpack_from(buf, _FLAGS_AT)[0]
            _FLAGS.pack_into(buf, _FLAGS_AT, flags | FLAG_MORE)
        _RECORD.pack_into(
            buf, pos, int(msg.kind), FLAG_INLINE | (FLAG_INLINE_TENSORS if n else 0), msg.id, len(payload), n
        )
        pos += _RECORD.size
        for size in sizes:
            _SIZE.pack_into(buf, pos, size)
            pos += _SIZE.size
        buf[pos : pos + len(payload)] = payload
        self._pos = _put_storages(buf, pos + len(payload), tensors, sizes)
        self.count += 1
        _COUNT.pack_into(buf, self._count_at, self.count)
        return True


def _encode_riders(buf: memoryview, riders: list[Message]) -> int:
    """Write ``riders`` at the end of the frame; returns where they start (the message's limit)."""
    total = sum(rider_bytes(r) for r in riders)
    if total > MAX_RIDER_BYTES or len(riders) > MAX_RIDER_BYTES // _RIDER.size:
        raise RPCError(f"riders of {total} B exceed the {MAX_RIDER_BYTES} B a header frame keeps for them")
    start = pos = HEADER_BYTES - _TRAILER.size - total
    for r in riders:
        _RIDER.pack_into(buf, pos, int(r.kind), r.id, len(r.payload))
        pos += _RIDER.size
        buf[pos : pos + len(r.payload)] = r.payload
        pos += len(r.payload)
    _TRAILER.pack_into(buf, HEADER_BYTES - _TRAILER.size, len(riders), total)
    return start


def encode_close(buf: memoryview, src: int, graceful: bool = False) -> None:
    flags = FLAG_CLOSE | (FLAG_GRACEFUL if graceful else 0)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, flags, 0, 0, src, 0, 0, 0, 0)


class Record:
    """One decoded message of a header frame: its kind, id, payload length and storage sizes, with
    the payload and storages that travelled inside the frame (None: they follow as data frames, or
    are in the sender's ring at ``positions``: the payload's, then each storage's)."""

    __slots__ = ("id", "inline_payload", "inline_tensors", "kind", "payload_len", "positions", "sizes")

    kind: Kind
    id: int
    payload_len: int
    sizes: list[int]
    inline_payload: bytes | None
    inline_tensors: list[torch.Tensor] | None
    positions: list[int] | None

    def _decode_inline(
        self, buf: memoryview, pos: int, flags: int, limit: int, src: int, frame: torch.Tensor | None
    ) -> int:
        """Take the inline payload and storages at ``pos`` (per ``flags``); returns where they end."""
        payload_len = self.payload_len
        if flags & FLAG_INLINE:
            if pos + payload_len > limit:
                raise FrameError(f"inline payload of {payload_len} B overflows the header from rank {src}")
            self.inline_payload = buf[pos : pos + payload_len].tobytes()
            pos += payload_len
        else:
            self.inline_payload = None
        self.inline_tensors = None
        if flags & FLAG_INLINE_TENSORS:
            if not flags & FLAG_INLINE or pos + sum(self.sizes) > limit:
                raise FrameError(f"inline storages overflow the header from rank {src}")
            if frame is None:
                frame = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
            tensors = []
            for size in self.sizes:
                tensors.append(frame[pos : pos + size].clone())
                pos += size
            self.inline_tensors = tensors
        return pos


class Header(Record):
    """A decoded header frame: its first message (the Record fields), the frame's own fields, the
    riders before it and the further messages after it (``more``)."""

    __slots__ = ("ack", "closing", "data_tag", "graceful", "more", "riders", "src", "tag_after")

    #: with a job key: what the data sent apart from the header must match (set by the receiver,
    #: which checked the header's own tag before decoding it; see _auth.FrameAuth.check_data)
    data_tag: tuple[bytes, int]

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
        #: the data tag follows the data, which travels in pieces (FLAG_TAG_AFTER)
        self.tag_after = bool(flags & FLAG_TAG_AFTER)
        #: the further messages of the frame, in the order they were sent (after this one)
        self.more: list[Record] = []
        if self.closing:
            return
        if kind not in _KINDS:
            raise FrameError(f"unknown message kind {kind} from rank {src}")
        if n > MAX_TENSORS:
            raise FrameError(f"header from rank {src} claims {n} tensors (at most {MAX_TENSORS})")
        self.kind = _KINDS[kind]
        self.id = msg_id
        self.payload_len = payload_len
        offset = SIZES_AT + n * _SIZE.size
        self.sizes = [_SIZE.unpack_from(buf, SIZES_AT + i * _SIZE.size)[0] for i in range(n)]
        self.positions = None
        if flags & FLAG_SHM:
            if flags & FLAG_INLINE_TENSORS or 2 * n + 1 > MAX_TENSORS:
                raise FrameError(f"a shared-memory header from rank {src} is malformed (flags {flags:#x})")
            self.positions = [_SIZE.unpack_from(buf, offset + i * _SIZE.size)[0] for i in range(n + 1)]
            offset += (n + 1) * _SIZE.size
        limit = HEADER_BYTES
        #: (kind, id, payload) of each rider, in the order they were sent
        self.riders: list[tuple[Kind, int, bytes]] = []
        if flags & FLAG_RIDERS:
            limit = self._decode_riders(buf, offset)
        pos = self._decode_inline(buf, offset, flags, limit, src, frame)
        if flags & FLAG_MORE:
            self._decode_more(buf, pos, limit, frame)

    def _decode_more(self, buf: memoryview, pos: int, limit: int, frame: torch.Tensor | None) -> None:
        src = self.src
        if pos + _COUNT.size > limit:
            raise FrameError(f"the message count overflows the header from rank {src}")
        (count,) = _COUNT.unpack_from(buf, pos)
        pos += _COUNT.size
        if count == 0 or count > (limit - pos) // _RECORD.size:
            raise FrameError(f"a header from rank {src} claims {count} further messages, which cannot fit")
        for _ in range(count):
            if pos + _RECORD.size > limit:
                raise FrameError(f"message records overflow the header from rank {src}")
            kind, flags, msg_id, payload_len, n = _RECORD.unpack_from(buf, pos)
            pos += _RECORD.size
            if kind not in _KINDS:
                raise FrameError(f"unknown message kind {kind} in a record from rank {src}")
            if n > MAX_TENSORS or pos + n * _SIZE.size > limit:
                raise FrameError(f"a record from rank {src} claims {n} tensors, which overflow the header")
            if not flags & FLAG_INLINE or (n and not flags & FLAG_INLINE_TENSORS):
                raise FrameError(f"a further message from rank {src} is not whole inside its header frame")
            record = Record()
            record.kind = _KINDS[kind]
            record.id = msg_id
            record.payload_len = payload_len
            record.sizes = [_SIZE.unpack_from(buf, pos + i * _SIZE.size)[0] for i in range(n)]
            record.positions = None
            pos = record._decode_inline(buf, pos + n * _SIZE.size, flags, limit, src, frame)
            self.more.append(record)

    def _decode_riders(self, buf: memoryview, offset: int) -> int:
        count, total = _TRAILER.unpack_from(buf, HEADER_BYTES - _TRAILER.size)
        start: int = HEADER_BYTES - _TRAILER.size - total
        if total > MAX_RIDER_BYTES or start < offset:
            raise FrameError(f"riders of {total} B overflow the header from rank {self.src}")
        pos = start
        for _ in range(count):
            if pos + _RIDER.size > start + total:
                raise FrameError(
                    f"{count} riders do not fit their {total} B in the header from rank {self.src}"
                )
            kind, msg_id, n = _RIDER.unpack_from(buf, pos)
            pos += _RIDER.size
            if kind not in _KINDS:
                raise FrameError(f"unknown rider message kind {kind} from rank {self.src}")
            if pos + n > start + total:
                raise FrameError(f"a rider's payload of {n} B overflows the header from rank {self.src}")
            self.riders.append((_KINDS[kind], msg_id, buf[pos : pos + n].tobytes()))
            pos += n
        if pos != start + total:
            raise FrameError(
                f"riders take {pos - start} B, not the {total} B the header from rank {self.src} says"
            )
        return start


#: receive buffers at least this big are fresh mmap()s every time (glibc's largest mmap threshold), so
#: each receive would take a page fault per 4 KiB page; they are asked to use transparent huge pages
#: instead, which takes most of those faults away (figures: docs/explanation/benchmarks.md).
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
