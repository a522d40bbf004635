"""The gloo link's parts on their own (no process group): liveness judges a silent peer only while
this worker depends on it, riders keep their order, and no part reaches into another's private state
(each owns its state and locks; ``PeerLink`` in impl/_link.py only wires them together)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
import twinrpc.impl
from _private_reaches import private_reaches
from twinrpc.impl._framing import MAX_RIDER_BYTES
from twinrpc.impl._link_state import LinkState
from twinrpc.impl._link_table import PairAsks, post_ask
from twinrpc.impl._liveness import Liveness, PeerSilent
from twinrpc.impl._peer_process import PeerProcess, Verdict
from twinrpc.impl._riders import Riders
from twinrpc.impl._stores import WrappedStore

from twinrpc._message import Kind, Message

IMPL = pathlib.Path(twinrpc.impl.__file__).parent
LINK_PARTS = [
    "_link.py",
    "_link_state.py",
    "_liveness.py",
    "_pair.py",
    "_receiver.py",
    "_riders.py",
    "_sender.py",
]
#: torch's privates a part uses as API: ``ProcessGroupGloo._Options`` is the only way to give a pair's
#: group the shared gloo device and its thread count (PyTorch's own gloo tests build their groups so)
TORCH_API = {"_pair.py": {"_Options"}}


@pytest.mark.parametrize("module", LINK_PARTS)
def test_no_part_of_the_link_reaches_into_another_objects_private_state(module: str) -> None:
    reaches = private_reaches(IMPL / module, base=IMPL.parent, allowed=TORCH_API.get(module, set()))
    assert not reaches, "private attributes used across objects:\n" + "\n".join(reaches)


def _liveness(send_timeout: float | None = None) -> tuple[Liveness, LinkState, list[BaseException]]:
    state = LinkState(0, 1)
    failed: list[BaseException] = []
    return Liveness(state, failed.append, send_timeout), state, failed


def test_a_peer_never_heard_from_is_not_judged() -> None:
    live, _, failed = _liveness()
    live.header_waiters, live.header_since = 1, 0.0
    live.check_alive(100.0, 1.0)
    assert failed == []


def test_a_peer_silent_while_a_receiver_waits_for_it_is_declared_silent() -> None:
    live, _, failed = _liveness()
    live.heard = 10.0
    live.header_waiters, live.header_since = 1, 5.0
    live.check_alive(10.5, 1.0)
    assert failed == []  # within the limit
    live.check_alive(20.0, 1.0)
    assert len(failed) == 1 and isinstance(failed[0], PeerSilent)
    assert "while waiting for one" in str(failed[0])


def test_a_silent_peer_on_this_host_is_dead_only_once_its_process_is_stopped() -> None:
    """Many workers on few cores can keep a peer from a core past the bound: while its process runs
    it is slow, not dead (the 64-worker job's failure); stopped (SIGSTOP), it is declared silent."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        process = PeerProcess.of(child.pid)
        assert process is not None
        state = LinkState(0, 1)
        failed: list[BaseException] = []
        live = Liveness(state, failed.append, None, process)
        live.heard = 10.0
        live.header_waiters, live.header_since = 1, 5.0
        live.check_alive(100.0, 1.0)
        assert failed == []  # seen running at 100.0: as good as a heartbeat then
        os.kill(child.pid, signal.SIGSTOP)
        while process.verdict() is Verdict.ALIVE:  # the kernel stops it soon (bounded by the test timeout)
            time.sleep(0.01)
        live.check_alive(100.5, 1.0)
        assert failed == []  # stopped for less than the bound: not cut off yet
        live.check_alive(102.0, 1.0)
        assert len(failed) == 1 and isinstance(failed[0], PeerSilent)
    finally:
        child.kill()
        child.wait()


def test_silence_while_nothing_waits_for_the_peer_is_not_held_against_it() -> None:
    live, _, failed = _liveness()
    live.heard = 10.0
    live.check_alive(100.0, 1.0)  # our receivers are busy with its messages: not its silence
    assert failed == []
    live.sending = (10.0, 0.0)
    live.check_alive(100.0, 1.0)
    assert "while a send to it waited" in str(failed[0])


def test_a_closing_or_failed_link_is_not_judged_and_a_stalled_process_restarts_the_count() -> None:
    live, state, failed = _liveness()
    live.heard, live.data_wait = 10.0, (10.0, 0.0)
    state.closing = True
    live.check_alive(100.0, 1.0)
    assert failed == []
    state.closing = False
    live.restart(99.5)
    live.check_alive(100.0, 1.0)
    assert failed == []


def test_a_send_past_its_own_bound_is_reported_as_an_overdue_send() -> None:
    live, _, _ = _liveness(send_timeout=0.0)
    assert live.overdue_send() is None  # no send waiting
    live.sending = (0.0, 0.0)
    overdue = live.overdue_send()
    assert isinstance(overdue, PeerSilent) and "heartbeats are off" in str(overdue)
    assert _liveness(send_timeout=None)[0].overdue_send() is None


def _cleanup(msg_id: int, size: int = 8) -> Message:
    return Message(Kind.CONTEXT_CLEANUP, msg_id, 0, 1, b"r" * size, deferrable=True)


def _never(msg: Message, exc: BaseException) -> None:
    raise AssertionError(f"{msg.describe()} failed: {exc}")


def test_riders_wait_in_order_and_ones_given_back_go_first() -> None:
    riders = Riders(LinkState(0, 1), lambda msg: None)
    assert not riders
    assert riders.defer(_cleanup(1), _never) and riders.defer(_cleanup(2), _never)
    taken = riders.take()
    assert [m.id for m, _ in taken] == [1, 2] and not riders
    assert riders.defer(_cleanup(3), _never)
    riders.give_back(taken)  # their frame was not sent: they stay before the later one
    assert [m.id for m, _ in riders.take()] == [1, 2, 3]


def test_a_rider_is_refused_once_the_link_is_closing_or_the_riders_are_full() -> None:
    state = LinkState(0, 1)
    riders = Riders(state, lambda msg: None)
    assert riders.defer(_cleanup(1, MAX_RIDER_BYTES // 2), _never)
    assert not riders.defer(_cleanup(2, MAX_RIDER_BYTES // 2), _never)  # over MAX_RIDER_BYTES together
    state.closing = True
    assert not riders.defer(_cleanup(3), _never)


class _OneConnection(WrappedStore):
    """A store that refuses to open a second connection (as a TCPStore client's ``clone`` would)."""

    def clone(self) -> WrappedStore:
        raise AssertionError("the link watcher opened a second connection to the store")


def test_the_link_watcher_reads_its_inbox_over_the_process_s_one_store_connection() -> None:
    """Each connection a TCPStore server accepts costs it a blocking reverse DNS lookup on its only
    thread (impl/_link_table.PairAsks), so the watcher shares the process's connection and never
    blocks in it: it reads asks in order, answers vouches, and ends on ``stop`` or when stopping."""
    store = _OneConnection(dist.HashStore())
    asks = PairAsks(store, 0)
    post_ask(store, 0, "3")
    post_ask(store, 0, "vouch abc")
    post_ask(store, 0, "2")
    stopping = threading.Event()
    assert asks.next_ask(stopping) == 3
    assert asks.next_ask(stopping) == 2
    assert store.get("vouched/abc/0") == b"static"
    asks.leave(graceful=True)
    assert asks.next_ask(stopping) is None
    stopping.set()
    assert PairAsks(store, 1).next_ask(stopping) is None
