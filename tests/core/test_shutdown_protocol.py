"""Which departed worker a failed graceful shutdown names, and when it fails (SHUT-2, SHUT-7,
twinrpc._shutdown).

Several workers may have departed by the time a shutdown's all-gather fails, and the news of them
may arrive in either order (on a loaded host a worker that left *because* another died can be heard
of first: found by the differential twin test). The shutdown names a worker that died (crashed or
went silent) before one that shut down, and otherwise the first it heard of; a follower that saw a
worker die tells the leader before its contribution, so the leader names the dead worker even when
the follower's leaving reaches it before its own news of the death. The leader fails the all-gather
only once every live worker has contributed, or its timeout passed; a follower fails at once only
when the leader is gone. (That the leader keeps serving meanwhile is shown on the simulator:
tests/sim/test_failure_sim.py.)
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest

from twinrpc._departure import Departure, departure_error
from twinrpc._errors import WorkerUnavailableError
from twinrpc._message import Kind, Message
from twinrpc._serialize import dumps, loads
from twinrpc._shutdown import ShutdownProtocol
from twinrpc._worker_info import WorkerInfo

WORKERS = [WorkerInfo(f"worker{r}", r) for r in range(3)]


def _times_out_at_once(delay: float, fn: Callable[[], Any]) -> Any:
    """A world timer whose every timeout has already passed."""
    fn()
    return types.SimpleNamespace(cancel=lambda: None)


def _protocol_of(me: int) -> tuple[ShutdownProtocol, list[Any]]:
    """Worker ``me``'s protocol (worker0 leads), with a world that records what it sends and whose
    timeouts pass at once (a wait with a timeout ends without blocking the test)."""
    sent: list[Any] = []
    # reach: the leader makes its links to every follower (links are made on first use)
    world = types.SimpleNamespace(send=sent.append, call_later=_times_out_at_once, reach=list)
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


def _gather_error(news: list[tuple[int, Departure]]) -> str:
    protocol, sent = _protocol_of(0)
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


def _contribution(src: int) -> Message:
    """Follower ``src``'s contribution to the barrier, as it reaches the leader."""
    payload, _ = dumps((("shutdown",), None))
    return Message(Kind.GATHER, 0, src, 0, payload)


def test_the_leader_fails_once_the_live_followers_arrived_and_tells_them_which_worker_it_names() -> None:
    leader, sent = _protocol_of(0)
    leader.peer_failed(1, departure_error(WORKERS[1], WORKERS[0], Departure.CRASHED, "eof"), False)
    leader.on_message(_contribution(2))  # worker 2 is alive and has reached shutdown
    with pytest.raises(WorkerUnavailableError, match="'worker1'") as info:
        leader.all_gather(("shutdown",), None, 0.0)
    assert "timed out" not in str(info.value)
    (verdict,) = sent
    assert verdict.kind is Kind.SCATTER and verdict.dst == 2  # worker 2 learns why (SHUT-2)


def test_the_leader_waits_for_a_live_follower_until_the_timeout_and_still_names_the_dead_worker() -> None:
    leader, sent = _protocol_of(0)
    leader.peer_failed(1, departure_error(WORKERS[1], WORKERS[0], Departure.CRASHED, "eof"), False)
    with pytest.raises(WorkerUnavailableError) as info:
        leader.all_gather(("shutdown",), None, 5.0)  # worker 2 never arrives: the timeout passes
    message = str(info.value)
    assert "'worker1' (rank 1) is unavailable" in message
    assert "Followers ['worker2'] timed out in _all_gather after 5.00 seconds" in message
    assert [(m.kind, m.dst) for m in sent] == [(Kind.SCATTER, 2)]  # told, for when it arrives


def test_a_follower_whose_leader_died_fails_at_once() -> None:
    follower, sent = _protocol_of(2)
    follower.peer_failed(0, departure_error(WORKERS[0], WORKERS[2], Departure.CRASHED, "eof"), False)
    with pytest.raises(WorkerUnavailableError, match="'worker0'") as info:
        follower.all_gather(("shutdown",), None, 5.0)
    assert "timed out" not in str(info.value)
    assert sent == []  # nobody to tell


def test_a_follower_that_saw_a_worker_die_tells_the_leader_and_waits_for_its_answer() -> None:
    follower, sent = _protocol_of(2)
    follower.peer_failed(1, departure_error(WORKERS[1], WORKERS[2], Departure.CRASHED, "eof"), False)
    with pytest.raises(WorkerUnavailableError) as info:
        follower.all_gather(("shutdown",), None, 5.0)  # the leader does not answer in time
    message = str(info.value)  # the wait ended with the timeout, but the dead worker is named
    assert "'worker1' (rank 1) is unavailable" in message and "timed out" in message
    news, contribution = sent  # the news first, then the contribution: the leader need not wait for 1
    assert (news.kind, news.dst, contribution.kind, contribution.dst) == (Kind.GATHER, 0, Kind.GATHER, 0)
    (_, died), _ = loads(news.payload, news.tensors)
    assert (died.rank, died.departure) == (1, "crashed")
    (tag, value), _ = loads(contribution.payload, contribution.tensors)
    assert (tag, value) == (("shutdown",), None)


def test_the_leader_names_the_dead_worker_when_the_follower_that_saw_it_leaves_first() -> None:
    follower, news = _protocol_of(2)
    follower.peer_failed(1, departure_error(WORKERS[1], WORKERS[2], Departure.CRASHED, "eof"), False)
    with pytest.raises(WorkerUnavailableError):
        follower.all_gather(("shutdown",), None, 5.0)  # timed out: it leaves
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
