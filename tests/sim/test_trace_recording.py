"""What a simulation's trace records: messages with numbers, vector clocks, task switches, RRef and
autograd events, crashes; and the trace file (save/load) round trip."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import _trace_scenarios as scenarios
import pytest
from twinrpc.simulator import Simulation, Trace, TraceEvent, TraceFormatError

from twinrpc._message import Kind, Message


def _dominates(later: tuple[int, ...], earlier: tuple[int, ...]) -> bool:
    return all(x >= y for x, y in zip(later, earlier, strict=True)) and later != earlier


@pytest.fixture(scope="module")
def rich() -> Trace:
    result = Simulation(3, seed=5).run(scenarios.rich)
    assert result.values()[0] == pytest.approx(4.0)  # d(sum(2t))/dt = 2 per element, 2 elements
    return result.trace


def test_every_delivery_names_its_send_and_its_clock_dominates_the_send(rich: Trace) -> None:
    events = rich.events()
    sends = {ev.message.seq: ev for ev in events if ev.event == "send" and ev.message is not None}
    deliveries = [ev for ev in events if ev.event == "deliver"]
    assert len(deliveries) >= 10
    assert len(sends) == len({ev.message.seq for ev in events if ev.event == "send"})  # one number per send
    for ev in deliveries:
        assert ev.message is not None and ev.message.seq is not None
        send = sends[ev.message.seq]
        assert (send.message.kind, send.message.id, send.message.src, send.message.dst) == (
            ev.message.kind,
            ev.message.id,
            ev.message.src,
            ev.message.dst,
        )
        assert send.worker == ev.message.src and ev.worker == ev.message.dst
        assert send.index < ev.index and send.time <= ev.time
        assert ev.clock is not None and send.clock is not None
        assert _dominates(ev.clock, send.clock)


def test_each_worker_clock_counts_its_own_events(rich: Trace) -> None:
    seen = [0, 0, 0]
    for ev in rich:
        assert ev.clock is not None and len(ev.clock) == 3
        seen[ev.worker] += 1
        assert ev.clock[ev.worker] == seen[ev.worker]


def test_task_switches_rref_and_autograd_events_are_recorded(rich: Trace) -> None:
    names = {ev.event for ev in rich}
    assert "switch" in names
    for expected in (
        "rref-user-created",
        "rref-owner-created",
        "rref-forked",
        "rref-fork-known",
        "rref-user-confirmed",
        "rref-user-deleted",
        "rref-delete-heard",
        "rref-freed",
        "autograd-context-created",
        "autograd-send-recorded",
        "autograd-recv-recorded",
        "autograd-backward-started",
        "autograd-backward-finished",
        "autograd-gradient-sent",
        "autograd-context-released",
    ):
        assert expected in names, f"no {expected} event in {sorted(names)}"
    by_event = {ev.event: ev for ev in rich}
    assert by_event["autograd-backward-finished"].worker == 0
    assert by_event["autograd-backward-finished"].detail.endswith("done")
    assert by_event["rref-freed"].worker == 1  # the owner of the remote() value
    assert rich.workers == ["worker0", "worker1", "worker2"]


def test_a_crash_and_the_messages_lost_with_it_are_recorded() -> None:
    def program(rank: int) -> None:
        scenarios.rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        if rank == 0:
            scenarios.rpc.rpc_sync("worker1", scenarios.add1, args=(scenarios.torch.ones(1),))  # the link
            sim.crash(1, at=sim.now + 20e-6)  # while the call is in flight
            fut = scenarios.rpc.rpc_async("worker1", scenarios.add1, args=(scenarios.torch.ones(1),))
            with pytest.raises(RuntimeError):
                fut.wait()
        scenarios.sleep(1.0)

    sim = Simulation(2, seed=1)
    result = sim.run(program)
    assert result.crashed == (1,)
    events = result.trace.events()
    crash = next(ev for ev in events if ev.event == "crash")
    lost = next(ev for ev in events if ev.event == "lost")
    assert crash.worker == 1 and lost.worker == 1 and lost.index > crash.index
    assert lost.message is not None and lost.message.kind == "CALL"
    send = [
        ev for ev in events if ev.event == "send" and ev.message is not None and ev.message.kind == "CALL"
    ][-1]
    assert lost.message.seq == send.message.seq


def test_drops_and_duplicates_keep_the_message_number() -> None:
    trace = Trace(world_size=2)
    msg = Message(Kind.RREF_USER_DELETE, 7, 0, 1, b"x")
    trace.sent(0.0, 0, msg, 1)
    trace.message(0.0, 0, "duplicate", msg)
    trace.message(1.0, 1, "deliver", msg)
    trace.message(2.0, 1, "deliver", msg)  # the copy
    other = Message(Kind.CALL, 8, 0, 1, b"yy")
    trace.sent(3.0, 0, other, 2)
    trace.message(3.0, 0, "drop", other)
    original = Message(Kind.RREF_FORK_REQUEST, 3, 1, 0, b"z")
    trace.sent(5.0, 1, original, 1)
    trace.message(5.0, 1, "duplicate", original)
    copy = Message(original.kind, original.id, original.src, original.dst, original.payload)  # a fault's copy
    trace.message(5.5, 0, "deliver", copy)
    trace.message(6.0, 0, "deliver", original)
    never = Message(Kind.CALL, 9, 0, 1, b"")
    trace.message(4.0, 0, "send-failed", never, ": peer dead")
    seqs = [(ev.event, ev.message.seq if ev.message else None) for ev in trace]
    assert seqs == [
        ("send", 0),
        ("duplicate", 0),
        ("deliver", 0),
        ("deliver", 0),
        ("send", 1),
        ("drop", 1),
        ("send", 2),
        ("duplicate", 2),
        ("deliver", 2),
        ("deliver", 2),
        ("send-failed", None),
    ]
    assert list(trace)[-1].detail == "CALL#9 0->1 (0 B): peer dead"


def test_recorded_details_read_back_as_given_whatever_they_are() -> None:
    details = [
        "text",
        (3, "main[0]"),  # a task switch: packed
        ("CALL", 1, 0, 1, 5, None, ": note"),  # a loaded message event without a number: packed
        ("CALL", 1, 0, 1, 5, 7, ""),
        (3, "main[0]", "x"),  # the tuples below do not fit a packed form: kept as they are
        (True, "main[0]"),
        (1 << 70, "main[0]"),
        (Kind.CALL, 1, 0, 1, 5, 7, ""),
        ("CALL", 1 << 70, 0, 1, 5, 7, ""),
        ("CALL", 1, 0, 1, 5, -1, ""),
        None,
    ]
    trace = Trace(world_size=2)
    for i, detail in enumerate(details):
        trace.record(0.1 * i, i % 2, "switch" if i % 3 else "fault", detail)
    msg = Message(Kind.CALL, 9, 0, 1, b"abc")
    trace.sent(2.5, 0, msg, 3)
    trace.message(2.75, 1, "deliver", msg, ": late")
    rows = list(trace._rows())
    expected = [(0.1 * i, i % 2, "switch" if i % 3 else "fault", d) for i, d in enumerate(details)]
    expected += [
        (2.5, 0, "send", ("CALL", 9, 0, 1, 3, 0, "")),
        (2.75, 1, "deliver", ("CALL", 9, 0, 1, 3, 0, ": late")),
    ]
    assert rows == expected
    assert [repr(row) for row in rows] == [
        repr(row) for row in expected
    ]  # the same types too (True, Kind.CALL)
    assert len(trace) == len(expected)
    assert (trace.count("switch"), trace.count("fault"), trace.count("send"), trace.count("drop")) == (
        7,
        4,
        1,
        0,
    )
    with pytest.raises(struct.error):
        trace.record("later", 0, "exit", "ok")  # type: ignore[arg-type]
    assert len(trace) == len(expected)  # nothing recorded


def test_save_then_load_gives_the_same_events_digest_and_bytes(rich: Trace, tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rich.save(first)
    loaded = Trace.load(first)
    assert loaded.digest() == rich.digest()
    assert loaded.events() == rich.events()
    assert (loaded.seed, loaded.world_size, loaded.workers) == (5, 3, ["worker0", "worker1", "worker2"])
    loaded.save(second)
    assert first.read_bytes() == second.read_bytes()
    header = json.loads(first.read_text().splitlines()[0])
    assert header["format"] == "twinrpc-trace" and header["version"] == 1 and header["seed"] == 5


def test_the_same_seed_and_program_write_byte_identical_trace_files(tmp_path: Path) -> None:
    for name in ("a", "b"):
        Simulation(3, seed=11).run(scenarios.rich).trace.save(tmp_path / f"{name}.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    Simulation(3, seed=12).run(scenarios.rich).trace.save(tmp_path / "c.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()


def test_loading_something_else_fails_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "notes.jsonl"
    bad.write_text('{"hello": 1}\n')
    with pytest.raises(TraceFormatError, match=r"notes\.jsonl: not a twinrpc trace"):
        Trace.load(bad)
    newer = tmp_path / "newer.jsonl"
    newer.write_text('{"format": "twinrpc-trace", "version": 99}\n')
    with pytest.raises(TraceFormatError, match="version 99"):
        Trace.load(newer)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"format": "twinrpc-trace", "version": 1}\n{"t": 1}\n')
    with pytest.raises(TraceFormatError, match=r"broken\.jsonl:2"):
        Trace.load(broken)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.jsonl"):
        Trace.load(empty)


def test_trace_events_are_plain_values() -> None:
    ev = TraceEvent(0.5, 1, "exit", "ok")
    assert ev.line() == "0.500000000 w1 exit ok"
    assert ev.message is None and ev.clock is None


def _deletes_under_faults(rank: int, sim: Simulation) -> None:
    scenarios.rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        sim.drop("rref-control", src=0, dst=1)  # the first delete is lost (and resent)
        sim.duplicate("rref-control", src=0, dst=1, nth=2, extra=1e-3)  # the resend arrives twice
        rref = scenarios.rpc.remote("worker1", scenarios.double, args=(scenarios.torch.ones(1),))
        rref.to_here()
        del rref
    scenarios.sleep(5.0)  # past the control-message retry
    scenarios.rpc.shutdown()


def test_fault_verbs_drops_and_duplicates_are_linked_to_their_send() -> None:
    sim = Simulation(2, seed=3)
    sim.run(_deletes_under_faults, sim)
    events = sim.trace.events()
    drop = next(ev for ev in events if ev.event == "drop")
    duplicate = next(ev for ev in events if ev.event == "duplicate")
    for ev in (drop, duplicate):
        assert ev.message is not None and ev.message.kind == "RREF_USER_DELETE" and ev.message.seq is not None
        send = next(e for e in events if e.event == "send" and e.message.seq == ev.message.seq)
        assert send.index < ev.index and send.message.kind == "RREF_USER_DELETE"
    assert not [ev for ev in events if ev.event == "deliver" and ev.message.seq == drop.message.seq]
    copies = [ev for ev in events if ev.event == "deliver" and ev.message.seq == duplicate.message.seq]
    assert len(copies) == 2 and copies[1].time >= copies[0].time + 1e-3
