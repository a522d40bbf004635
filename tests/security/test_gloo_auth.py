"""Authenticated frames and rendezvous entries with a job key (impl/_auth.py).

From cheap to dear: the frame tag and the store's MAC on their own; a live pair of links in this
process, where hostile frames are injected (nothing of them is delivered, let alone unpickled, and the
link fails naming authentication and the peer, while another link keeps working); then small worlds
in fresh processes: workers started with different keys fail ``init_rpc`` on every rank, in bounded
time, and a process without the key gets nothing unpickled through the store or through a link.
"""

from __future__ import annotations

import operator
import pickle
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo_pair import WAIT, Inbox
from _gloo_pair import end_links as _end
from _gloo_pair import wait_failed as _wait_failed
from _spawn_world import bad_peer_world, preloaded_context, run_keyed_world
from twinrpc.impl._auth import MARK, AuthenticationError, AuthStore, FrameAuth, JobAuth, job_key
from twinrpc.impl._framing import (
    _FLAGS,
    _FLAGS_AT,
    FLAG_TAG_AFTER,
    HEADER_BYTES,
    PAYLOAD_TAG_AT,
    SIZES_AT,
    TAG_AT,
    FrameEncoder,
    Header,
    encode_header,
    new_header_tensor,
)
from twinrpc.impl._link import PeerLink, make_pair_group
from twinrpc.impl._pair import DATA_TAG

import twinrpc.rpc as rpc
from twinrpc._key_source import _EnvironmentKey
from twinrpc._message import Kind, Message

PEER = "'worker0' (rank 0)"


class _OpensFile:
    """Unpickling this creates ``path``: the marker that something of a hostile frame was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


# ---------------------------------------------------------------------------------------------------
# The key, the frame tag and the store's MAC on their own
# ---------------------------------------------------------------------------------------------------
def test_the_key_comes_from_the_options_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWINRPC_AUTH_KEY", raising=False)
    monkeypatch.delenv("TWINRPC_AUTH_KEY_FILE", raising=False)
    monkeypatch.setattr(_EnvironmentKey, "key", None)  # what an earlier read in this process kept
    assert job_key(rpc.RpcBackendOptions()) is None
    monkeypatch.setenv("TWINRPC_AUTH_KEY", "from the launcher")
    assert job_key(rpc.RpcBackendOptions()) == b"from the launcher"
    assert job_key(rpc.TensorPipeRpcBackendOptions(auth_key=b"mine")) == b"mine"
    monkeypatch.setenv("TWINRPC_AUTH_KEY", "")
    with pytest.raises(ValueError, match="TWINRPC_AUTH_KEY is set but empty"):
        job_key(rpc.RpcBackendOptions())
    with pytest.raises(TypeError, match="auth_key must be bytes"):
        rpc.ProcessGroupRpcBackendOptions(auth_key="text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="auth_key must not be empty"):
        rpc.RpcBackendOptions(auth_key=b"")
    assert "secret" not in repr(rpc.RpcBackendOptions(auth_key=b"secret"))


def _sealed(auth: FrameAuth, seq: int, msg: Message, riders: list[Message] | None = None) -> memoryview:
    _, view = new_header_tensor()
    enc = FrameEncoder(view)
    enc.first(msg, 0, riders)
    enc.add(Message(Kind.CALL, 50, 0, 1, b"a further message"))
    auth.seal(view, seq, enc.used, msg.payload, msg.tensors)
    return view


def test_a_sealed_header_passes_only_on_its_link_in_its_direction_at_its_sequence_number() -> None:
    key = b"k" * 32
    sender, receiver = FrameAuth(key, 0, 1), FrameAuth(key, 1, 0)
    view = _sealed(sender, 7, Message(Kind.CALL, 1, 0, 1, b"payload"), [Message(Kind.CALL, 9, 0, 1, b"r")])
    receiver.check_header(view, 7, PEER)
    for name, check in [
        ("replayed or reordered", lambda: receiver.check_header(view, 8, PEER)),
        ("reflected back to its sender", lambda: sender.check_header(view, 7, PEER)),
        ("another link's key", lambda: FrameAuth(b"x" * 32, 1, 0).check_header(view, 7, PEER)),
    ]:
        with pytest.raises(AuthenticationError, match=r"authentication failed: frame \d+ from 'worker0'"):
            check()
        print("refused:", name)


def test_every_meaningful_byte_of_a_header_is_covered_and_the_unused_rest_is_not() -> None:
    key = b"k" * 32
    sender, receiver = FrameAuth(key, 0, 1), FrameAuth(key, 1, 0)
    view = _sealed(
        sender, 0, Message(Kind.CALL, 1, 0, 1, b"payload"), [Message(Kind.CALL, 9, 0, 1, b"rider")]
    )
    (used,) = struct.unpack_from("<H", view, 10)
    riders_at = HEADER_BYTES - 4 - struct.unpack_from("<H", view, HEADER_BYTES - 2)[0]
    meaningful = [
        i for i in range(HEADER_BYTES) if i < TAG_AT or PAYLOAD_TAG_AT <= i < used or i >= riders_at
    ]
    assert SIZES_AT < used < riders_at < HEADER_BYTES - 4
    for i in meaningful:
        view[i] ^= 1
        with pytest.raises(AuthenticationError):
            receiver.check_header(view, 0, PEER)
        view[i] ^= 1
    view[used] ^= 0xFF  # between the messages and the riders: no byte there is read
    receiver.check_header(view, 0, PEER)


def test_data_sent_apart_must_match_the_tag_its_header_carries() -> None:
    """A payload frame and the storages' frames: each byte counts, and so do their order and the
    header's sequence number (the data tag's one-time key is drawn from it)."""
    key = b"k" * 32
    sender, receiver = FrameAuth(key, 0, 1), FrameAuth(key, 1, 0)
    payload = b"p" * 5000  # does not fit in the header: travels as a frame of its own
    storages = [torch.arange(200, dtype=torch.uint8), torch.full((3000,), 7, dtype=torch.uint8)]
    view = _sealed(sender, 3, Message(Kind.CALL, 1, 0, 1, payload, storages))
    tag = receiver.check_header(view, 3, PEER)
    receiver.check_data([payload, *storages], tag, 1, PEER)
    flipped = storages[1].clone()
    flipped[1234] ^= 1
    for parts in (
        [payload[:-1] + b"q", *storages],
        [payload, storages[0], flipped],
        [payload, storages[1], storages[0]],
        [payload, storages[0]],
    ):
        with pytest.raises(AuthenticationError, match="data of message 1 from 'worker0'"):
            receiver.check_data(parts, tag, 1, PEER)
    with pytest.raises(AuthenticationError):
        receiver.check_data([payload, *storages], (tag[0], 4), 1, PEER)


def test_large_data_is_sealed_tag_after_and_its_tag_still_covers_every_byte_in_order() -> None:
    """A storage over the go-ahead size: the header says the tag follows the data (a flag its own tag
    covers) and carries none; the tag the sender computes while sending matches only the same bytes
    in the same order, for that header's sequence number."""
    key = b"k" * 32
    sender, receiver = FrameAuth(key, 0, 1), FrameAuth(key, 1, 0)
    big = torch.full((5 << 20,), 3, dtype=torch.uint8)
    small = torch.arange(200, dtype=torch.uint8)
    msg = Message(Kind.CALL, 1, 0, 1, b"p" * 5000, [small, big])
    _, view = new_header_tensor()
    enc = FrameEncoder(view)
    enc.first(msg, 0, None)
    mac = sender.seal(view, 3, enc.used, msg.payload, msg.tensors, after_over=4 << 20)
    assert mac is not None
    assert _FLAGS.unpack_from(view, _FLAGS_AT)[0] & FLAG_TAG_AFTER
    assert bytes(view[PAYLOAD_TAG_AT:SIZES_AT]) == bytes(SIZES_AT - PAYLOAD_TAG_AT)
    expected = receiver.check_header(view, 3, PEER)
    assert Header(view, 0, 1).tag_after
    for part in (msg.payload, small, big):
        mac.update(part)
    tag = mac.finalize()

    def check(parts: list[Any], seq: int = 3) -> None:
        incoming = receiver.incoming_mac((expected[0], seq))
        for part in parts:
            incoming.update(part)
        receiver.check_tag_after(incoming, tag, 1, PEER)

    check([msg.payload, small, big])
    flipped = big.clone()
    flipped[(4 << 20) + 17] ^= 1
    for parts, seq in (
        ([msg.payload, small, flipped], 3),
        ([msg.payload, big, small], 3),
        ([msg.payload, small], 3),
        ([msg.payload, small, big], 4),
    ):
        with pytest.raises(AuthenticationError, match="data of message 1 from 'worker0'"):
            check(parts, seq)
    # the same message sealed without a bound (or with its data under it) keeps its tag in the header
    _, plain = new_header_tensor()
    enc = FrameEncoder(plain)
    enc.first(msg, 0, None)
    assert sender.seal(plain, 3, enc.used, msg.payload, msg.tensors) is None
    assert not _FLAGS.unpack_from(plain, _FLAGS_AT)[0] & FLAG_TAG_AFTER
    receiver.check_data([msg.payload, small, big], receiver.check_header(plain, 3, PEER), 1, PEER)


def test_store_values_are_authenticated_by_name_and_value() -> None:
    raw = dist.HashStore()
    store = JobAuth(b"job key").wrap(raw)
    store.set("twinrpc/0/name/1", "worker1")
    assert store.get("twinrpc/0/name/1") == b"worker1"
    assert raw.get("twinrpc/0/name/1").startswith(MARK)
    raw.set("twinrpc/0/name/2", raw.get("twinrpc/0/name/1"))  # a valid entry moved to another name
    raw.set("twinrpc/0/name/3", "forged")  # written without the key
    JobAuth(b"another key").wrap(raw).set("twinrpc/0/name/4", "worker4")
    for key, match in [(2, "not written with this worker's key"), (3, "carries no MAC"), (4, "not written")]:
        with pytest.raises(AuthenticationError, match=match):
            store.get(f"twinrpc/0/name/{key}")
    # compare_set works on authenticated values (the membership token, the group's kind)
    assert store.compare_set("kind", "", "static") == b"static"
    assert store.compare_set("kind", "", "dynamic") == b"static"
    assert store.compare_set("kind", "static", "dynamic") == b"dynamic"
    prefixed = dist.PrefixStore("twinrpc/1", store)  # type: ignore[attr-defined]  # as the rendezvous uses it
    prefixed.set("name/0", "w0")
    assert prefixed.get("name/0") == b"w0" and isinstance(store, AuthStore)
    assert prefixed.clone().get("name/0") == b"w0"


# ---------------------------------------------------------------------------------------------------
# A live pair of links in this process
# ---------------------------------------------------------------------------------------------------
def _keyed_links(
    store: Any, me: int, peer: int, on_message: Any, failures: list[BaseException], auth: JobAuth
) -> tuple[PeerLink, PeerLink]:
    """Rank ``me``'s link to ``peer`` and back (``me`` sends, ``peer`` delivers to ``on_message``),
    each with its frame MACs from ``auth``, started; failures on either side go to ``failures``."""
    links: dict[int, PeerLink] = {}

    def make(rank: int, other: int, deliver: Any) -> None:
        link = auth.link(store, rank, other)  # first: the pair's entries are bound to the link's key
        pg = make_pair_group(link.store, rank, other)
        links[rank] = PeerLink(
            rank, other, pg, deliver, lambda p, exc: failures.append(exc), auth=link.frames
        )

    threads = [
        threading.Thread(target=make, args=(me, peer, lambda m: None)),
        threading.Thread(target=make, args=(peer, me, on_message)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    links[peer].peer_name = f"'worker{me}' (rank {me})"
    for link in links.values():
        link.start()
    return links[me], links[peer]


class _Unpickling(Inbox):
    """An inbox that unpickles every payload it gets, as a worker's agent does."""

    def __call__(self, msg: Message) -> None:
        if msg.payload:
            pickle.loads(msg.payload)
        super().__call__(msg)


def _inject_unsealed(link: PeerLink, payload: bytes) -> None:
    """Send a header frame as a process without the key would (test-only injection)."""
    t, view = new_header_tensor()
    encode_header(view, Message(Kind.CALL, 7, link.me, link.peer, payload))
    with link.sender.lock:
        link.sender.send_raw_header(t)


def _inject_swapped_payload(link: PeerLink, payload: bytes) -> None:
    """A header sealed with the key for an honest payload, followed by another payload frame (as an
    on-path attacker swapping the payload frame would send)."""
    honest = pickle.dumps("an honest payload " * 300)
    t, view = new_header_tensor()
    enc = FrameEncoder(view)
    enc.first(Message(Kind.CALL, 8, link.me, link.peer, honest), link.receiver.consumed, None)
    sender = link.sender
    with sender.lock:
        seq = sender.headers_sent
        sender.headers_sent += 1
        sender._auth.seal(view, seq, enc.used, honest)  # type: ignore[union-attr]
        link.sender.send_raw_header(t)
        data = torch.frombuffer(bytearray(payload.ljust(len(honest), b".")), dtype=torch.uint8)
        link.pair.pg.send([data], link.pair.peer_rank, DATA_TAG).wait()


@pytest.mark.parametrize("attack", [_inject_unsealed, _inject_swapped_payload], ids=["unsealed", "swapped"])
def test_a_hostile_frame_is_dropped_unpickled_and_fails_only_its_link(tmp_path: Path, attack: Any) -> None:
    """The victim (rank 1) has links from rank 0 (hostile) and rank 2 (honest), all keyed: the hostile
    frame is not delivered (the inbox would unpickle it, creating the marker), the link from rank 0
    fails with an error naming authentication and 'worker0', and rank 2's messages still arrive."""
    marker = tmp_path / "unpickled"
    auth = JobAuth(b"the job's key")
    store = auth.wrap(dist.HashStore())
    failures: list[BaseException] = []
    inbox = _Unpickling()
    attacker, victim = _keyed_links(dist.PrefixStore("a", store), 0, 1, inbox, failures, auth)  # type: ignore[attr-defined]
    friend, victim2 = _keyed_links(dist.PrefixStore("b", store), 2, 1, inbox, failures, auth)  # type: ignore[attr-defined]
    try:
        attacker.send(Message(Kind.CALL, 1, 0, 1, pickle.dumps("before")))
        inbox.wait_for(1)
        attack(attacker, pickle.dumps(_OpensFile(str(marker))))
        error = _wait_failed(victim)
        friend.send(Message(Kind.CALL, 2, 2, 1, pickle.dumps("after, from rank 2")))
        got = inbox.wait_for(2)
        assert [pickle.loads(m.payload) for m in got] == ["before", "after, from rank 2"]
        assert not marker.exists()
        assert isinstance(error, AuthenticationError)
        assert "authentication failed" in str(error) and "'worker0' (rank 0)" in str(error), error
        assert victim.bad_frames == 1 and victim2.failed is None
        print(error)
    finally:
        _end(attacker, victim, friend, victim2)
    assert not marker.exists()


def test_a_replayed_frame_fails_the_link(tmp_path: Path) -> None:
    """An honest frame recorded on the way and sent again is refused (its sequence number is past)."""
    auth = JobAuth(b"the job's key")
    store = auth.wrap(dist.HashStore())
    failures: list[BaseException] = []
    inbox = _Unpickling()
    sender, listener = _keyed_links(store, 0, 1, inbox, failures, auth)
    try:
        sender.send(Message(Kind.CALL, 1, 0, 1, pickle.dumps("once")))
        inbox.wait_for(1)
        recorded = sender.sender._header.clone()  # the frame just sent, tag and all
        with sender.sender.lock:
            sender.sender.send_raw_header(recorded)
        error = _wait_failed(listener)
        assert "authentication failed" in str(error) and "'worker0' (rank 0)" in str(error)
        assert len(inbox.got) == 1
    finally:
        _end(sender, listener)


def test_keyed_links_carry_every_kind_of_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inline, coalesced, riders, a payload frame of its own, storages and storages large enough to
    travel tag after, in pieces: all arrive, in order (over gloo: no same-host ring)."""
    monkeypatch.setenv("TWINRPC_SHM", "0")
    auth = JobAuth(b"the job's key")
    store = auth.wrap(dist.HashStore())
    failures: list[BaseException] = []
    inbox = Inbox()
    sender, listener = _keyed_links(store, 0, 1, inbox, failures, auth)
    try:
        assert sender.defer(Message(Kind.RREF_USER_DELETE, 1, 0, 1, b"rider"), lambda m, e: None)
        sender.send(Message(Kind.CALL, 2, 0, 1, b"x" * 10_000, [torch.arange(10, dtype=torch.uint8)]))
        with sender.sender.lock:  # the next three queue behind a frame "being sent": coalesced
            for i in range(3, 6):
                sender.send(Message(Kind.CALL, i, 0, 1, b"small %d" % i), lambda m, e: None)
        sender.send(Message(Kind.CALL, 6, 0, 1, b"last"))
        # storages over the go-ahead size: sent tag after, in pieces (impl/_framing.py, FLAG_TAG_AFTER)
        big = torch.randint(0, 256, (20 << 20,), dtype=torch.uint8)
        sender.send(
            Message(Kind.CALL, 7, 0, 1, b"big", [big, torch.arange(5, dtype=torch.uint8), big[: 5 << 20]])
        )
        sender.send(Message(Kind.CALL, 8, 0, 1, b"after the big one"))
        got = inbox.wait_for(8)
        assert [m.id for m in got] == [1, 2, 3, 4, 5, 6, 7, 8]
        assert got[1].payload == b"x" * 10_000 and torch.equal(
            got[1].tensors[0], torch.arange(10, dtype=torch.uint8)
        )
        assert torch.equal(got[6].tensors[0], big) and torch.equal(got[6].tensors[2], big[: 5 << 20])
        assert got[7].payload == b"after the big one"
        assert sender.sender.messages_sent > sender.sender.headers_sent - 1
    finally:
        _end(sender, listener)
    assert not failures, failures
    assert Header  # the decoder the receiver runs after the check


# ---------------------------------------------------------------------------------------------------
# Worlds in fresh processes
# ---------------------------------------------------------------------------------------------------
#: wall-clock bound of one world (process start-up included; the host may be loaded)
WORLD_TIMEOUT = 90.0
#: the rendezvous timeout of these worlds: a mismatch must be reported well within it
RENDEZVOUS = 30.0


def _context() -> Any:
    return preloaded_context()


def _run_world(program: Any, keys: list[str | None], tmp_path: Path, **extra: Any) -> dict[int, Any]:
    """Run ``program(rank, init_file, shared)`` on one fresh process per key (see run_keyed_world)."""
    return run_keyed_world(program, keys, str(tmp_path / "rendezvous"), WORLD_TIMEOUT, **extra)


def _options(init_file: str) -> Any:
    return rpc.RpcBackendOptions(init_method=f"file://{init_file}", rpc_timeout=RENDEZVOUS)


def _init_fails_program(rank: int, init_file: str, shared: dict[str, Any]) -> Any:
    start = time.monotonic()
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=_options(init_file))
    except Exception as exc:
        return (type(exc).__name__, str(exc), time.monotonic() - start)
    rpc.shutdown(graceful=False)
    return ("joined", "", time.monotonic() - start)


@pytest.mark.parametrize(
    "keys", [["key a", "key a", "key b"], ["key a", None, "key a"]], ids=["different", "one-without"]
)
def test_workers_started_with_different_keys_fail_init_on_every_rank(
    tmp_path: Path, keys: list[str | None]
) -> None:
    got = _run_world(_init_fails_program, keys, tmp_path)
    for rank, (kind, message, elapsed) in sorted(got.items()):
        print(f"rank {rank} ({keys[rank]!r}): {kind} after {elapsed:.2f} s: {message}")
        assert kind == "AuthenticationError", (rank, kind, message)
        assert "authentication" in message and f"(rank {rank})" in message
        assert elapsed < RENDEZVOUS / 2


def _store_attack_program(rank: int, init_file: str, shared: dict[str, Any]) -> Any:
    """A dynamic group of two keyed workers; rank 2 has no key: it tries to join, then writes a
    forged join notice into worker0's inbox (reading its id from the store, whose values are
    authenticated, not secret). Worker0 must neither connect to it nor unpickle anything of it."""
    options = _options(init_file)
    if rank == 1:
        shared["worker0_up"].wait(WORLD_TIMEOUT)
        rpc.init_rpc("worker1", rank=1, rpc_backend_options=options)
        shared["members_up"].set()
        shared["joined"].wait(WORLD_TIMEOUT)
        rpc.shutdown()
        return "member"
    if rank == 0:
        rpc.init_rpc("worker0", rank=0, rpc_backend_options=options)
        shared["worker0_up"].set()
        shared["attacked"].wait(WORLD_TIMEOUT)
        time.sleep(0.5)  # let the watcher see the forged notice
        from twinrpc._current import current_agent

        peers = sorted(current_agent().world.links)  # type: ignore[attr-defined]
        answer = rpc.rpc_sync("worker1", operator.add, args=(2, 3))
        shared["joined"].set()
        rpc.shutdown()
        return {"peers": peers, "answer": answer}
    shared["members_up"].wait(WORLD_TIMEOUT)
    error = ""
    try:
        rpc.init_rpc("intruder", rank=2, rpc_backend_options=options)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    # Straight to the store, as a process without the key can: list itself to worker0's watcher.
    store = dist.FileStore(init_file, -1)  # type: ignore[attr-defined]
    members = store.get("twinrpc/0/members")[len(MARK) + 16 :]  # after MARK and the tag: plain text
    uid = members.split(b"\n")[0].split(b" ")[1].decode()
    n = store.add(f"twinrpc/0/inbox/{uid}/count", 1)
    store.set(f"twinrpc/0/inbox/{uid}/{n}", f"join 2 {'0' * 32} intruder")
    shared["attacked"].set()
    return error


def test_a_process_without_the_key_gets_nothing_through_the_store(tmp_path: Path) -> None:
    mp = _context()
    got = _run_world(
        _store_attack_program,
        ["key a", "key a", None],
        tmp_path,
        worker0_up=mp.Event(),
        members_up=mp.Event(),
        attacked=mp.Event(),
        joined=mp.Event(),
    )
    print(got[2])
    assert got[2].startswith("AuthenticationError") and "authentication" in got[2] and "(rank 2)" in got[2]
    assert got[0] == {"peers": [1], "answer": 5}


def _link_attack_program(rank: int, init_file: str, shared: dict[str, Any]) -> Any:
    """Three keyed workers; worker0's link to worker1 sends a frame without the key's MAC whose
    payload would create a marker file if unpickled. Worker1's link to it fails naming
    authentication and worker0; worker1 still calls worker2."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=_options(init_file))
    marker = shared["marker"]
    return bad_peer_world(
        rank, shared, lambda link: _inject_unsealed(link, pickle.dumps(_OpensFile(marker))), WORLD_TIMEOUT
    )


def test_a_frame_without_the_key_is_not_unpickled_and_fails_only_its_link(tmp_path: Path) -> None:
    mp = _context()
    marker = tmp_path / "unpickled"
    got = _run_world(
        _link_attack_program,
        ["key a"] * 3,
        tmp_path,
        marker=str(marker),
        sent=mp.Event(),
        done=mp.Event(),
    )
    victim, sender = got[1], got[0]
    print(victim["error"], sender["error"], sep="\n")
    assert not marker.exists()
    # the caller on the refusing side: authentication, the peer, not a death
    error = victim["error"]
    assert "authentication failed" in error and "'worker0' (rank 0)" in error, error
    assert "Its link failed this job's authentication" in error and "probably died" not in error
    assert victim["other"] == 3 and victim["bad"] == 1
    # the caller whose frame was refused sees the link closed; the error says what that may mean
    error = sender["error"]
    assert "'worker1' (rank 1) is unavailable" in error, error
    assert "a worker also closes a link on which a frame failed authentication" in error


# ---------------------------------------------------------------------------------------------------
# The simulator: no wire to authenticate, but the same init_rpc for mismatched keys
# ---------------------------------------------------------------------------------------------------
def test_the_simulator_fails_init_on_every_rank_for_mismatched_keys_as_the_gloo_world() -> None:
    from twinrpc.simulator import Simulation

    def program(keys: list[bytes | None], dynamic: bool) -> Any:
        def worker(rank: int) -> str:
            options = rpc.RpcBackendOptions(auth_key=keys[rank])
            try:
                rpc.init_rpc(
                    f"worker{rank}", rank=rank, world_size=None if dynamic else 3, rpc_backend_options=options
                )
            except rpc.AuthenticationError as exc:
                assert "authentication" in str(exc) and f"(rank {rank})" in str(exc), exc
                return "refused"
            if not dynamic:
                assert rpc.rpc_sync(f"worker{(rank + 1) % 3}", operator.add, args=(rank, 1)) == rank + 1
            rpc.shutdown()
            return "joined"

        return worker

    assert Simulation(world_size=3, seed=0).run(program([b"a"] * 3, False)).values() == ["joined"] * 3
    assert (
        Simulation(world_size=3, seed=0).run(program([b"a", b"a", None], False)).values() == ["refused"] * 3
    )
    # a dynamic group: whoever joins with a key other than its members' is refused
    keys: list[bytes | None] = [b"a", b"b", b"a"]
    joins = Simulation(world_size=3, seed=0).run(program(keys, True)).values()
    assert "refused" in joins and len({keys[r] for r, got in enumerate(joins) if got == "joined"}) == 1, joins
