"""The one text a departed peer's calls fail with (src/twinrpc/_departure.py), per way of leaving."""

from __future__ import annotations

import pytest

from twinrpc._departure import Departure, departure_error
from twinrpc._worker_info import WorkerInfo

PEER = WorkerInfo("worker1", 1)


@pytest.mark.parametrize(
    ("departure", "verdict"),
    [
        (Departure.LEFT, "It has shut down RPC"),
        (Departure.SHUT_DOWN, "It has shut down RPC"),
        (Departure.CRASHED, "Its process has probably died"),
        (Departure.SILENT, "Its process has probably died"),
        (Departure.REFUSED, "Its link failed this job's authentication"),
    ],
)
def test_the_error_names_the_peer_and_says_how_it_left(departure: Departure, verdict: str) -> None:
    err = departure_error(PEER, "worker0", departure, "the transport's words")
    assert "'worker1' (rank 1) is unavailable" in str(err) and verdict in str(err)
    assert err.departure is departure


def test_a_link_refused_by_authentication_is_not_called_a_death() -> None:
    err = departure_error(PEER, "worker0", Departure.REFUSED, "authentication failed on the link")
    assert "probably died" not in str(err) and not Departure.REFUSED.shut_down
