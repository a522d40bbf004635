"""Which departed worker a failed graceful shutdown names (SHUT-2, twinrpc._shutdown).

Several workers may have departed by the time a shutdown's all-gather fails, and the news of them
may arrive in either order (on a loaded host a worker that left *because* another died can be heard
of first: found by the differential twin test). The shutdown names a worker that died (crashed or
went silent) before one that shut down, and otherwise the first it heard of; a follower that saw a
worker die tells the leader before it leaves, so the leader names the dead worker even when the
follower's leaving reaches it before its own news of the death.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from twinrpc._departure import Departure, departure_error
from twinrpc._errors import WorkerUnavailableError
from twinrpc._message import Kind
from twinrpc._serialize import loads
from twinrpc._shutdown import ShutdownProtocol
from twinrpc._worker_info import WorkerInfo

WORKERS = [WorkerInfo(f"worker{r}", r) for r in range(3)]


def _leader_protocol() -> tuple[ShutdownProtocol, list[Any]]:
    """The leader's protocol, with a world that only records what it is asked to send."""
    sent: list[Any] = []
    world = types.SimpleNamespace(send=sent.append)
    agent: Any = types.SimpleNamespace(info=WORKERS[0], leader=WORKERS[0], workers=WORKERS, world=world)
    return ShutdownProtocol(agent), sent


def _gather_error(news: list[tuple[int, Departure]]) -> str:
    protocol, sent = _leader_protocol()
    for peer, how in news:
        protocol.peer_failed(peer, departure_error(WORKERS[peer], WORKERS[0], how, "transport words"), False)
    with pytest.raises(WorkerUnavailableError) as info:
        protocol.all_gather(("shutdown",), None, 0.0)
    assert sent == []  # every follower departed: nobody to tell why the all-gather failed
    return str(info.value)


@pytest.mark.parametrize("died", [Departure.CRASHED, Departure.SILENT])
def test_a_worker_that_died_is_named_even_when_one_that_left_because_of_it_was_heard_of_first(
    died: Departure,
) -> None:
    message = _gather_error([(1, Departure.SHUT_DOWN), (2, died)])
    assert "'worker2' (rank 2) is unavailable" in message
    assert "Its process has probably died" in message


def test_of_workers_that_shut_down_the_first_heard_of_is_named() -> None:
    assert "'worker2'" in _gather_error([(2, Departure.SHUT_DOWN), (1, Departure.SHUT_DOWN)])
    assert "'worker1'" in _gather_error([(1, Departure.SHUT_DOWN), (2, Departure.SHUT_DOWN)])


def test_the_leader_tells_the_live_followers_which_worker_it_names() -> None:
    protocol, sent = _leader_protocol()
    protocol.peer_failed(1, departure_error(WORKERS[1], WORKERS[0], Departure.SHUT_DOWN), False)
    with pytest.raises(WorkerUnavailableError, match="'worker1'"):
        protocol.all_gather(("shutdown",), None, 0.0)
    assert [m.dst for m in sent] == [2]  # worker 2 is alive: it learns why (SHUT-2)


def _protocol_of(me: int) -> tuple[ShutdownProtocol, list[Any]]:
    """Worker ``me``'s protocol (worker0 leads), with a world that records what it sends."""
    sent: list[Any] = []
    world = types.SimpleNamespace(send=sent.append, call_later=lambda delay, fn: None)
    agent: Any = types.SimpleNamespace(
        info=WORKERS[me],
        leader=WORKERS[0],
        workers=WORKERS,
        world=world,
        unpickle_allow=None,
        worker_by_id=lambda rank: WORKERS[rank],
        departure_error=lambda rank, how, detail="": departure_error(WORKERS[rank], WORKERS[me], how, detail),
    )
    return ShutdownProtocol(agent), sent


def test_a_follower_that_saw_a_worker_die_tells_the_leader_before_it_leaves() -> None:
    follower, sent = _protocol_of(2)
    follower.peer_failed(1, departure_error(WORKERS[1], WORKERS[2], Departure.CRASHED, "eof"), False)
    with pytest.raises(WorkerUnavailableError, match="'worker1'"):
        follower.all_gather(("shutdown",), None, 0.0)
    (news,) = sent
    assert news.kind is Kind.GATHER and news.dst == 0
    (tag, died), _ = loads(news.payload, news.tensors)
    assert tag == ("shutdown",) and (died.rank, died.departure) == (1, "crashed")


def test_the_leader_names_the_dead_worker_when_the_follower_that_saw_it_leaves_first() -> None:
    follower, news = _protocol_of(2)
    follower.peer_failed(1, departure_error(WORKERS[1], WORKERS[2], Departure.CRASHED, "eof"), False)
    with pytest.raises(WorkerUnavailableError):
        follower.all_gather(("shutdown",), None, 0.0)
    leader, _ = _protocol_of(0)
    for msg in news:  # the follower's news, then its leaving (the same link, in order)
        leader.on_message(msg)
    leader.peer_failed(2, departure_error(WORKERS[2], WORKERS[0], Departure.SHUT_DOWN), False)
    with pytest.raises(WorkerUnavailableError) as info:
        leader.all_gather(("shutdown",), None, 0.0)
    message = str(info.value)
    assert "'worker1' (rank 1) is unavailable to WorkerInfo(id=0, name=worker0)" in message
    assert "seen dead by WorkerInfo(id=2, name=worker2)" in message
    assert "Its process has probably died" in message
