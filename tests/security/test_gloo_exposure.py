"""What a gloo worker's listening ports are exposed to (impl/_exposure.py): idle connections past the
soft open-file limit it started with, and the warning a keyless worker reachable from other hosts logs."""

from __future__ import annotations

import logging
import sys

import _idle_connections_program as program
import pytest
from _launch import first_worker_json
from twinrpc.impl import _exposure


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_idle_connections_past_the_starting_soft_limit_do_not_kill_a_worker() -> None:
    out = first_worker_json(
        "_idle_connections_program.py",
        tracebacks=False,
        GLOO_SOCKET_IFNAME="lo",  # gloo listens on loopback only: nothing outside this host can connect
    )
    assert out["worker1's soft limit"] == program.HIGH  # raised by init_rpc
    assert out["listening ports"] >= 1
    # more descriptors than the limit it started with: gloo would have aborted the process at LOW
    assert out["worker1's open files while attacked"] > program.LOW, out
    assert out["answer while attacked"] == 1024 and out["answer after"] == 27


@pytest.fixture
def fresh_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(_exposure._Warned, "keyless", False)
    caplog.set_level(logging.WARNING, logger="twinrpc.impl")
    return caplog


def test_a_keyless_worker_on_a_non_loopback_address_warns_once(
    fresh_warning: pytest.LogCaptureFixture,
) -> None:
    assert _exposure.warn_if_keyless_and_reachable("10.1.2.3", keyed=False)
    assert not _exposure.warn_if_keyless_and_reachable("10.1.2.3", keyed=False)  # once per process
    [record] = fresh_warning.records
    text = record.getMessage()
    assert "no authentication key" in text and "10.1.2.3" in text and "anyone who can reach" in text
    assert "run code" in text and "TWINRPC_AUTH_KEY_FILE" in text


@pytest.mark.parametrize(
    ("host", "keyed"),
    [("127.0.0.1", False), ("localhost", False), ("::1", False), (None, False), ("10.1.2.3", True)],
)
def test_no_warning_on_loopback_for_a_file_store_or_with_a_key(
    fresh_warning: pytest.LogCaptureFixture, host: str | None, keyed: bool
) -> None:
    assert not _exposure.warn_if_keyless_and_reachable(host, keyed)
    assert fresh_warning.records == []
