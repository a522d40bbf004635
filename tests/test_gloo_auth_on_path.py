"""An attacker without the job key between the workers (impl/_auth.py): it replays store entries it
recorded in an earlier run of the same job, and changes a byte of a tensor on the wire.

The worlds run in this process (gloo pairs in threads), with the attacker's store (and listener) or
its hand on the wire in the middle; each attack must end in an :class:`AuthenticationError`: nothing
connects to the attacker, nothing altered is delivered, and the other links go on.
"""

from __future__ import annotations

import gc
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo_pair import WAIT, Inbox, end_links, wait_failed
from twinrpc.impl import _rendezvous
from twinrpc.impl._auth import MARK, AuthenticationError, JobAuth
from twinrpc.impl._link import PeerLink, make_pair_group
from twinrpc.impl._pair import TAG
from twinrpc.impl._rendezvous import Joined, join
from twinrpc.impl._stores import WrappedStore, scrub_gloo_address
from twinrpc.impl._world import GlooWorld

from twinrpc._message import Kind, Message
from twinrpc._worker_info import WorkerInfo

KEY = b"the job's key"
WORKERS = [WorkerInfo("worker0", 0), WorkerInfo("worker1", 1)]


class _Store(WrappedStore):
    """A store in the attacker's hands: ``serve(name, value)`` decides what a read of ``name`` returns
    (the attacker wrote it back after the worker's own write); everything else passes through."""

    def __init__(self, inner: Any, serve: Callable[[str, bytes], bytes]) -> None:
        super().__init__(inner)
        self._serve = serve

    def _decode(self, key: str, stored: bytes) -> bytes:
        return self._serve(key, stored)


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
    ``stores[r]``, each with its link to the other made (as at the first message between them); a
    rank whose link could not be made is in the errors (and its world stopped)."""
    auth = JobAuth(KEY)

    def make(rank: int) -> GlooWorld:
        store = dist.PrefixStore("twinrpc/0", auth.wrap(stores[rank]))  # type: ignore[attr-defined]
        joined = Joined(store, rank, 2, WORKERS, timedelta(seconds=WAIT), auth=auth)
        world = GlooWorld(joined, 2, heartbeat_interval=5.0, heartbeat_misses=3, rpc_timeout=WAIT)
        try:
            world.link_to(1 - rank, WAIT)
        except BaseException:
            world.stop()
            raise
        return world

    return _in_threads(make, [0, 1])


class _Listener:
    """The attacker listening where the recorded entry points; counts who connects."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + WAIT
        while True:  # the earlier run's gloo listener there may take a moment to close
            try:
                self.sock.bind(("", port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                gc.collect()
                time.sleep(0.1)
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


def _earlier_run(path: str) -> None:
    """In a process of its own (so that its gloo listeners are gone when it exits): an earlier run of
    the job, over a FileStore at ``path`` that the attacker reads afterwards."""
    store = dist.FileStore(path, -1)  # type: ignore[attr-defined]
    worlds, errors = _worlds([store, store])
    assert not errors, errors
    for world in worlds.values():
        world.stop()
    os._exit(0)


def test_a_pair_entry_recorded_in_an_earlier_run_is_refused_and_nothing_connects_to_the_attacker(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "earlier")
    earlier = dist.FileStore(path, -1)  # type: ignore[attr-defined]  # keeps the file after the run
    code = f"import sys; sys.path[:0] = {sys.path!r}; import {__name__} as t; t._earlier_run({path!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    pair = "twinrpc/0/pair/0-1"
    recorded = {k: earlier.get(k) for k in (f"{pair}/nonce/0", f"{pair}/0/0")}  # rank 0's nonce, address
    # The attacker listens where rank 0 listened in the earlier run (that process has exited).
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
# Data changed in flight
# ---------------------------------------------------------------------------------------------------
class _OnTheWire:
    """The sender's gloo group as seen through an attacker on the wire: every frame goes out as
    sent, except that one byte of the first data frame of ``size`` bytes is changed (in a copy:
    the sender's tensor stays as it was)."""

    def __init__(self, pg: Any, size: int) -> None:
        self._pg = pg
        self._size = size
        self.changed = 0

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        if tag != TAG and tensors[0].numel() == self._size and not self.changed:
            self.changed += 1
            tensors = [tensors[0].clone()]
            tensors[0][self._size // 2] ^= 0x10
        return self._pg.send(tensors, dst, tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)


def _links(store: Any, me: int, peer: int, inbox: Inbox) -> tuple[PeerLink, PeerLink]:
    """``me``'s keyed link to ``peer`` and back (``peer`` delivers to ``inbox``), started."""
    auth = JobAuth(KEY)

    def make(rank: int) -> PeerLink:
        other = peer if rank == me else me
        link = auth.link(store, rank, other)
        pg = make_pair_group(link.store, rank, other)
        deliver = inbox if rank == peer else (lambda m: None)
        out = PeerLink(rank, other, pg, deliver, lambda p, exc: None, auth=link.frames)
        out.peer_name = f"'worker{other}' (rank {other})"
        return out

    made, errors = _in_threads(make, [me, peer])
    assert not errors, errors
    for link in made.values():
        link.start()
    return made[me], made[peer]


def test_a_storage_changed_in_flight_fails_the_link_naming_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """worker0 -> worker1 crosses the attacker, worker2 -> worker1 does not (both keyed, over gloo
    alone: TWINRPC_SHM=0). One byte of the 16 KiB storage of 7.0s that worker0 sends is changed on
    the way: the message is not delivered, worker1's link from worker0 fails naming authentication
    and worker0, and worker2's messages still arrive."""
    monkeypatch.setenv("TWINRPC_SHM", "0")
    store = JobAuth(KEY).wrap(dist.HashStore())
    inbox = Inbox()
    sender, victim = _links(dist.PrefixStore("a", store), 0, 1, inbox)  # type: ignore[attr-defined]
    friend, victim2 = _links(dist.PrefixStore("b", store), 2, 1, inbox)  # type: ignore[attr-defined]
    storage = torch.full((4096,), 7.0).view(torch.uint8)
    wire = _OnTheWire(sender.sender._pg, storage.numel())
    sender.sender._pg = wire
    try:
        sender.send(Message(Kind.CALL, 1, 0, 1, b"before"))
        inbox.wait_for(1)
        sender.send(Message(Kind.CALL, 2, 0, 1, b"sevens", [storage]))
        error = wait_failed(victim)
        friend.send(Message(Kind.CALL, 3, 2, 1, b"after, from worker2"))
        got = inbox.wait_for(2)
        print(error)
        assert wire.changed == 1 and bool((storage.view(torch.float32) == 7.0).all())
        assert [m.payload for m in got] == [b"before", b"after, from worker2"]
        assert isinstance(error, AuthenticationError)
        assert "authentication failed" in str(error) and "'worker0' (rank 0)" in str(error)
        assert victim2.failed is None and friend.failed is None
    finally:
        end_links(sender, victim, friend, victim2)


# ---------------------------------------------------------------------------------------------------
# What the store learns
# ---------------------------------------------------------------------------------------------------
def test_gloo_address_entries_carry_no_uninitialised_memory_of_the_worker() -> None:
    """gloo fills 16 of a sockaddr_storage's 128 bytes for an IPv4 address and copies the rest from
    memory it never initialised (pointers into the worker, seen in tests); the pair's entries reach
    the store with that tail zeroed, and the pair still connects."""
    raw = dist.HashStore()
    groups, errors = _in_threads(lambda rank: make_pair_group(raw, rank, 1 - rank), [0, 1])
    assert not errors, errors
    for rank in (0, 1):
        entry = raw.get(f"pair/0-1/0/{rank}")
        at = _gloo_port_at(entry) - 2  # the sockaddr_storage
        assert struct.unpack_from("<H", entry, at)[0] == socket.AF_INET
        assert entry[at + 16 : at + 128] == bytes(112), entry[at + 16 : at + 128]
    sent, got = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    work = groups[1].pg.recv([got], 0, 9)
    groups[0].pg.send([sent], 1, 9).wait()
    work.wait()
    assert torch.equal(got, sent)
    # what scrubbing leaves alone: any other shape of value
    for value in (b"", b"worker0", struct.pack("<Q", 1 << 40) + b"x" * 20, b"\x02" + b"\xff" * 200):
        assert scrub_gloo_address(value) == value
