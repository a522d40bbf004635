"""Exploration throughput: runs per second of ``explore --jobs J`` for J = 1, 2, 4, ... up to the cores.

What ``python -m twinrpc.simulator explore --jobs J`` does for ``--runs`` runs of the race tutorial's
program with its fix on (``docs/examples/ps_race.py --fixed``: 3 workers, every run passes, so every
run is made). Two things are measured apart, because they scale differently:

- the *search*: runs per second while every job is searching, from the moment the last job to start
  ended its first run to the moment the first job to run out of blocks ended its last one (so neither
  the start-up nor the tail, where fewer jobs than J are left, is in it). The figure for each J > 1 is
  the scaling: that rate with J jobs over J times the rate with one job, per round (a round measures
  one job and then each J, back to back), the median over the rounds; the target is 0.8 (linear
  scaling up to the cores, less a fifth).
- the *start-up*: the server the jobs fork from, started once per exploration (``explore`` starts it
  before its calibration run; it imports torch, the simulator and hypothesis once, so that the jobs
  import nothing), and each exploration's time until every job has ended its first run.

With more jobs than cores, or on a machine other processes load, the scaling cannot be met: the
JSON records the load average.

    python benchmarks/bench_explore.py [--runs 400] [--rounds 3] [--max-jobs N] [--json FILE]
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _cli
import _results  # benchmarks/_results.py (the script's directory is on sys.path)
from twinrpc.simulator._cli._explore import ProgramRunner
from twinrpc.simulator._exploration._parallel import (
    ExplorationPlan,
    Progress,
    default_jobs,
    explore_blocks,
    prepare_jobs,
)
from twinrpc.simulator._launch._launch import LaunchOptions

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "docs" / "examples" / "ps_race.py"


def job_counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores``, and ``cores`` itself."""
    counts = [1]
    while counts[-1] * 2 <= cores:
        counts.append(counts[-1] * 2)
    if counts[-1] != cores:
        counts.append(cores)
    return counts


class _Clock(Progress):
    """Progress that notes when each run ended (as the parent hears of it), and whose job made it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ends: list[tuple[float, int]] = []

    def add(self, runs: int = 1, failures: int = 0, job: int = 0) -> None:
        super().add(runs, failures, job)
        self.ends += [(time.perf_counter(), job)] * runs


@dataclass(frozen=True)
class Search:
    """One exploration with J jobs, in seconds from its start."""

    jobs: int
    runs: int
    wall: float
    #: when every job had ended its first run
    all_searching: float
    #: runs per second while every job searched
    search_rate: float


def search_rate(ends: list[tuple[float, int]], jobs: int) -> tuple[float, float]:
    """(the time every job had ended its first run, runs per second from then until the first job to
    run out of work ended its last run), from ``ends``: (time, job) of each run, in order."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for t, job in ends:
        first.setdefault(job, t)
        last[job] = t
    if len(first) < jobs:
        raise SystemExit(f"bench_explore: only {len(first)} of {jobs} jobs ran: use more --runs")
    start, end = max(first.values()), min(last.values())
    runs = sum(1 for t, _ in ends if start < t <= end)
    if runs < 2 * jobs or end <= start:
        raise SystemExit(f"bench_explore: {runs} runs while all {jobs} jobs searched: use more --runs")
    return start, runs / (end - start)


def measure(plan: ExplorationPlan, horizon: float | None, jobs: int) -> Search:
    """One search of the whole exploration with ``jobs`` jobs."""
    clock = _Clock(jobs=jobs)
    start = time.perf_counter()
    outcome = explore_blocks(plan, plan.blocks(), horizon, jobs=jobs, progress=clock)
    wall = time.perf_counter() - start
    if outcome.found is not None:
        raise SystemExit(f"bench_explore: run {outcome.found.found_at} failed: the fixed program must pass")
    all_searching, rate = search_rate(clock.ends, jobs)
    return Search(jobs, outcome.runs, wall, all_searching - start, rate)


def start_server(plan: ExplorationPlan, jobs: int) -> float:
    """Seconds until the server the jobs fork from has imported what they need and forked a first
    process (about 0 when the jobs do not fork from a server)."""
    start = time.perf_counter()
    prepare_jobs(plan, jobs, wait=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--runs", type=int, default=400, help="runs per exploration (blocks of 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one job, then each J")
    parser.add_argument("--max-jobs", type=int, default=default_jobs(), help="the largest J")
    parser.add_argument("--json", default=None, help="write the figures here (benchmarks/results/)")
    args = parser.parse_args(argv)
    machine = _results.machine()
    options = LaunchOptions(program=str(PROGRAM), args=("--fixed",), nproc_per_node=3)
    plan = ExplorationPlan(ProgramRunner(options, None), 3, seed=0, runs=args.runs)
    counts = job_counts(args.max_jobs)
    server = start_server(plan, counts[-1])
    print(f"the server the jobs fork from: ready after {server:.1f} s", flush=True)
    calibration = plan.calibration()
    if calibration.run_baseline():
        raise SystemExit("bench_explore: the calibration run failed: the fixed program must pass")
    plan.runner.close()
    searches: dict[int, list[Search]] = {j: [] for j in counts}
    ratios: dict[int, list[float]] = {j: [] for j in counts[1:]}
    for round_ in range(args.rounds):
        for jobs in counts:
            s = measure(plan, calibration.horizon, jobs)
            searches[jobs].append(s)
            print(
                f"round {round_ + 1}: --jobs {jobs}: {s.runs} runs in {s.wall:.1f} s; every job searching "
                f"after {s.all_searching:.2f} s, then {s.search_rate:.1f} runs/s",
                flush=True,
            )
        for jobs in counts[1:]:
            ratios[jobs].append(searches[jobs][-1].search_rate / (jobs * searches[1][-1].search_rate))

    def median(jobs: int, what: str) -> float:
        return statistics.median(getattr(s, what) for s in searches[jobs])

    figures = [
        _results.figure(
            f"jobs {jobs}",
            f"search throughput with {jobs} jobs (every job searching)",
            "runs/s",
            True,
            {"twinrpc": median(jobs, "search_rate"), "linear": jobs * median(1, "search_rate")},
            ratios[jobs],
            (">=", 0.8),
        )
        for jobs in counts[1:]
    ]
    for f in figures:
        print(_results.describe(f))
    if args.json:
        command = (
            f"python benchmarks/bench_explore.py --runs {args.runs} --rounds {args.rounds} "
            f"--max-jobs {args.max_jobs}"
        )
        extra = {
            "explore_server_s": server,
            "explore": [
                {
                    "jobs": j,
                    "search_runs_per_s": median(j, "search_rate"),
                    "all_searching_s": median(j, "all_searching"),
                    "runs_per_s": statistics.median(s.runs / s.wall for s in searches[j]),
                    "wall_s": median(j, "wall"),
                }
                for j in counts
            ],
        }
        doc = _results.document(
            "bench_explore",
            "Exploration throughput against jobs",
            command,
            figures,
            rounds=args.rounds,
            extra=extra,
            machine_info=machine,
        )
        _results.write(args.json, doc)
    return 0


if __name__ == "__main__":  # the worker processes import this file again: nothing runs then
    sys.exit(main())
