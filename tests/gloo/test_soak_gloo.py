"""A short soak of the gloo world: resident memory, threads and file descriptors stay flat after warm-up.

benchmarks/bench_soak.py runs the full soak (1,000,000 calls, 100,000 RRef cycles, 10,000 distributed
autograd contexts) and prints the curves; here the same program runs a short version (about 20 s on 2
cores) and its verdict must be "flat". What "flat" means, and why its tolerances are what they are, is
in the benchmark's docstring; the verdict itself is checked on made-up curves below, so that a growing
resource is seen to fail it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from _benchmarks import load_benchmark

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_soak.py"
#: the short soak: enough operations for each load to warm up and then run several times longer
SHORT = {"calls": 20_000, "rrefs": 2_000, "contexts": 500}
MiB = 1 << 20


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    return load_benchmark("bench_soak")  # its functions travel by reference: registered as a module


def _curve(soak: ModuleType, rows: list[tuple[int, int, int, int]]) -> object:
    """A load whose two processes both went through ``rows`` (rss, threads, fds, pool threads)."""
    curve = soak.Curve("calls")
    for i, row in enumerate(rows):
        curve.ops.append(i * 1000)
        curve.seconds.append(float(i))
        curve.procs[0].append(row)
        curve.procs[1].append((100 * MiB, 5, 10, 2))
    return curve


def _failed(soak: ModuleType, rows: list[tuple[int, int, int, int]]) -> list[str]:
    verdict = soak.verdict(_curve(soak, rows))
    return [what for what, d in verdict.items() if not d["ok"]]


def test_a_short_soak_on_gloo_stays_flat_after_warm_up(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = [f"--{load}={n}" for load, n in SHORT.items()]
    run = subprocess.run(
        [sys.executable, str(BENCH), *args, "--samples", "20", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(run.stdout)
    assert out.exists(), f"the soak did not finish:\n{run.stdout}\n{run.stderr}"
    result = json.loads(out.read_text())
    assert [c["load"] for c in result["curves"]] == ["calls", "rrefs", "contexts"]
    for curve in result["curves"]:
        assert curve["ops"][-1] == SHORT[curve["load"]]
        assert len(curve["ops"]) == 21 and all(len(p) == 21 for p in curve["procs"])
    failed = {
        load: [what for what, d in verdict.items() if not d["ok"]]
        for load, verdict in result["verdicts"].items()
    }
    assert result["ok"] and run.returncode == 0, (failed, run.stdout[-3000:], run.stderr[-3000:])


def test_memory_that_keeps_growing_after_warm_up_fails_the_verdict(soak: ModuleType) -> None:
    flat = [(100 * MiB + (i % 3) * MiB, 5, 10, 2) for i in range(20)]  # allocator noise of a few MiB
    assert _failed(soak, flat) == []
    leaking = [(100 * MiB + i * MiB, 5, 10, 2) for i in range(20)]  # 1 KiB per operation
    assert _failed(soak, leaking) == ["worker0 rss"]
    verdict = soak.verdict(_curve(soak, leaking))["worker0 rss"]
    assert verdict["bytes_per_op"] == pytest.approx(MiB / 1000)


def test_a_thread_or_descriptor_more_than_warm_up_had_fails_the_verdict(soak: ModuleType) -> None:
    warm = [(100 * MiB, 5, 10, 2)] * 4
    # the link's outbox and the doorbell watcher, started late
    assert _failed(soak, warm + [(100 * MiB, 7, 10, 2)] * 16) == []
    assert _failed(soak, warm + [(100 * MiB, 8, 10, 2)] * 16) == ["worker0 threads"]
    assert _failed(soak, warm + [(100 * MiB, 5, 11, 2)] * 16) == ["worker0 fds"]
    pool_growing = [(100 * MiB, 5, 10, 2 + i) for i in range(20)]
    assert _failed(soak, pool_growing) == ["worker0 pool"]  # past num_worker_threads + receivers


def test_only_the_doorbell_watchers_descriptors_may_open_after_warm_up(soak: ModuleType) -> None:
    base = {"/memfd:twinrpc-ring (deleted)": 2, "anon_inode:[eventfd]": 2, "socket": 3}
    watcher = {"anon_inode:[eventpoll]": 1, "anon_inode:[eventfd]": 1}

    def failed(later: dict[str, int]) -> list[str]:
        rows = [(100 * MiB, 5, sum(base.values()), 2)] * 4 + [(100 * MiB, 5, sum(later.values()), 2)] * 16
        curve = _curve(soak, rows)
        curve.fd_kinds = [[base] * 4 + [later] * 16, [{}] * 20]
        return [what for what, d in soak.verdict(curve).items() if not d["ok"]]

    assert failed({**base, "anon_inode:[eventpoll]": 1, "anon_inode:[eventfd]": 3}) == []
    assert failed({**base, "socket": 4}) == ["worker0 fds"]
    with_watcher = {k: base.get(k, 0) + watcher.get(k, 0) for k in base.keys() | watcher.keys()}
    assert failed({**with_watcher, "anon_inode:[eventfd]": 4}) == ["worker0 fds"]  # one eventfd too many
    verdict = soak.verdict(_curve(soak, [(100 * MiB, 5, 7, 2)] * 4 + [(100 * MiB, 5, 8, 2)] * 16))
    assert not verdict["worker0 fds"]["ok"]  # without kinds, the count is exact
