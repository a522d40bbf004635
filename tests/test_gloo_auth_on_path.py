"""An attacker without the job key between the workers (impl/_auth.py): it replays store entries it
recorded in an earlier run of the same job, and relays a link, changing bytes of a tensor in flight.

The worlds run in this process (gloo pairs in threads), with the attacker's store and relay in the
middle; each attack must end in an :class:`AuthenticationError`: nothing connects to the attacker,
nothing altered is delivered, and the other links go on.
"""

from __future__ import annotations

import gc
import socket
import struct
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo_pair import WAIT, Inbox
from twinrpc.impl import _rendezvous
from twinrpc.impl._auth import MARK, AuthenticationError, JobAuth
from twinrpc.impl._link import PeerLink, make_pair_group
from twinrpc.impl._rendezvous import Joined, join
from twinrpc.impl._world import GlooWorld

from twinrpc._message import Kind, Message
from twinrpc._worker_info import WorkerInfo

KEY = b"the job's key"
WORKERS = [WorkerInfo("worker0", 0), WorkerInfo("worker1", 1)]


class _Store(dist.Store):  # type: ignore[misc,name-defined]
    """A store in the attacker's hands: ``serve(name, value)`` decides what a read of ``name`` returns
    (the attacker wrote it back after the worker's own write); everything else passes through."""

    def __init__(self, inner: Any, serve: Callable[[str, bytes], bytes]) -> None:
        super().__init__()
        self._inner = inner
        self._serve = serve

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self._serve(key, self._inner.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._inner.compare_set(key, expected, desired)  # type: ignore[no-any-return]

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    deleteKey = delete_key

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    getNumKeys = num_keys

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout  # type: ignore[no-any-return]


def _gloo_port_at(value: bytes) -> int:
    """Where in a gloo address entry (its MACs, if any, stripped) the listening port sits: after the
    host name (u64 length, bytes), the address' u64 length and the sockaddr's family."""
    (host_len,) = struct.unpack_from("<Q", value, 0)
    return 8 + host_len + 8 + 2


def _plain(value: bytes) -> bytes:
    while value.startswith(MARK):
        value = value[len(MARK) + 16 :]
    return value


def _port_of(entry: bytes) -> int:
    value = _plain(entry)
    return int(struct.unpack_from(">H", value, _gloo_port_at(value))[0])


def _in_threads(
    make: Callable[[int], Any], ranks: list[int]
) -> tuple[dict[int, Any], dict[int, BaseException]]:
    out: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = make(rank)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a worker is stuck connecting (to the attacker?)"
    return out, errors


def _worlds(stores: list[Any]) -> tuple[dict[int, Any], dict[int, BaseException]]:
    """Two keyed gloo worlds (as init_rpc makes them after the names are known), rank r over
    ``stores[r]``."""
    auth = JobAuth(KEY)

    def make(rank: int) -> GlooWorld:
        store = dist.PrefixStore("twinrpc/0", auth.wrap(stores[rank]))  # type: ignore[attr-defined]
        return GlooWorld(Joined(store, rank, 2, WORKERS, timedelta(seconds=WAIT), auth=auth), 2)

    return _in_threads(make, [0, 1])


class _Listener:
    """The attacker listening where the recorded entry points; counts who connects."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("", port))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.connected = 0
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connected += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(WAIT)
        self.sock.close()


def test_a_pair_entry_recorded_in_an_earlier_run_is_refused_and_nothing_connects_to_the_attacker() -> None:
    # An earlier run of the same job (same key), whose store the attacker could read.
    earlier = dist.HashStore()
    worlds, errors = _worlds([earlier, earlier])
    assert not errors, errors
    pair = "twinrpc/0/pair/0-1"
    recorded = {k: earlier.get(k) for k in (f"{pair}/nonce/0", f"{pair}/0/0")}  # rank 0's nonce, address
    for world in worlds.values():
        world.stop()
    del worlds
    gc.collect()  # the earlier run's gloo listeners close: the attacker listens at rank 0's old port
    attacker = _Listener(_port_of(recorded[f"{pair}/0/0"]))
    try:
        # This run: worker1 reads rank 0's entries as the attacker wrote them back.
        now = dist.HashStore()
        replaying = _Store(now, lambda name, value: recorded.get(name, value))
        worlds, errors = _worlds([now, replaying])
        for world in worlds.values():
            world.stop()
    finally:
        attacker.close()
    print({r: str(e) for r, e in errors.items()})
    assert attacker.connected == 0
    assert sorted(errors) == [0, 1], "both ends of the pair must refuse"
    assert all(isinstance(e, AuthenticationError) for e in errors.values()), errors
    assert "earlier run" in str(errors[1]) and "'pair/0-1/0/0'" in str(errors[1]), errors[1]
    assert "connecting to 'worker0' (rank 0)" in str(errors[1]), errors[1]


def test_names_recorded_in_an_earlier_run_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier run of the job had other workers at these ranks: written back, rank 0's entry would
    make worker1 take rank 0 for 'impostor'."""
    auth = JobAuth(KEY)
    stores: dict[int, Any] = {}
    monkeypatch.setattr(_rendezvous, "_open_store", lambda init, rank, *a: (stores[rank], False))

    def joined(names: list[str]) -> Callable[[int], Any]:
        return lambda rank: join(names[rank], rank, 2, "env://", WAIT, 0, auth)

    earlier = dist.HashStore()
    stores.update({0: earlier, 1: earlier})
    got, errors = _in_threads(joined(["impostor", "other"]), [0, 1])
    assert not errors, errors
    recorded = {"twinrpc/0/name/0": earlier.get("twinrpc/0/name/0")}
    now = dist.HashStore()
    stores.update({0: now, 1: _Store(now, lambda name, value: recorded.get(name, value))})
    got, errors = _in_threads(joined(["worker0", "worker1"]), [0, 1])
    print({r: str(e) for r, e in errors.items()})
    assert [w.name for w in got[0].workers] == ["worker0", "worker1"]  # rank 0 read honest entries
    assert 1 not in got and isinstance(errors[1], AuthenticationError), (got, errors)
    assert "earlier run" in str(errors[1]) and "'name/0'" in str(errors[1])


# ---------------------------------------------------------------------------------------------------
# A relay on the link
# ---------------------------------------------------------------------------------------------------
#: the bytes of a float32 7.0, as the tensor below sends them
_SEVEN = struct.pack("<f", 7.0)


class _Relay:
    """Forwards one TCP connection to ``port`` both ways, changing one byte the first time a run of
    float32 7.0s passes (the storage of the tensor sent)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.changed = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            inbound, _ = self.sock.accept()
        except OSError:
            return
        outbound = socket.create_connection(("127.0.0.1", self.port))
        for a, b in ((inbound, outbound), (outbound, inbound)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                at = data.find(_SEVEN * 64)
                if at >= 0:
                    with self._lock:
                        if not self.changed:
                            self.changed += 1
                            data = data[: at + 130] + bytes([data[at + 130] ^ 0x10]) + data[at + 131 :]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _relayed(store: Any, peer_in_pair: int, relays: list[_Relay]) -> Any:
    """``store`` as gloo sees it when the network routes a pair's connection through the attacker:
    the peer's address (rank ``peer_in_pair`` of the pair; authenticated), then a relay to it in its
    place."""

    def serve(name: str, value: bytes) -> bytes:
        if not name.endswith(f"/0/{peer_in_pair}") or not value:
            return value
        at = _gloo_port_at(value)
        relay = _Relay(struct.unpack_from(">H", value, at)[0])
        relays.append(relay)
        return value[:at] + struct.pack(">H", relay.sock.getsockname()[1]) + value[at + 2 :]

    return _Store(store, serve)


def _links(
    store: Any, me: int, peer: int, inbox: Inbox, relays: list[_Relay] | None
) -> tuple[PeerLink, PeerLink]:
    """``me``'s keyed link to ``peer`` and back (``peer`` delivers to ``inbox``), started; with
    ``relays``, the pair's connection runs through the attacker's relay."""
    auth = JobAuth(KEY)

    def make(rank: int) -> PeerLink:
        other = peer if rank == me else me
        link = auth.link(store, rank, other)
        pair_store = link.store if relays is None else _relayed(link.store, int(other > rank), relays)
        pg = make_pair_group(pair_store, rank, other)
        deliver = inbox if rank == peer else (lambda m: None)
        out = PeerLink(rank, other, pg, deliver, lambda p, exc: None, auth=link.frames)
        out.peer_name = f"'worker{other}' (rank {other})"
        return out

    made, errors = _in_threads(make, [me, peer])
    assert not errors, errors
    for link in made.values():
        link.start()
    return made[me], made[peer]


def _wait_failed(link: PeerLink) -> BaseException:
    import time

    deadline = time.monotonic() + WAIT
    while link.failed is None:
        assert time.monotonic() < deadline, "the link did not fail"
        time.sleep(0.005)
    return link.failed


def test_a_storage_changed_in_flight_fails_the_link_naming_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """worker0 -> worker1 runs through the relay, worker2 -> worker1 does not (both keyed, over
    gloo alone: TWINRPC_SHM=0). One byte of the 16 KiB storage that worker0 sends is changed: the
    message is not delivered, worker1's link from worker0 fails naming authentication and worker0,
    and worker2's messages still arrive."""
    monkeypatch.setenv("TWINRPC_SHM", "0")
    store = JobAuth(KEY).wrap(dist.HashStore())
    inbox = Inbox()
    relays: list[_Relay] = []
    sender, victim = _links(dist.PrefixStore("a", store), 0, 1, inbox, relays)  # type: ignore[attr-defined]
    friend, victim2 = _links(dist.PrefixStore("b", store), 2, 1, inbox, None)  # type: ignore[attr-defined]
    try:
        seven = torch.full((4096,), 7.0)
        storage = seven.view(torch.uint8)
        sender.send(Message(Kind.CALL, 1, 0, 1, b"before"))
        inbox.wait_for(1)
        sender.send(Message(Kind.CALL, 2, 0, 1, b"seven", [storage]))
        error = _wait_failed(victim)
        friend.send(Message(Kind.CALL, 3, 2, 1, b"after, from worker2"))
        got = inbox.wait_for(2)
        print(error)
        assert sum(r.changed for r in relays) == 1, "the relay did not see the storage"
        assert [m.payload for m in got] == [b"before", b"after, from worker2"]
        assert isinstance(error, AuthenticationError)
        assert "authentication failed" in str(error) and "'worker0' (rank 0)" in str(error)
        assert victim2.failed is None and friend.failed is None
    finally:
        for link in (sender, victim, friend, victim2):
            link.closing = True
        for link in (sender, victim, friend, victim2):
            link.abandon()
            link.join(WAIT)
            link.join_threads(WAIT)
