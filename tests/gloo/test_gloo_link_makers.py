"""Making links under load (impl/_link_table.py, impl/_peer_process.py), in one process over a
HashStore, with links faked (no gloo): a burst of asks costs a few maker threads, not one per peer,
and never waits in a cycle; a peer slow to answer whose process runs on this host is waited for,
while a stopped one is given up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from twinrpc.impl import _link_table
from twinrpc.impl._link_table import LinkTable, PairAsks
from twinrpc.impl._liveness import PeerSilent
from twinrpc.impl._peer_process import PeerProcess, Verdict
from twinrpc.impl._same_host import host_identity
from twinrpc.impl._stores import WrappedStore

#: bound on every wait (a wait cycle shows as a TimeoutError, never as a hang)
BOUND = 60.0


class _Job:
    """``size`` link tables over one store; a fake link is made once both sides are making it (as a
    pair's gloo group is), and every maker thread seen while making one is recorded."""

    def __init__(self, size: int) -> None:
        self.store = dist.HashStore()
        self.makers_seen: dict[int, int] = {}
        self._lock = threading.Lock()
        self.failures: list[tuple[int, int, BaseException]] = []
        self.tables = [self._table(rank) for rank in range(size)]
        for table in self.tables:
            table.watch()

    def _table(self, rank: int) -> LinkTable:
        return LinkTable(
            rank,
            PairAsks(self.store, rank),
            lambda peer: self._make(rank, peer),
            lambda link: None,
            lambda peer, exc: self.failures.append((rank, peer, exc)),
            lambda msg, exc: None,
            BOUND,
        )

    def _make(self, me: int, peer: int) -> Any:
        prefix = f"twinrpc-connect-{me}-", f"twinrpc-answer-{me}-"
        makers = sum(1 for t in threading.enumerate() if t.name.startswith(prefix))
        with self._lock:
            self.makers_seen[me] = max(self.makers_seen.get(me, 0), makers)
        self.store.set(f"made/{me}-{peer}", "1")
        deadline = time.monotonic() + BOUND
        while not self.store.check([f"made/{peer}-{me}"]):  # the peer's maker is on it too
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {peer} never made its side of the link to rank {me}")
            time.sleep(0.001)
        return SimpleNamespace(peer=peer, sender=SimpleNamespace(enqueue=None, flush=lambda: None))

    def stop(self) -> None:
        for table in self.tables:
            table.stop(graceful=True, timeout=BOUND)


@pytest.mark.parametrize("makers", [1, 2])
def test_every_worker_asking_every_other_at_once_makes_every_link_with_few_maker_threads(
    monkeypatch: pytest.MonkeyPatch, makers: int
) -> None:
    """Every pair is asked by both sides at once or by one side while the other is busy asking
    others: with one maker thread a kind, a maker waiting for an answer must never hold up the
    answer another worker waits for (a cycle would leave some link_to waiting out its bound)."""
    monkeypatch.setattr(_link_table, "MAKERS", makers)
    size = 8
    job = _Job(size)
    try:
        for rank, table in enumerate(job.tables):
            for peer in range(size):
                if peer != rank:
                    table.reach(peer)
        for rank, table in enumerate(job.tables):
            for peer in range(size):
                if peer != rank:
                    assert table.link_to(peer, BOUND).peer == peer
    finally:
        job.stop()
    assert job.failures == []
    assert max(job.makers_seen.values()) <= 2 * makers, job.makers_seen


def test_a_ring_of_workers_each_asking_the_next_connects_with_one_maker_thread_a_kind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_link_table, "MAKERS", 1)
    size = 5
    job = _Job(size)
    try:
        for rank, table in enumerate(job.tables):
            table.reach((rank + 1) % size)
        for rank, table in enumerate(job.tables):
            assert table.link_to((rank + 1) % size, BOUND).peer == (rank + 1) % size
    finally:
        job.stop()
    assert job.failures == []


class _AnswersLate(WrappedStore):
    """A store where the peer's ``here`` entry appears only after ``late`` looks for it (a peer
    starved of CPU), whatever the clock says."""

    def __init__(self, inner: Any, key: str, late: int) -> None:
        super().__init__(inner)
        self._key, self._late = key, late

    def check(self, keys: list[str]) -> bool:
        if self._key in keys:
            self._late -= 1
            if self._late == 0:
                self._inner.set(self._key, "1")
        return bool(self._inner.check(keys))


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _wait_for_state(process: PeerProcess, verdict: Verdict) -> None:
    deadline = time.monotonic() + BOUND
    while process.verdict() is not verdict:
        assert time.monotonic() < deadline, f"process {process.pid} never became {verdict}"
        time.sleep(0.01)


def _announce(store: Any, rank: int, process: PeerProcess) -> None:
    store.set(f"proc/{rank}", host_identity() + b"\n" + process.encode().encode())


def test_a_peer_slow_to_answer_whose_process_runs_here_is_waited_for_past_the_bound() -> None:
    """The bound passes at the first look (0 s), yet the connection waits on: the peer's process
    runs on this host, so it is starved, not dead (the 64-worker job's failure)."""
    child = _sleeper()
    try:
        process = PeerProcess.of(child.pid)
        assert process is not None
        store = _AnswersLate(dist.HashStore(), "pair/0-1/here/1", late=20)
        _announce(store, 1, process)
        PairAsks(store, 0).wait_for(1, 0.0, threading.Event())  # returns: no PeerSilent
        os.kill(child.pid, signal.SIGSTOP)  # a stopped peer: given up at the bound
        _wait_for_state(process, Verdict.STOPPED)
        with pytest.raises(PeerSilent, match="did not answer"):
            PairAsks(dist.HashStore(), 0).wait_for(1, 0.0, threading.Event())
        stopped_store = dist.HashStore()
        _announce(stopped_store, 1, process)
        with pytest.raises(PeerSilent, match="did not answer"):
            PairAsks(stopped_store, 0).wait_for(1, 0.0, threading.Event())
    finally:
        child.kill()
        child.wait()


def test_a_process_is_alive_until_stopped_or_gone_and_a_reused_pid_is_not_it() -> None:
    child = _sleeper()
    process = PeerProcess.of(child.pid)
    assert process is not None and process.verdict() is Verdict.ALIVE
    assert PeerProcess.decode(process.encode()) == process
    assert PeerProcess.decode("not a process") is None
    assert PeerProcess(child.pid, process.start + 1).verdict() is Verdict.STOPPED  # another process
    os.kill(child.pid, signal.SIGSTOP)
    _wait_for_state(process, Verdict.STOPPED)
    os.kill(child.pid, signal.SIGCONT)
    _wait_for_state(process, Verdict.ALIVE)
    child.kill()
    child.wait()
    assert process.verdict() is Verdict.STOPPED
