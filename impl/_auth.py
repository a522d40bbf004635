"""Authenticated frames and rendezvous entries: the job key (``auth_key`` / ``TWINRPC_AUTH_KEY``).

With a key, nothing a process without it sends is unpickled, and nothing it writes to the store is
believed:

* **Rendezvous entries.** The store is wrapped (:class:`AuthStore`): every value twinrpc and gloo write
  through it carries a MAC over the entry's full key and value, and every value read is checked before
  use, so a process without the key can neither list itself as a worker nor point a worker's gloo pair
  at another address. An empty value carries none (it is how an entry is cleared, which a process with
  store access can do anyway by deleting it); ``add`` counters cannot carry one either.
* **Frames.** Each link derives its own key from the job key and two random nonces the pair exchanges
  through the (authenticated) store, so frames recorded in one run mean nothing in another. Every header
  frame carries a tag over its meaningful bytes (the fixed fields, the messages and the riders), the
  direction (sender and receiver ranks) and its sequence number on the link, which are hashed in the
  tag's own place (one contiguous run of bytes to hash); the sequence number is not sent: both sides count header frames, so a frame replayed, reordered or dropped fails the check. A
  payload that travels as a frame of its own has its tag in the header. The receiver checks a header's
  tag before decoding it and a payload's tag before handing it on, so a frame that fails is dropped
  without unpickling a byte, and the link to its sender fails with :class:`AuthenticationError`.
* **Not covered:** tensor storages sent as frames of their own (their sizes, in the header, are); and
  secrecy (frames are authenticated, not encrypted).

The MAC is keyed BLAKE2b with 16-byte tags (measured against HMAC-SHA256 on a header's used bytes:
1.3 us against 2.7 us a frame; see benchmarks/bench_auth.py for what the key costs a call).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from twinrpc._errors import AuthenticationError
from twinrpc._key_source import auth_key_of as job_key

from ._framing import (
    _FLAGS,
    _FLAGS_AT,
    _TRAILER,
    FLAG_INLINE,
    FLAG_RIDERS,
    HEADER_BYTES,
    MAX_RIDER_BYTES,
    PAYLOAD_TAG_AT,
    SIZES_AT,
    TAG_AT,
    TAG_BYTES,
    USED_AT,
)

#: how an authenticated store value starts: lets a worker without a key recognise one
MARK = b"twinrpc-mac1:"

_USED = struct.Struct("<H")
#: sender rank, receiver rank, sequence number: hashed in the tag's place (both are TAG_BYTES long)
_CONTEXT = struct.Struct("<iiQ")
_FLAGS_USED = struct.Struct("<H2xH")  # from the flags' offset: flags, kind (skipped), used
_NAME_LEN = struct.Struct("<I")

__all__ = ["AuthStore", "AuthenticationError", "FrameAuth", "JobAuth", "job_key", "refuse_marked"]


class FrameAuth:
    """One link's frame MACs (see the module docstring). The sender and the receiver each call their
    own methods under their own locks; nothing here changes after construction."""

    __slots__ = ("_base", "_me", "_peer")

    def __init__(self, link_key: bytes, me: int, peer: int) -> None:
        self._base = hashlib.blake2b(key=link_key, digest_size=TAG_BYTES)
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

    def _payload_tag(self, payload: bytes) -> bytes:
        h = self._base.copy()
        h.update(b"payload")
        h.update(payload)
        return h.digest()

    def seal(self, view: memoryview, seq: int, used: int, payload: bytes) -> None:
        """Tag the header frame in ``view`` (its leading part ends at ``used``), our ``seq``-th on this
        link; ``payload``: its first message's, tagged too unless the header carries it inline
        (``FLAG_INLINE``), since then it travels apart from the header."""
        _USED.pack_into(view, USED_AT, used)
        (flags,) = _FLAGS.unpack_from(view, _FLAGS_AT)
        if not flags & FLAG_INLINE:
            view[PAYLOAD_TAG_AT:SIZES_AT] = self._payload_tag(payload)
        tag = self._header_tag(view, self._me, self._peer, seq, flags, used)
        assert tag is not None  # our own encoder keeps the riders after the leading part
        view[TAG_AT:PAYLOAD_TAG_AT] = tag

    def check_header(self, view: memoryview, seq: int, peer_name: str) -> bytes:
        """Check the peer's ``seq``-th header frame, before anything in it is decoded; returns the tag
        its separate payload frame (if any) must match.

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
        return bytes(view[PAYLOAD_TAG_AT:SIZES_AT])

    def check_payload(self, payload: bytes, tag: bytes, msg_id: int, peer_name: str) -> None:
        """Check a payload frame against the tag its (checked) header carried, before it is unpickled.

        Raises:
            AuthenticationError: naming the peer.
        """
        if not hmac.compare_digest(self._payload_tag(payload), tag):
            raise AuthenticationError(
                f"authentication failed: the payload frame of message {msg_id} from {peer_name} does not "
                f"match the MAC in its header; it was dropped unread and the link to {peer_name} is closed"
            )


class JobAuth:
    """The job key of this process: wraps rendezvous stores and derives each link's key."""

    def __init__(self, key: bytes) -> None:
        # BLAKE2b takes keys of up to 64 bytes: a job key of any length is hashed to one first.
        self._master = hashlib.blake2b(key, digest_size=32, person=b"twinrpc-job").digest()
        self._store_mac = hashlib.blake2b(key=self._master, digest_size=TAG_BYTES, person=b"twinrpc-store")
        #: every AuthStore made: C++ holds them by a pointer that does not keep the Python half alive
        self._stores: list[AuthStore] = []

    def wrap(self, store: Any) -> AuthStore:
        """``store`` with every value authenticated (see AuthStore)."""
        wrapped = AuthStore(store, self)
        self._stores.append(wrapped)
        return wrapped

    def tag(self, name: str, value: bytes) -> bytes:
        h = self._store_mac.copy()
        raw = name.encode()
        h.update(_NAME_LEN.pack(len(raw)))
        h.update(raw)
        h.update(value)
        return h.digest()

    def link(self, store: Any, me: int, peer: int) -> FrameAuth:
        """The frame MACs of the link between ``me`` and ``peer``: each side posts a random nonce to
        ``store`` (authenticated) and reads the other's (waiting for it at most the store's timeout).

        Raises:
            AuthenticationError: the peer's nonce is not authenticated with this job's key.
        """
        low, high = min(me, peer), max(me, peer)
        mine = os.urandom(16).hex()
        store.set(f"pair/{low}-{high}/nonce/{me}", mine)
        theirs = store.get(f"pair/{low}-{high}/nonce/{peer}").decode()
        nonces = (mine, theirs) if me == low else (theirs, mine)
        link_key = hashlib.blake2b(
            f"{low} {high} {nonces[0]} {nonces[1]}".encode(),
            key=self._master,
            digest_size=32,
            person=b"twinrpc-link",
        ).digest()
        return FrameAuth(link_key, me, peer)


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


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


class AuthStore(dist.Store):  # type: ignore[misc,name-defined]  # torch's stubs lack Store
    """A store whose values carry the job key's MAC: ``MARK``, the 16-byte tag over the entry's name
    (as this store sees it, prefixes included) and value, then the value. Reads check it and raise
    :class:`AuthenticationError` naming the entry; writes add it. Empty values and ``add`` counters
    pass unchanged (see the module docstring). Thread safety: as the wrapped store."""

    def __init__(self, inner: Any, auth: JobAuth) -> None:
        super().__init__()
        self._inner = inner
        self._auth = auth

    def _wrap(self, key: str, value: str | bytes) -> bytes:
        raw = _as_bytes(value)
        if not raw:
            return raw
        return MARK + self._auth.tag(key, raw) + raw

    def _unwrap(self, key: str, stored: bytes) -> bytes:
        if not stored:
            return stored
        if not stored.startswith(MARK):
            raise AuthenticationError(
                f"authentication mismatch: the rendezvous entry {key!r} carries no MAC (it was written by "
                "a worker or process without an authentication key); it was not used"
            )
        start = len(MARK)
        tag, value = stored[start : start + TAG_BYTES], stored[start + TAG_BYTES :]
        if not hmac.compare_digest(tag, self._auth.tag(key, value)):
            raise AuthenticationError(
                f"authentication failed: the rendezvous entry {key!r} was not written with this worker's "
                "key (workers started with different keys, or a process without the key wrote it); it "
                "was not used"
            )
        return value

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, self._wrap(key, value))

    def get(self, key: str) -> bytes:
        return self._unwrap(key, self._inner.get(key))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        # the MAC is deterministic, so the stored form of ``expected`` is known
        found = self._inner.compare_set(key, self._wrap(key, expected), self._wrap(key, desired))
        return self._unwrap(key, found)

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    deleteKey = delete_key  # the name torch's C++ side looks up

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    getNumKeys = num_keys  # the name torch's C++ side looks up

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout  # type: ignore[no-any-return]

    def clone(self) -> AuthStore:
        return self._auth.wrap(self._inner.clone())
