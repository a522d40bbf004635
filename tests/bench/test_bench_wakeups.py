"""bench_wakeups.py's pure parts: reading /proc's counters, naming thread roles, per-operation deltas
between two snapshots, medians over launches, and the results page's tables (no RPC world here)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _results  # noqa: E402
import bench_wakeups as bw  # noqa: E402
import render_results  # noqa: E402

STATUS = """Name:\tpython
State:\tS (sleeping)
Tgid:\t4242
voluntary_ctxt_switches:\t1234
nonvoluntary_ctxt_switches:\t56
"""
# a thread name with a space and a closing bracket: fields are counted after the last ")"
STAT = "4243 (odd) name) S 4242 4242 1 0 -1 4194368 10 0 0 0 250 40 0 0 20 0 9 0 100 0 0"


def test_status_text_gives_the_voluntary_context_switches_not_the_involuntary_ones() -> None:
    assert bw.parse_wakeups(STATUS) == 1234


def test_status_text_without_the_counter_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="voluntary_ctxt_switches"):
        bw.parse_wakeups("Name:\tpython\n")


def test_stat_text_gives_user_plus_system_time_even_with_brackets_in_the_name() -> None:
    assert bw.parse_stat_cpu(STAT, 100) == pytest.approx(2.9)
    assert bw.parse_stat_cpu(STAT, 1000) == pytest.approx(0.29)


def test_schedstat_text_gives_its_nanoseconds_on_a_cpu_in_seconds() -> None:
    assert bw.parse_schedstat_cpu("1500000000 2000 30\n") == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("MainThread", "main"),
        ("twinrpc-recv-1", "receiver"),
        ("twinrpc-pool-0-3", "pool"),
        ("twinrpc-timer-0", "timer"),
        ("twinrpc-send-1", "sender"),
        ("gloo_tcp_loop", "gloo loop"),
        ("TP_SHM_reactor", "TP_SHM_reactor"),
        ("TP_CMA_loop", "TP_CMA_loop"),
        ("pt_thread_pool", "pt_thread_pool"),
        ("PTThreadPool", "PTThreadPool"),
        ("python", "python"),
        ("worker-12", "worker"),
        ("Thread-7 (serve)", "Thread"),
    ],
)
def test_thread_names_group_into_roles(name: str, expected: str) -> None:
    assert bw.role(name) == expected


def _snap(threads: dict[int, tuple[str, float, int]], cpu: float, woken: int) -> dict[str, Any]:
    return {"threads": threads, "process": (cpu, woken)}


def test_per_op_deltas_count_a_new_thread_from_zero_and_an_exited_one_from_the_process_totals() -> None:
    before = _snap(
        {1: ("MainThread", 1.0, 100), 2: ("twinrpc-recv-1", 0.5, 50), 3: ("twinrpc-pool-0-0", 0.2, 10)},
        cpu=2.0,
        woken=170,
    )
    # thread 3 exited (between the snapshots it woke 10 more times and used 0.1 s); thread 4 is new
    after = _snap(
        {1: ("MainThread", 1.4, 120), 2: ("twinrpc-recv-1", 0.7, 90), 4: ("twinrpc-pool-0-1", 0.1, 20)},
        cpu=2.8,
        woken=260,
    )
    got = bw.per_op(before, after, ops=10)
    assert got["wakeups"] == pytest.approx(9.0)  # (260 - 170) / 10: the process's counters
    assert got["cpu_us"] == pytest.approx(80_000)
    assert got["roles"]["main"] == pytest.approx({"cpu_us": 40_000, "wakeups": 2.0})
    assert got["roles"]["receiver"] == pytest.approx({"cpu_us": 20_000, "wakeups": 4.0})
    assert got["roles"]["pool"] == pytest.approx({"cpu_us": 10_000, "wakeups": 2.0})  # the new one's
    assert got["roles"][bw.EXITED] == pytest.approx({"cpu_us": 10_000, "wakeups": 1.0})
    assert (got["threads_started"], got["threads_exited"]) == (1, 1)


def test_per_op_gives_exited_threads_their_wake_ups_and_no_role_when_nothing_is_left() -> None:
    before = _snap({1: ("MainThread", 1.0, 100), 3: ("twinrpc-timer-0", 0.0, 5)}, cpu=1.0, woken=105)
    after = _snap({1: ("MainThread", 1.0, 110)}, cpu=1.0, woken=125)
    assert bw.per_op(before, after, ops=5)["roles"][bw.EXITED]["wakeups"] == pytest.approx(2.0)
    quiet = _snap({1: ("MainThread", 1.2, 110)}, cpu=1.2, woken=110)
    assert bw.EXITED not in bw.per_op(before, quiet, ops=5)["roles"]


def test_a_snapshot_of_this_process_names_a_thread_and_counts_its_wake_ups() -> None:
    rounds = 20
    steps = [threading.Event() for _ in range(rounds)]

    def blocking() -> None:
        for e in steps:  # each is set only after the thread blocked on it: a voluntary switch each
            e.wait()

    t = threading.Thread(target=blocking, name="twinrpc-recv-9")
    before = bw.snapshot()
    t.start()
    for e in steps:
        time.sleep(0.002)
        e.set()
    t.join(10)
    # the thread exited before this snapshot: the process's totals still hold its wake-ups
    ended = bw.snapshot()
    assert t.native_id not in ended["threads"]
    assert ended["process"][1] - before["process"][1] >= rounds // 2
    assert bw.per_op(before, ended, ops=1)["roles"][bw.EXITED]["wakeups"] >= rounds // 2

    steps = [threading.Event() for _ in range(rounds)]
    t = threading.Thread(target=blocking, name="twinrpc-recv-9")
    t.start()
    before = bw.snapshot()
    for e in steps[:-1]:
        time.sleep(0.002)
        e.set()
    time.sleep(0.002)
    after = bw.snapshot()
    steps[-1].set()
    t.join(10)
    name, _, woken = after["threads"][t.native_id]
    assert name == "twinrpc-recv-9"
    assert woken - before["threads"][t.native_id][2] >= rounds // 2
    assert bw.per_op(before, after, ops=1)["roles"]["receiver"]["wakeups"] >= rounds // 2


def _launch(
    wall: float,
    cpu: float,
    woken: float,
    roles: dict[str, tuple[float, float]],
    frames: bool,
    threads: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    worker = {
        "cpu_us": cpu,
        "wakeups": woken,
        "threads_started": threads[0],
        "threads_exited": threads[1],
        "roles": {r: {"cpu_us": c, "wakeups": w} for r, (c, w) in roles.items()},
    }
    if frames:
        worker |= {"frames": 2.0, "messages": 3.0}
    return {"wall_us": wall, "workers": {"worker0": worker, "worker1": dict(worker)}}


def test_launches_combine_into_medians_and_a_role_missing_from_one_counts_as_zero() -> None:
    got = bw.combine(
        [
            _launch(1000, 900, 9, {"main": (400, 3), "receiver": (300, 4)}, True),
            _launch(
                1200, 1100, 11, {"main": (500, 3), "receiver": (320, 5), bw.EXITED: (10, 1)}, True, (2, 3)
            ),
            _launch(1100, 1000, 10, {"main": (450, 2), "receiver": (310, 6)}, True, (1, 1)),
        ]
    )
    assert got["wall_us"] == 1100
    w = got["workers"]["worker0"]
    assert (w["cpu_us"], w["wakeups"], w["frames"], w["messages"]) == (1000, 10, 2.0, 3.0)
    assert (w["threads_started"], w["threads_exited"]) == (1, 1)
    assert w["roles"] == [  # most wake-ups first
        {"role": "receiver", "cpu_us": 310, "wakeups": 5},
        {"role": "main", "cpu_us": 450, "wakeups": 3},
        {"role": bw.EXITED, "cpu_us": 0.0, "wakeups": 0.0},
    ]


def test_figures_are_target_less_ratios_of_both_workers_wake_ups_and_cpu_per_repeat() -> None:
    per_loop = {
        "remote": {
            "twinrpc": [_launch(1, 1000, 8, {}, True), _launch(1, 1000, 10, {}, True)],
            "tensorpipe": [_launch(1, 2000, 8, {}, False), _launch(1, 1000, 8, {}, False)],
        }
    }
    found = {f["key"]: f for f in bw.figures(per_loop)}
    assert set(found) == {"remote wake-ups", "remote CPU time"}
    assert found["remote wake-ups"]["round_ratios"] == [1.0, 1.25]
    assert found["remote CPU time"]["round_ratios"] == [0.5, 1.0]
    assert found["remote wake-ups"]["values"] == {"twinrpc": 18.0, "tensorpipe": 16.0}
    assert all(f["target"] is None and f["met"] is None for f in found.values())
    assert bw.figures({"remote": {"twinrpc": per_loop["remote"]["twinrpc"]}}) == []


def test_the_results_page_shows_each_loop_system_and_worker_with_roles_frames_and_messages() -> None:
    per_loop = {
        "remote": {
            "twinrpc": [_launch(1350, 950, 9.9, {"receiver": (300, 4.0), "main": (400, 3.0)}, True, (1, 0))],
            "tensorpipe": [_launch(1140, 1300, 9.8, {"TP_SHM_reactor": (790, 0.04)}, False)],
        },
        "iteration": {
            "twinrpc": [_launch(6400, 7900, 14.2, {"gloo loop": (217, 5.0)}, True)],
            "tensorpipe": [
                _launch(5600, 4800, 20.9, {"pt_thread_pool": (411, 6.2), "idle": (0.2, 0.0)}, False)
            ],
        },
    }
    loops = bw.summarize(per_loop, [("remote", 2000, 200), ("iteration", 300, 200)], repeat=1)
    doc = _results.document(
        "bench_wakeups",
        "wake-ups title",
        "python benchmarks/bench_wakeups.py",
        bw.figures(per_loop),
        rounds=1,
        extra={"wakeups": {"loops": loops}},
        machine_info={"cpus": 2, "cpu": "a CPU", "system": "Linux", "python": "3.11", "torch": "2.x"},
    )
    page = render_results.render([doc])
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    assert (
        "| twinrpc | worker0 | 1,350 | 950 | 9.90 | receiver 4.00 (300 us), main 3.00 (400 us) | 1 / 0 "
        "| 2.00 | 3.00 |" in rows
    )
    assert (
        "| TensorPipe | worker1 | 1,140 | 1,300 | 9.80 | TP_SHM_reactor 0.04 (790 us) | 0 / 0 | - | - |"
        in rows
    )
    # a role that neither woke nor used a microsecond is left out
    assert (
        "| TensorPipe | worker0 | 5,600 | 4,800 | 20.90 | pt_thread_pool 6.20 (411 us) | 0 / 0 | - | - |"
        in rows
    )
    # the loops in the order they ran, each with its own table
    assert page.index("**remote**") < page.index("**iteration**")
    assert "2,000 operations after 200 warm-up ones in each launch" in page
    assert "| one host | remote() + to_here() of a tiny UDF: wake-ups per operation, both workers |" in page
