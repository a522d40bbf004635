"""An attacker without the job key between the workers (impl/_auth.py): it replays store entries it
recorded in an earlier run of the same job (a pair's, a static group's names, a dynamic group's
member list), and relays a link's TCP connection, changing a byte of a tensor on the way.

The pair and static-group worlds run in this process (gloo pairs in threads), with the attacker's
store (and listener) or its relay in the middle; the dynamic groups run in processes of their own
over a file store the attacker writes to. Each attack must end in a refusal naming authentication or
the stale entry: nothing connects to the attacker, nothing altered is delivered, no worker lists a
member it should not, and the other links go on.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import os
import selectors
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
from twinrpc.impl import _pair, _rendezvous
from twinrpc.impl._auth import MARK, AuthenticationError, JobAuth
from twinrpc.impl._dynamic_group import StoreGroup
from twinrpc.impl._link import PeerLink, make_pair_group
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

    def make(rank: int) -> GlooWorld:
        auth = JobAuth(KEY)  # each its own, as each process has: a stopped world releases its stores
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
# A dynamic group's member list written back
# ---------------------------------------------------------------------------------------------------
#: a dynamic joiner waits this long for its members' answers (heartbeat_interval * heartbeat_misses)
ANSWER_WAIT = 5.0
#: bounds each world of processes, and each wait of theirs for the attacker
DYNAMIC_WORLD = 90.0


def _dynamic_options(init_file: str) -> Any:
    import twinrpc.rpc as rpc

    return rpc.RpcBackendOptions(
        init_method=f"file://{init_file}", rpc_timeout=20, heartbeat_interval=1.0, heartbeat_misses=5
    )


def _dynamic_program(index: int, init_file: str, shared: dict[str, Any]) -> Any:
    """A worker of a dynamic group that joins when told: rank ``shared["ranks"][index]`` waits for
    ``go<rank>``, joins as ``worker<rank>`` and sets ``in<rank>`` (failing, it returns what init_rpc
    raised and how long it took). A member waits for ``done``, calls each member it knows, sets
    ``called<rank>``, waits for ``left`` and returns the members and the calls' answers."""
    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent

    rank = shared["ranks"][index]
    shared[f"go{rank}"].wait(DYNAMIC_WORLD)
    start = time.monotonic()
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, rpc_backend_options=_dynamic_options(init_file))
    except Exception as exc:
        shared[f"in{rank}"].set()
        return {"raised": type(exc).__name__, "error": str(exc), "after": time.monotonic() - start}
    shared[f"in{rank}"].set()
    shared["done"].wait(DYNAMIC_WORLD)
    members = [w.name for w in current_agent().workers]
    calls = {w: rpc.rpc_sync(w, operator.add, args=(rank, 1)) for w in members if w != f"worker{rank}"}
    shared[f"called{rank}"].set()
    shared["left"].wait(DYNAMIC_WORLD)  # every member made its calls
    rpc.shutdown(graceful=False)
    return {"members": members, "calls": calls}


def _recorder(path: str) -> Any:
    """The attacker's hand on a run's store: no key, the file only (its handle keeps the file)."""
    return dist.FileStore(path, -1)  # type: ignore[attr-defined]


def _run_dynamic(
    path: str, ranks: list[int], attack: Callable[[dict[str, Any]], list[int]]
) -> dict[int, Any]:
    """Keyed processes of :func:`_dynamic_program` at ``ranks`` over the store at ``path``, while the
    attacker's ``attack(shared)`` runs; it lets each rank join (:func:`_joins`) and returns the ranks
    that are members at the end. Every rank's result, by rank."""
    from _spawn_world import preloaded_context, run_keyed_world

    mp = preloaded_context()
    events = [f"{e}{r}" for r in ranks for e in ("go", "in", "called")] + ["done", "left"]
    shared: dict[str, Any] = {e: mp.Event() for e in events}

    def started(procs: list[Any]) -> None:
        members = attack(shared)
        shared["done"].set()
        for r in members:
            assert shared[f"called{r}"].wait(DYNAMIC_WORLD), f"member {r} never made its calls"
        shared["left"].set()

    got = run_keyed_world(
        _dynamic_program,
        ["the job's key"] * len(ranks),
        path,
        DYNAMIC_WORLD,
        started=started,
        ranks=ranks,
        **shared,
    )
    return {ranks[i]: value for i, value in got.items()}


def _joins(shared: dict[str, Any], rank: int) -> None:
    """Let ``rank`` join; return once its init_rpc returned or raised."""
    shared[f"go{rank}"].set()
    assert shared[f"in{rank}"].wait(DYNAMIC_WORLD), f"rank {rank} never finished init_rpc"


def test_a_member_list_recorded_in_an_earlier_run_is_refused_within_the_answer_wait(tmp_path: Path) -> None:
    """An earlier run of the job had worker0 and worker1 in its group; the attacker writes its list
    back over this run's (worker0 alone). worker2 posts its join to the members listed, whose inboxes
    nobody reads now: no live member confirms the list, so worker2 refuses it after the answer wait,
    saying why; worker0 never hears of it."""
    earlier_path = str(tmp_path / "earlier")
    earlier = _recorder(earlier_path)
    recorded: dict[str, bytes] = {}

    def record(shared: dict[str, Any]) -> list[int]:
        _joins(shared, 0)
        _joins(shared, 1)
        recorded["twinrpc/0/members"] = earlier.get("twinrpc/0/members")
        return [0, 1]

    _run_dynamic(earlier_path, [0, 1], record)
    assert len(_plain(recorded["twinrpc/0/members"]).splitlines()) == 2

    now_path = str(tmp_path / "now")
    now = _recorder(now_path)

    def replay(shared: dict[str, Any]) -> list[int]:
        _joins(shared, 0)
        for key, value in recorded.items():
            now.set(key, value)
        _joins(shared, 2)
        return [0]

    got = _run_dynamic(now_path, [0, 2], replay)
    print(got)
    refused = got[2]
    assert refused["raised"] == "WorkerUnavailableError", refused
    assert "earlier run and written back" in refused["error"] and "worker0" in refused["error"]
    assert ANSWER_WAIT <= refused["after"] < ANSWER_WAIT + 15, refused
    assert got[0] == {"members": ["worker0"], "calls": {}}  # worker0 never heard of worker2


def test_a_member_list_rolled_back_in_this_run_is_refused_by_the_live_members_answers(
    tmp_path: Path,
) -> None:
    """The attacker records the list while worker0 is alone, and writes it back once worker1 has
    joined: worker2 would not know worker1. worker0 answers worker2's join with the group as it
    knows it (worker0 and worker1): worker2 refuses at once, naming authentication and the list;
    worker0 and worker1 still list each other only, and call each other."""
    path = str(tmp_path / "rendezvous")
    store = _recorder(path)

    def roll_back(shared: dict[str, Any]) -> list[int]:
        _joins(shared, 0)
        alone = store.get("twinrpc/0/members")
        _joins(shared, 1)
        store.set("twinrpc/0/members", alone)
        _joins(shared, 2)
        return [0, 1]

    got = _run_dynamic(path, [0, 1, 2], roll_back)
    print(got)
    refused = got[2]
    assert refused["raised"] == "AuthenticationError", refused
    assert "authentication failed" in refused["error"] and "written back" in refused["error"]
    assert "'worker1' (rank 1" in refused["error"], refused  # what worker0 answered
    assert refused["after"] < ANSWER_WAIT, refused
    assert got[0] == {"members": ["worker0", "worker1"], "calls": {"worker1": 1}}
    assert got[1] == {"members": ["worker0", "worker1"], "calls": {"worker0": 2}}


def test_an_emptied_member_list_is_refused_with_a_key() -> None:
    """An empty value carries no MAC, and no keyed worker writes one (the last member to leave
    deletes the list): a keyed joiner refuses it rather than take the group for empty."""
    store = JobAuth(KEY).wrap(dist.HashStore())
    group = StoreGroup(store, WorkerInfo("worker1", 1), timedelta(seconds=WAIT), keyed=True)
    store.set("members", "")
    with pytest.raises(AuthenticationError, match="'members' is empty"):
        group.add_me()
    assert StoreGroup(store, WorkerInfo("worker1", 1), timedelta(seconds=WAIT)).add_me() == []  # no key


# ---------------------------------------------------------------------------------------------------
# The group's kind written back
# ---------------------------------------------------------------------------------------------------
#: how long a keyed worker that finds the other kind waits for a live worker of it to answer
KIND_WAIT = 1.0
MIXED = "RPC group mixes statically and dynamically initialized members which is not supported. "


def _static_join(stores: dict[int, Any], names: list[str]) -> Callable[[int], Any]:
    auth = JobAuth(KEY)
    return lambda rank: join(names[rank], rank, len(names), "env://", WAIT, 0, auth, KIND_WAIT)


def _dynamic_member(store: Any, rank: int) -> StoreGroup:
    """A keyed dynamic group's member, joined as ``init_rpc`` joins it (no other member)."""
    group = StoreGroup(store, WorkerInfo(f"worker{rank}", rank), timedelta(seconds=WAIT), keyed=True)
    group.lock()
    assert group.add_me() == []
    group.confirm(WAIT)
    group.unlock()
    return group


def _open_dynamic(monkeypatch: pytest.MonkeyPatch, store: Any) -> None:
    rendezvous = sys.modules["torch.distributed.rendezvous"]  # the name alone is torch's function
    monkeypatch.setattr(rendezvous, "_rendezvous_helper", lambda *a, **k: iter([(store, 0, 1)]))


def test_a_dynamic_kind_recorded_in_an_earlier_run_is_refused_by_a_static_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An earlier run was a dynamic group; written back into this run's store, its 'kind' (and member
    list) would stop the static group with PyTorch's mixed-group error. No member of it answers the
    static workers' challenge, so each refuses the entry as stale, naming it."""
    stores: dict[int, Any] = {}
    monkeypatch.setattr(_rendezvous, "_open_store", lambda init, rank, *a: (stores[rank], False))
    earlier = dist.HashStore()
    keyed = dist.PrefixStore("twinrpc/0", JobAuth(KEY).wrap(earlier))  # type: ignore[attr-defined]
    _rendezvous.mark_kind(keyed, "dynamic")
    _dynamic_member(keyed, 0).post_stop()
    recorded = {k: earlier.get(k) for k in ("twinrpc/0/kind", "twinrpc/0/members")}
    now = dist.HashStore()
    for key, value in recorded.items():
        now.set(key, value)
    stores.update({0: now, 1: now})
    start = time.monotonic()
    got, errors = _in_threads(_static_join(stores, ["worker0", "worker1"]), [0, 1])
    print({r: str(e) for r, e in errors.items()})
    assert not got and sorted(errors) == [0, 1], (got, errors)
    for error in errors.values():
        assert isinstance(error, AuthenticationError), error
        assert "entry 'kind' says a dynamic group uses this store" in str(error), error
        assert "no live worker of one answered" in str(error) and "earlier run" in str(error), error
    assert KIND_WAIT <= time.monotonic() - start < KIND_WAIT + 10


def test_a_static_kind_recorded_in_an_earlier_run_is_refused_by_a_dynamic_joiner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An earlier run was a static group of two; its 'kind' and nonces written back would refuse a
    dynamic joiner with PyTorch's mixed-group error. The joiner's challenge goes to the ranks of that
    run, whose inboxes no worker reads now: it refuses the entry as stale and lists itself nowhere."""
    stores: dict[int, Any] = {}
    monkeypatch.setattr(_rendezvous, "_open_store", lambda init, rank, *a: (stores[rank], False))
    earlier = dist.HashStore()
    stores.update({0: earlier, 1: earlier})
    _got, errors = _in_threads(_static_join(stores, ["worker0", "worker1"]), [0, 1])
    assert not errors, errors
    recorded = {k: earlier.get(k) for k in ("twinrpc/0/kind", "twinrpc/0/nonce/0", "twinrpc/0/nonce/1")}
    now = dist.HashStore()
    for key, value in recorded.items():
        now.set(key, value)
    _open_dynamic(monkeypatch, now)
    start = time.monotonic()
    with pytest.raises(AuthenticationError) as refused:
        _rendezvous.join_dynamic("worker2", 2, "tcp://127.0.0.1:1", WAIT, 0, JobAuth(KEY), KIND_WAIT)
    print(refused.value)
    assert "entry 'kind' says a static group uses this store" in str(refused.value)
    assert "no live worker of one answered" in str(refused.value)
    assert KIND_WAIT <= time.monotonic() - start < KIND_WAIT + 10
    assert not now.check(["twinrpc/0/members"]) and not now.check(["twinrpc/0/token"])  # joined nothing


def test_a_live_dynamic_group_vouches_for_its_kind_and_a_static_worker_gets_pytorchs_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The genuine mix, with a key: a live member answers the static worker's challenge at once (its
    watcher reads the inbox), so the static worker raises PyTorch's error, well within the wait."""
    stores: dict[int, Any] = {}
    monkeypatch.setattr(_rendezvous, "_open_store", lambda init, rank, *a: (stores[rank], False))
    now = dist.HashStore()
    keyed = dist.PrefixStore("twinrpc/0", JobAuth(KEY).wrap(now))  # type: ignore[attr-defined]
    _rendezvous.mark_kind(keyed, "dynamic")
    member = _dynamic_member(keyed, 0)
    watcher = threading.Thread(target=lambda: member.next_notice(), daemon=True)  # answers, then stops
    watcher.start()
    stores.update({1: now})
    start = time.monotonic()
    got, errors = _in_threads(
        lambda rank: join("worker1", rank, 2, "env://", WAIT, 0, JobAuth(KEY), 30.0), [1]
    )
    member.post_stop()
    watcher.join(WAIT)
    assert not got and isinstance(errors[1], RuntimeError) and str(errors[1]) == MIXED, errors
    assert time.monotonic() - start < 10
    assert now.check(["twinrpc/0/members"])  # the dynamic group is as it was


# ---------------------------------------------------------------------------------------------------
# Data changed in flight
# ---------------------------------------------------------------------------------------------------
class _Relay:
    """A TCP relay on the path of one gloo connection: it accepts the connection the pair's initiator
    makes and opens its own to the real listener, then forwards both directions byte for byte (the
    8-byte sequence number gloo's initiator writes first, then every frame), except that the first
    run of ``pattern`` it sees has one byte changed. Non-blocking, on one selector thread: a direction
    is read only while its outgoing buffer is small (so a slow side never makes the relay buffer without
    bound, and neither direction waits on the other), and an end of stream from one side is passed
    on as a half-close once that direction is drained."""

    _CHUNK = 1 << 16
    _HIGH_WATER = 1 << 20

    def __init__(self, host: str, below: int, target: tuple[str, int], pattern: bytes) -> None:
        self.target = target
        self.pattern = pattern
        self.changed = 0
        self.forwarded = 0
        self.sock = self._bind(host, below)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(host: str, below: int) -> socket.socket:
        """A listening socket at ``host`` whose port, as gloo compares ports (the raw sockaddr field:
        network order read as a native integer), is below ``below``, so that the initiator of the pair,
        seeing the relay in place of its peer, still initiates: a port of the form 256 * k reads as k."""
        for k in range(4, 256):
            if k >= below:
                break
            sock = socket.socket()
            try:
                sock.bind((host, 256 * k))
            except OSError:
                sock.close()
                continue
            sock.listen(1)
            return sock
        raise RuntimeError(f"no free port at {host} that gloo orders below {below}")

    def _run(self) -> None:
        self.sock.settimeout(WAIT)
        client, _ = self.sock.accept()
        server = socket.create_connection(self.target, timeout=WAIT)
        ends = [client, server]
        for end in ends:
            end.setblocking(False)
            end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # per direction (from, to): bytes read from ``from`` and not yet written to ``to``; EOF seen
        pending = {0: bytearray(), 1: bytearray()}
        eof = {0: False, 1: False}
        shut = {0: False, 1: False}
        sel = selectors.DefaultSelector()
        interest = {0: 0, 1: 0}
        while not self._stop and not (shut[0] and shut[1]):
            for i, end in enumerate(ends):  # what to wait for on each end now
                events = 0
                if not eof[i] and len(pending[i]) < self._HIGH_WATER:
                    events |= selectors.EVENT_READ
                if pending[1 - i]:
                    events |= selectors.EVENT_WRITE
                if events != interest[i]:
                    if not interest[i]:
                        sel.register(end, events, i)
                    elif not events:
                        sel.unregister(end)
                    else:
                        sel.modify(end, events, i)
                    interest[i] = events
            for key, mask in sel.select(timeout=0.1):
                i = key.data
                end = ends[i]
                try:
                    if mask & selectors.EVENT_READ and not eof[i]:
                        data = end.recv(self._CHUNK)
                        if data:
                            pending[i] += self._tamper(data)
                        else:
                            eof[i] = True
                    if mask & selectors.EVENT_WRITE and pending[1 - i]:
                        sent = end.send(pending[1 - i])
                        del pending[1 - i][:sent]
                        self.forwarded += sent
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:  # a side reset its connection: so does the relay, to the other
                    self._stop = True
                    break
            for i in (0, 1):  # a drained direction whose source ended: half-close it onward
                if eof[i] and not pending[i] and not shut[i]:
                    shut[i] = True
                    with contextlib.suppress(OSError):
                        ends[1 - i].shutdown(socket.SHUT_WR)
        sel.close()
        for end in ends:
            end.close()

    def _tamper(self, data: bytes) -> bytes:
        if self.changed:
            return data
        at = data.find(self.pattern)
        if at < 0:
            return data
        self.changed += 1
        out = bytearray(data)
        out[at + len(self.pattern) // 2] ^= 0x10
        return bytes(out)

    def close(self) -> None:
        self._stop = True
        self._thread.join(WAIT)
        self.sock.close()


class _ThroughRelay(WrappedStore):
    """A pair's store (above the link's authenticated store: the entries gloo reads are checked
    already) as the network position of the attacker makes it: the peer address that the pair's
    initiating side reads points at a :class:`_Relay`, which forwards to the real listener.

    Only the initiator's view may change, and only so that it still initiates: gloo decides which
    side of a pair connects by comparing the two addresses each side holds (IP, then the raw port
    field; ``Device::isInitiator``). Redirect the listening side, or give the initiator a relay
    port that compares the other way, and both sides wait for the other to connect (nothing ever
    reaches the relay; the pair hangs until gloo's timeout), or both connect: which of the two
    depends on the ports the kernel handed out, so a relay put in front of an arbitrary side hangs
    some runs and not others."""

    def __init__(self, inner: Any, me: int, peer: int, pattern: bytes) -> None:
        super().__init__(inner)
        low, high = min(me, peer), max(me, peer)
        #: gloo's address entries of the pair (group ranks: the lower global rank is 0)
        self._own = f"pair/{low}-{high}/0/{0 if me == low else 1}"
        self._peer = f"pair/{low}-{high}/0/{1 if me == low else 0}"
        self.pattern = pattern
        self.relay: _Relay | None = None

    def get(self, key: str) -> bytes:
        value = super().get(key)
        if key != self._peer:
            return value
        own = super().get(self._own)  # this side wrote its own address first
        at, own_at = _gloo_port_at(value), _gloo_port_at(own)
        host = socket.inet_ntoa(value[at + 2 : at + 6])
        assert host == socket.inet_ntoa(own[own_at + 2 : own_at + 6]), "both ends on one address"
        raw_peer = int.from_bytes(value[at : at + 2], "little")  # as gloo compares (isInitiator)
        raw_own = int.from_bytes(own[own_at : own_at + 2], "little")
        if raw_own < raw_peer:
            return value  # this side listens: the other side's read gets the relay
        port = struct.unpack_from(">H", value, at)[0]
        self.relay = _Relay(host, raw_own, (host, port), self.pattern)
        return value[:at] + struct.pack(">H", self.relay.port) + value[at + 2 :]


def _links(
    store: Any, me: int, peer: int, inbox: Inbox, path: Callable[[Any, int, int], Any] = lambda s, r, p: s
) -> tuple[PeerLink, PeerLink]:
    """``me``'s keyed link to ``peer`` and back (``peer`` delivers to ``inbox``), started; each side
    makes the pair's connection over ``path(the link's store, its rank, the other's)``."""
    auth = JobAuth(KEY)

    def make(rank: int) -> PeerLink:
        other = peer if rank == me else me
        link = auth.link(store, rank, other)
        pg = make_pair_group(path(link.store, rank, other), rank, other)
        deliver = inbox if rank == peer else (lambda m: None)
        out = PeerLink(rank, other, pg, deliver, lambda p, exc: None, auth=link.frames)
        out.peer_name = f"'worker{other}' (rank {other})"
        return out

    made, errors = _in_threads(make, [me, peer])
    assert not errors, errors
    for link in made.values():
        link.start()
    return made[me], made[peer]


@pytest.mark.parametrize("floats", [4096, 3 << 20], ids=["16 KiB", "12 MiB, tag after, in pieces"])
def test_a_storage_changed_by_a_relay_on_the_path_fails_the_link_naming_the_peer(
    monkeypatch: pytest.MonkeyPatch, floats: int
) -> None:
    """worker0 -> worker1 crosses a TCP relay (the attacker holds the network between them, not the
    key), worker2 -> worker1 does not (both keyed, over gloo alone: TWINRPC_SHM=0). The relay
    forwards every byte, and changes one of the storage of 7.0s that worker0 sends (small, or large
    enough that its tag follows it and it travels in pieces): the message is not delivered,
    worker1's link from worker0 fails naming authentication and worker0, and worker2's messages
    still arrive."""
    monkeypatch.setenv("TWINRPC_SHM", "0")
    # the two ends live in this one process, where they would share one gloo device and so one
    # listening address; as in two processes, each end gets a device (and an address) of its own
    monkeypatch.setattr(_pair.SHARED_DEVICES, "get", _pair._Devices)
    store = JobAuth(KEY).wrap(dist.HashStore())
    inbox = Inbox()
    sevens = torch.full((floats,), 7.0)
    pattern = sevens[:16].view(torch.uint8).numpy().tobytes()
    paths: list[_ThroughRelay] = []

    def through_relay(link_store: Any, me: int, peer: int) -> Any:
        paths.append(_ThroughRelay(link_store, me, peer, pattern))
        return paths[-1]

    sender, victim = _links(dist.PrefixStore("a", store), 0, 1, inbox, through_relay)  # type: ignore[attr-defined]
    friend, victim2 = _links(dist.PrefixStore("b", store), 2, 1, inbox)  # type: ignore[attr-defined]
    relays = [p.relay for p in paths if p.relay is not None]
    assert len(relays) == 1, "exactly one side (the initiator) connects, through the relay"
    relay = relays[0]
    try:
        sender.send(Message(Kind.CALL, 1, 0, 1, b"before"))
        inbox.wait_for(1)
        sender.send(Message(Kind.CALL, 2, 0, 1, b"sevens", [sevens.view(torch.uint8)]))
        error = wait_failed(victim)
        friend.send(Message(Kind.CALL, 3, 2, 1, b"after, from worker2"))
        got = inbox.wait_for(2)
        print(error, f"relay forwarded {relay.forwarded} bytes", sep="\n")
        assert relay.changed == 1 and relay.forwarded > sevens.numel() * 4
        assert bool((sevens == 7.0).all())
        assert [m.payload for m in got] == [b"before", b"after, from worker2"]
        assert isinstance(error, AuthenticationError)
        assert "authentication failed" in str(error) and "'worker0' (rank 0)" in str(error)
        assert victim2.failed is None and friend.failed is None
    finally:
        end_links(sender, victim, friend, victim2)
        relay.close()


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
