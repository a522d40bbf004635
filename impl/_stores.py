"""Stores that wrap another one for gloo and twinrpc: the forwarding base, and gloo's address entries
with the bytes it never initialised zeroed.

gloo posts each pair's listening address as a ``sockaddr_storage`` (128 bytes) of which an IPv4
address fills 16 and an IPv6 one 28; it copies the rest from uninitialised memory of the worker (seen
in tests: pointers into its address space, which tell a reader of the store where the worker's
libraries and stacks are). :class:`ScrubbedAddresses` zeroes that tail on the way to the store.
"""

from __future__ import annotations

import logging
import socket
import struct
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from twinrpc._errors import AuthenticationError

_log = logging.getLogger("twinrpc.impl")
#: how long an inbox's reader waits for its next entry before asking again (quietly)
_INBOX_WAIT = timedelta(days=1)

_U64 = struct.Struct("<Q")
_FAMILY = struct.Struct("<H")
_SOCKADDR_STORAGE = 128
#: gloo's TCP address: a sockaddr_storage, then the pair's sequence number (i64)
_GLOO_ADDRESS = _SOCKADDR_STORAGE + 8
#: the bytes of a sockaddr_storage each family uses (sizeof sockaddr_in, sockaddr_in6)
_FAMILY_BYTES = {int(socket.AF_INET): 16, int(socket.AF_INET6): 28}


class WrappedStore(dist.Store):  # type: ignore[misc,name-defined]  # torch's stubs lack Store
    """Forwards every operation to ``inner``; values pass through ``_encode`` on the way in and
    ``_decode`` on the way out (both unchanged here). Thread safety: as the wrapped store."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner

    def _encode(self, key: str, value: str | bytes) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def _decode(self, key: str, stored: bytes) -> bytes:
        return stored

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, self._encode(key, value))

    def get(self, key: str) -> bytes:
        return self._decode(key, self._inner.get(key))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        found = self._inner.compare_set(key, self._encode(key, expected), self._encode(key, desired))
        return self._decode(key, found)

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


def scrub_gloo_address(value: bytes) -> bytes:
    """gloo's entry for a rank of a pair (host name: u64 length and bytes; address: u64 length and
    bytes; then the pair identifiers) with the unused tail of its sockaddr_storage zeroed. A value
    of any other shape is returned unchanged."""
    if len(value) < _U64.size:
        return value
    (host_len,) = _U64.unpack_from(value, 0)
    at = _U64.size + host_len + _U64.size  # the address, after its length
    if at + _GLOO_ADDRESS > len(value) or _U64.unpack_from(value, at - _U64.size)[0] != _GLOO_ADDRESS:
        return value
    used = _FAMILY_BYTES.get(_FAMILY.unpack_from(value, at)[0])
    if used is None:
        return value
    return value[: at + used] + bytes(_SOCKADDR_STORAGE - used) + value[at + _SOCKADDR_STORAGE :]


class ScrubbedAddresses(WrappedStore):
    """The store gloo makes a pair's group over: what it writes has its address scrubbed
    (:func:`scrub_gloo_address`)."""

    def _encode(self, key: str, value: str | bytes) -> bytes:
        return scrub_gloo_address(super()._encode(key, value))


def next_entry(store: Any, inbox: str, n: int) -> tuple[str, int]:
    """Block until entry ``<inbox>/<n>`` of an inbox in ``store`` (entries numbered from 1, each
    written once) is there; returns it and the number of the entry after it. An entry that fails the
    job key's check (not written by a worker of this run) is logged and skipped.

    Raises:
        RuntimeError: the store is gone (its host process left).
    """
    while True:
        key = f"{inbox}/{n}"
        while True:
            try:
                store.wait([key], _INBOX_WAIT)
                break
            except RuntimeError as exc:
                if "timeout" not in str(exc).lower():
                    raise
        n += 1
        try:
            return store.get(key).decode(), n
        except AuthenticationError as exc:
            _log.error("twinrpc: %s; skipped", exc)
