"""Authenticated frames and rendezvous entries: the job key (``auth_key`` / ``TWINRPC_AUTH_KEY``).

With a key, nothing a process without it sends is unpickled or built into a tensor, and nothing it
writes to the store is believed, nor anything recorded in an earlier run and written back:

* **Rendezvous entries.** The store is wrapped (:class:`AuthStore`): every value twinrpc and gloo write
  through it carries a MAC over the entry's full key and value, and every value read is checked before
  use. An empty value carries none (it is how an entry is cleared, which a process with store access
  can do anyway by deleting it); ``add`` counters cannot carry one either.
* **Bound to this run.** A MAC over name and value alone is the same in every run with the same key,
  so entries a worker acts on are MACed a second time under a key only this run has, made from fresh
  random nonces of the very workers that read them: a static group's names under the *run key*
  (every rank posts a nonce first, and the run key hashes all of them: :meth:`JobAuth.run`), and each
  pair's entries (gloo's addresses, the same-host offers) under the *link key*, made from the two
  peers' nonces (:meth:`JobAuth.link`, exchanged before the pair's gloo group is made). A reader's own
  nonce is new, so an entry written in any earlier run, or an earlier torchrun attempt, or with a
  nonce replayed in place of a peer's, fails its check: the reader raises and connects nowhere. A
  dynamic group's member list is confirmed by its live members' answers to a joiner's challenge
  instead (impl/_dynamic_group.py).
* **Frames.** Every header frame carries a tag (keyed BLAKE2b under the link key) over its meaningful
  bytes (the fixed fields, the messages and the riders), the direction (sender and receiver ranks) and
  its sequence number on the link, which are hashed in the tag's own place (one contiguous run of bytes
  to hash); the sequence number is not sent: both sides count header frames, so a frame replayed,
  reordered or dropped fails the check. What a header's first message sends apart from it (its payload
  in a frame of its own or in the same-host ring, its storages in frames of their own) has a *data
  tag* in the header: Poly1305 (from ``cryptography``; several times faster than BLAKE2b) under a
  one-time key drawn from the link key, the direction and the header's sequence number. The receiver
  checks a header's tag before decoding it and the data tag before unpickling the payload or handing
  a storage on, so a frame that fails is dropped unused, and the link to its sender fails with
  :class:`AuthenticationError`.
* **Large data hashed while it moves.** A message with a data frame over the receiver's go-ahead size
  is sealed *tag after* (``_framing.FLAG_TAG_AFTER``, which the header's tag covers): its data tag
  (the same Poly1305 under the same one-time key) follows its data in a frame of its own, and its large
  frames travel in pieces, so the sender hashes each piece while gloo sends it and the receiver each
  piece while the next arrives; the receiver still checks the tag before anything of the message is
  used.
* **Not covered:** storages that travel through the same-host ring (shared memory only processes of
  the same user can map, which can read the job key anyway); and secrecy (frames are authenticated,
  not encrypted).

Keyed BLAKE2b for header tags, because it is the cheapest keyed hash in the standard library (figures:
docs/explanation/benchmarks.md); benchmarks/bench_auth.py measures what the key costs a call and a large
tensor.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from twinrpc._errors import AuthenticationError
from twinrpc._key_source import auth_key_of as job_key

from ._byte_view import byte_view
from ._framing import (
    _FLAGS,
    _FLAGS_AT,
    _TRAILER,
    FLAG_INLINE,
    FLAG_INLINE_TENSORS,
    FLAG_RIDERS,
    FLAG_SHM,
    FLAG_TAG_AFTER,
    HEADER_BYTES,
    MAX_RIDER_BYTES,
    PAYLOAD_TAG_AT,
    SIZES_AT,
    TAG_AT,
    TAG_BYTES,
    USED_AT,
)
from ._stores import WrappedStore

#: how an authenticated store value starts: lets a worker without a key recognise one
MARK = b"twinrpc-mac1:"

_USED = struct.Struct("<H")
#: sender rank, receiver rank, sequence number: hashed in the tag's place (both are TAG_BYTES long)
_CONTEXT = struct.Struct("<iiQ")
_FLAGS_USED = struct.Struct("<H2xH")  # from the flags' offset: flags, kind (skipped), used
_NAME_LEN = struct.Struct("<I")
#: bytes of a data frame hashed per call: the GIL is free between two (Poly1305 holds it)
_DATA_CHUNK = 4 << 20
_NONCE_BYTES = 16

__all__ = [
    "AuthStore",
    "AuthenticationError",
    "DataMac",
    "DataTag",
    "FrameAuth",
    "JobAuth",
    "LinkAuth",
    "job_key",
    "refuse_marked",
    "sent_apart",
]

#: what a header's check hands on for the data sent apart from it: the data tag it carries and the
#: header's sequence number (which the one-time key is drawn from)
DataTag = tuple[bytes, int]


def _poly1305() -> Any:
    try:
        from cryptography.hazmat.primitives.poly1305 import Poly1305
    except ImportError as exc:  # a dependency of twinrpc's: only a broken install lacks it
        raise ImportError(
            "twinrpc's job key authenticates tensor data with Poly1305 from the 'cryptography' package, "
            "which is not installed: pip install cryptography"
        ) from exc
    return Poly1305


class FrameAuth:
    """One link's frame MACs (see the module docstring). The sender and the receiver each call their
    own methods under their own locks; nothing here changes after construction."""

    __slots__ = ("_base", "_data_base", "_me", "_peer", "_poly")

    def __init__(self, link_key: bytes, me: int, peer: int) -> None:
        self._base = hashlib.blake2b(key=link_key, digest_size=TAG_BYTES)
        self._data_base = hashlib.blake2b(key=link_key, digest_size=32, person=b"twinrpc-data")
        self._poly = _poly1305()
        self._me = me
        self._peer = peer

    def _header_tag(
        self, view: memoryview, src: int, dst: int, seq: int, flags: int, used: int
    ) -> bytes | None:
        """The tag of the header in ``view``: its bytes up to ``used`` (and its riders), with the
        direction and sequence number standing in the tag's own place (which this overwrites). None:
        its ``used`` or riders' fields are inconsistent, which no keyed sender writes."""
        if not SIZES_AT <= used <= HEADER_BYTES:
            return None
        _CONTEXT.pack_into(view, TAG_AT, src, dst, seq)
        h = self._base.copy()
        h.update(view[:used])
        if flags & FLAG_RIDERS:
            _, total = _TRAILER.unpack_from(view, HEADER_BYTES - _TRAILER.size)
            start = HEADER_BYTES - _TRAILER.size - total
            if total > MAX_RIDER_BYTES or start < used:
                return None
            h.update(view[start:])
        return h.digest()

    def _data_mac(self, src: int, dst: int, seq: int) -> DataMac:
        """The data MAC of the ``seq``-th header from ``src`` to ``dst``: Poly1305 under a key used for
        this header only, to be fed the payload and storages sent apart, in order (their sizes are in
        the header, so the run of bytes is unambiguous)."""
        h = self._data_base.copy()
        h.update(_CONTEXT.pack(src, dst, seq))
        return DataMac(self._poly(h.digest()))

    def _data_tag(self, src: int, dst: int, seq: int, parts: Sequence[Any]) -> bytes:
        """The data tag of the ``seq``-th header from ``src`` to ``dst`` over ``parts``."""
        mac = self._data_mac(src, dst, seq)
        for part in parts:
            mac.update(part)
        return mac.finalize()

    def incoming_mac(self, expected: DataTag) -> DataMac:
        """For a header sealed tag after: the MAC to feed the data it announced as it arrives (the
        tag to compare follows the data, see :meth:`check_tag_after`)."""
        return self._data_mac(self._peer, self._me, expected[1])

    def check_tag_after(self, mac: DataMac, tag: bytes, msg_id: int, peer_name: str) -> None:
        """Check the tag that followed a message's data (fed to ``mac``) before it is used.

        Raises:
            AuthenticationError: naming the peer.
        """
        if not hmac.compare_digest(mac.finalize(), tag):
            raise _data_failed(msg_id, peer_name)

    def seal(
        self,
        view: memoryview,
        seq: int,
        used: int,
        payload: bytes,
        storages: Sequence[torch.Tensor] = (),
        after_over: int | None = None,
    ) -> DataMac | None:
        """Tag the header frame in ``view`` (its leading part ends at ``used``), our ``seq``-th on this
        link. ``payload`` and ``storages``: its first message's; what of them travels apart from the
        header (by its flags: a payload not inline, storages neither inline nor in the same-host ring)
        gets the data tag. If a part is over ``after_over`` bytes, the header is sealed tag after
        (``FLAG_TAG_AFTER``) and the data MAC is returned for the sender to feed as it sends the data
        and to send its tag after it; else None."""
        _USED.pack_into(view, USED_AT, used)
        (flags,) = _FLAGS.unpack_from(view, _FLAGS_AT)
        parts = sent_apart(
            bool(flags & FLAG_INLINE), bool(flags & (FLAG_INLINE_TENSORS | FLAG_SHM)), payload, storages
        )
        mac = None
        # (data in the same-host ring is not sent in frames: its tag stays in the header)
        tag_after = after_over is not None and not flags & FLAG_SHM
        if parts and tag_after and any(_nbytes(p) > after_over for p in parts):
            flags |= FLAG_TAG_AFTER
            _FLAGS.pack_into(view, _FLAGS_AT, flags)
            view[PAYLOAD_TAG_AT:SIZES_AT] = bytes(TAG_BYTES)
            mac = self._data_mac(self._me, self._peer, seq)
        elif parts:
            view[PAYLOAD_TAG_AT:SIZES_AT] = self._data_tag(self._me, self._peer, seq, parts)
        tag = self._header_tag(view, self._me, self._peer, seq, flags, used)
        assert tag is not None  # our own encoder keeps the riders after the leading part
        view[TAG_AT:PAYLOAD_TAG_AT] = tag
        return mac

    def check_header(self, view: memoryview, seq: int, peer_name: str) -> DataTag:
        """Check the peer's ``seq``-th header frame, before anything in it is decoded; returns what the
        data sent apart from it (if any) must match (for :meth:`check_data`).

        Raises:
            AuthenticationError: naming the peer; nothing in the frame may be used.
        """
        flags, used = _FLAGS_USED.unpack_from(view, _FLAGS_AT)
        sent = bytes(view[TAG_AT:PAYLOAD_TAG_AT])
        tag = self._header_tag(view, self._peer, self._me, seq, flags, used)
        view[TAG_AT:PAYLOAD_TAG_AT] = sent  # the frame as it arrived
        if tag is None or not hmac.compare_digest(tag, sent):
            raise AuthenticationError(
                f"authentication failed: frame {seq} from {peer_name} does not carry this job's MAC "
                "(it was sent by a process without the job's key, or replayed, reordered or altered on "
                f"the way, or the workers were started with different keys); it was dropped unread and "
                f"the link to {peer_name} is closed"
            )
        return bytes(view[PAYLOAD_TAG_AT:SIZES_AT]), seq

    def check_data(self, parts: Sequence[Any], expected: DataTag, msg_id: int, peer_name: str) -> None:
        """Check what a message sent apart from its (checked) header, ``parts`` as :func:`sent_apart`
        lists them, before the payload is unpickled or a tensor is built from a storage.

        Raises:
            AuthenticationError: naming the peer.
        """
        tag, seq = expected
        if not hmac.compare_digest(self._data_tag(self._peer, self._me, seq, parts), tag):
            raise _data_failed(msg_id, peer_name)


def _data_failed(msg_id: int, peer_name: str) -> AuthenticationError:
    return AuthenticationError(
        f"authentication failed: the data of message {msg_id} from {peer_name} (its payload or tensor "
        "storages, sent after its header) does not match the MAC sent with it (altered on the way); it "
        f"was dropped unused and the link to {peer_name} is closed"
    )


def _bytes_of(part: Any) -> memoryview:
    return byte_view(part) if isinstance(part, torch.Tensor) else memoryview(part).cast("B")


def _nbytes(part: Any) -> int:
    return part.numel() if isinstance(part, torch.Tensor) else len(part)


class DataMac:
    """A data tag being computed: fed the data sent apart from one header, in order."""

    __slots__ = ("_mac",)

    def __init__(self, mac: Any) -> None:
        self._mac = mac

    def update(self, part: Any) -> None:
        """Feed ``part`` (a ``uint8`` tensor, bytes or a buffer), a chunk at a time (the GIL is
        free between two: Poly1305 holds it)."""
        view = _bytes_of(part)
        for at in range(0, len(view), _DATA_CHUNK):
            self._mac.update(view[at : at + _DATA_CHUNK])

    def finalize(self) -> bytes:
        return bytes(self._mac.finalize())


def sent_apart(
    payload_inline: bool, storages_inline: bool, payload: Any, storages: Sequence[Any]
) -> list[Any]:
    """What of a header's first message travels apart from the header: the payload unless inline,
    then the storages unless inline or in the same-host ring (``storages_inline``; empty ones send
    nothing)."""
    parts = [] if payload_inline else [payload]
    if not storages_inline:
        parts += [s for s in storages if len(s)]
    return parts


class _StoreMac:
    """The MAC of store entries under one key; ``stale`` says, for an error, why an entry may fail."""

    __slots__ = ("_base", "stale")

    def __init__(self, key: bytes, person: bytes, stale: str) -> None:
        self._base = hashlib.blake2b(key=key, digest_size=TAG_BYTES, person=person)
        self.stale = stale

    def tag(self, name: str, value: bytes) -> bytes:
        h = self._base.copy()
        raw = name.encode()
        h.update(_NAME_LEN.pack(len(raw)))
        h.update(raw)
        h.update(value)
        return h.digest()


class LinkAuth:
    """What a pair's nonce exchange gives: the link's frame MACs, and the pair's store bound to the
    link (gloo's addresses and the same-host offers go through it)."""

    __slots__ = ("frames", "store")

    def __init__(self, frames: FrameAuth, store: AuthStore) -> None:
        self.frames = frames
        self.store = store


class JobAuth:
    """The job key of this process: wraps rendezvous stores, and binds them to a run or a link."""

    def __init__(self, key: bytes) -> None:
        # BLAKE2b takes keys of up to 64 bytes: a job key of any length is hashed to one first.
        self._master = hashlib.blake2b(key, digest_size=32, person=b"twinrpc-job").digest()
        self._store_mac = _StoreMac(
            self._master,
            b"twinrpc-store",
            "not written with this worker's key (workers started with different keys, or a process "
            "without the key wrote it)",
        )
        #: every AuthStore made: C++ holds them by a pointer that does not keep the Python half alive
        self._stores: list[AuthStore] = []

    def release(self) -> None:
        """Let go of the stores made (RPC has stopped, and nothing of C++ uses them any more): their
        connections close now. They refer to the list that keeps them, so without this only a
        garbage collection would free them."""
        self._stores.clear()

    def wrap(self, store: Any) -> AuthStore:
        """``store`` with every value authenticated (see AuthStore)."""
        return self._wrap(store, self._store_mac)

    def _wrap(self, store: Any, mac: _StoreMac) -> AuthStore:
        wrapped = AuthStore(store, mac, self._stores)
        self._stores.append(wrapped)
        return wrapped

    def _derive(self, person: bytes, *parts: object) -> bytes:
        text = " ".join(str(p) for p in parts).encode()
        return hashlib.blake2b(text, key=self._master, digest_size=32, person=person).digest()

    def _bound(self, store: Any, key: bytes, what: str) -> AuthStore:
        stale = (
            f"not written in this run of the {what} (recorded in an earlier run or attempt and written "
            "back, or a nonce of another run put in place of a peer's), or workers started with "
            "different keys"
        )
        return self._wrap(store, _StoreMac(key, b"twinrpc-bound", stale))

    def run(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> AuthStore:
        """``store`` bound to this run of a static group: post a fresh nonce as ``nonce/<rank>``,
        wait for every rank's, and MAC under a key hashed from all of them (see the module docstring).

        Raises:
            AuthenticationError: a rank's nonce is not authenticated with this job's key.
            RuntimeError: not every rank posted its nonce within ``timeout`` (the caller says who).
        """
        mine = os.urandom(_NONCE_BYTES).hex()
        store.set(f"nonce/{rank}", mine)
        keys = [f"nonce/{r}" for r in range(world_size)]
        store.wait(keys, timeout)
        nonces = [mine if r == rank else store.get(k).decode() for r, k in enumerate(keys)]
        return self.run_of(store, nonces)

    def run_of(self, store: Any, nonces: list[str]) -> AuthStore:
        """``store`` bound to the run of a static group whose ranks posted ``nonces`` (see run)."""
        return self._bound(store, self._derive(b"twinrpc-run", len(nonces), *nonces), "group")

    def link(self, store: Any, me: int, peer: int) -> LinkAuth:
        """The link between ``me`` and ``peer``: each side posts a fresh nonce to ``store`` and reads
        the other's (waiting for it at most the store's timeout); the link key hashes both. Call it
        before the pair's gloo group is made, over the returned store.

        Raises:
            AuthenticationError: the peer's nonce is not authenticated with this job's key.
        """
        low, high = min(me, peer), max(me, peer)
        mine = os.urandom(_NONCE_BYTES).hex()
        store.set(f"pair/{low}-{high}/nonce/{me}", mine)
        theirs = store.get(f"pair/{low}-{high}/nonce/{peer}").decode()
        nonces = (mine, theirs) if me == low else (theirs, mine)
        link_key = self._derive(b"twinrpc-link", low, high, *nonces)
        return LinkAuth(FrameAuth(link_key, me, peer), self._bound(store, link_key, "link"))


def refuse_marked(value: bytes, what: str) -> None:
    """For a worker without a key: refuse a store entry that a keyed worker wrote.

    Raises:
        AuthenticationError: ``value`` is authenticated, so another worker has a key and this one not.
    """
    if value.startswith(MARK):
        raise AuthenticationError(
            f"authentication mismatch: {what} was written by a worker with an authentication key, and "
            "this worker has none"
        )


class AuthStore(WrappedStore):
    """A store whose values carry a MAC: ``MARK``, the 16-byte tag over the entry's name (as this
    store sees it, prefixes included) and value, then the value. Reads check it and raise
    :class:`AuthenticationError` naming the entry; writes add it. Empty values and ``add`` counters
    pass unchanged (see the module docstring). Thread safety: as the wrapped store."""

    def __init__(self, inner: Any, mac: _StoreMac, keep: list[AuthStore]) -> None:
        super().__init__(inner)
        self._mac = mac
        self._keep = keep

    def _encode(self, key: str, value: str | bytes) -> bytes:
        # deterministic, so compare_set knows the stored form of ``expected``
        raw = super()._encode(key, value)
        if not raw:
            return raw
        return MARK + self._mac.tag(key, raw) + raw

    def _decode(self, key: str, stored: bytes) -> bytes:
        if not stored:
            return stored
        if not stored.startswith(MARK):
            raise AuthenticationError(
                f"authentication mismatch: the rendezvous entry {key!r} carries no MAC (it was written by "
                "a worker or process without an authentication key); it was not used"
            )
        start = len(MARK)
        tag, value = stored[start : start + TAG_BYTES], stored[start + TAG_BYTES :]
        if not hmac.compare_digest(tag, self._mac.tag(key, value)):
            raise AuthenticationError(
                f"authentication failed: the rendezvous entry {key!r} was {self._mac.stale}; it was not used"
            )
        return value

    def clone(self) -> AuthStore:
        clone = AuthStore(self._inner.clone(), self._mac, self._keep)
        self._keep.append(clone)
        return clone
