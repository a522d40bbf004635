"""The launch helpers' free ports: outside the range the kernel hands to connections' client ends."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import _launch
import pytest
from _launch import _LOWEST_PORT, _ephemeral_range, free_port


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_listened_on() -> None:
    low, high = _ephemeral_range()
    assert low <= high
    ports = {free_port() for _ in range(20)}
    assert all(_LOWEST_PORT <= p < low for p in ports)
    assert len(ports) > 1  # picked at random, not one port for every caller
    with socket.socket() as s:
        s.bind(("", ports.pop()))
        s.listen()


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        other = free_port()
        picks = iter([taken, taken, other])
        monkeypatch.setattr(_launch, "_PORTS", SimpleNamespace(randrange=lambda a, b: next(picks)))
        assert free_port() == other
