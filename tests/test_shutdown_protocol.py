"""Which departed worker a failed graceful shutdown names (SHUT-2, twinrpc._shutdown).

Several workers may have departed by the time a shutdown's all-gather fails, and the news of them
may arrive in either order (on a loaded host a worker that left *because* another died can be heard
of first: found by the differential twin test). The shutdown names a worker that died (crashed or
went silent) before one that shut down, and otherwise the first it heard of.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from twinrpc._departure import Departure, departure_error
from twinrpc._errors import WorkerUnavailableError
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
