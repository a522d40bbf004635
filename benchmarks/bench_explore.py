"""Exploration throughput: runs per second of ``explore --jobs J`` for J = 1, 2, 4, ... up to the cores.

What ``python -m twinrpc.simulator explore --jobs J`` does for ``--runs`` runs of the race tutorial's
program with its fix on (``docs/examples/ps_race.py --fixed``: 3 workers, every run passes, so every
run is made), timed from the start of the search to its end: the worker processes' start-up (each
imports the simulator) is included, the calibration run that precedes the search is not. The figure
for each J > 1 is the scaling: runs per second with J jobs over J times the runs per second with one
job, per round (a round measures one job and then each J, back to back), the median over the
rounds; the target is 0.8 (linear scaling up to the cores, less a fifth). With more jobs than
cores, or on a machine other processes load, it cannot be met: the JSON records the load average.

    python benchmarks/bench_explore.py [--runs 200] [--rounds 2] [--max-jobs N] [--json FILE]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import _cli
import _results  # benchmarks/_results.py (the script's directory is on sys.path)
from twinrpc.simulator._cli._explore import ProgramRunner
from twinrpc.simulator._exploration._parallel import ExplorationPlan, Progress, default_jobs, explore_blocks
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
    """Progress that notes when each run ended (as the parent hears of it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.times: list[float] = []

    def add(self, runs: int = 1, failures: int = 0) -> None:
        super().add(runs, failures)
        self.times += [time.perf_counter()] * runs


def measure(plan: ExplorationPlan, horizon: float | None, jobs: int) -> tuple[float, int, float]:
    """(wall seconds, runs made, seconds to the first run's end) of one search of the whole
    exploration with ``jobs`` jobs."""
    clock = _Clock(jobs=jobs)
    start = time.perf_counter()
    outcome = explore_blocks(plan, plan.blocks(), horizon, jobs=jobs, progress=clock)
    wall = time.perf_counter() - start
    if outcome.found is not None:
        raise SystemExit(f"bench_explore: run {outcome.found.found_at} failed: the fixed program must pass")
    return wall, outcome.runs, clock.times[0] - start


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--runs", type=int, default=200, help="runs per exploration (blocks of 20)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of one job, then each J")
    parser.add_argument("--max-jobs", type=int, default=default_jobs(), help="the largest J")
    parser.add_argument("--json", default=None, help="write the figures here (benchmarks/results/)")
    args = parser.parse_args(argv)
    machine = _results.machine()
    options = LaunchOptions(program=str(PROGRAM), args=("--fixed",), nproc_per_node=3)
    plan = ExplorationPlan(ProgramRunner(options, None), 3, seed=0, runs=args.runs)
    calibration = plan.calibration()
    if calibration.run_baseline():
        raise SystemExit("bench_explore: the calibration run failed: the fixed program must pass")
    plan.runner.close()
    counts = job_counts(args.max_jobs)
    rates: dict[int, list[float]] = {j: [] for j in counts}
    walls: dict[int, list[float]] = {j: [] for j in counts}
    firsts: dict[int, list[float]] = {j: [] for j in counts}
    ratios: dict[int, list[float]] = {j: [] for j in counts[1:]}
    for round_ in range(args.rounds):
        for jobs in counts:
            wall, runs, first = measure(plan, calibration.horizon, jobs)
            rates[jobs].append(runs / wall)
            walls[jobs].append(wall)
            firsts[jobs].append(first)
            print(
                f"round {round_ + 1}: --jobs {jobs}: {runs} runs in {wall:.1f} s, {runs / wall:.1f} runs/s; "
                f"the first run ended after {first:.1f} s",
                flush=True,
            )
        for jobs in counts[1:]:
            ratios[jobs].append(rates[jobs][-1] / (jobs * rates[1][-1]))
    figures = [
        _results.figure(
            f"jobs {jobs}",
            f"exploration throughput with {jobs} jobs",
            "runs/s",
            True,
            {"twinrpc": statistics.median(rates[jobs]), "linear": jobs * statistics.median(rates[1])},
            ratios[jobs],
            (">=", 0.8),
        )
        for jobs in counts[1:]
    ]
    for f in figures:
        print(_results.describe(f))
    if args.json:
        command = f"python benchmarks/bench_explore.py --runs {args.runs} --rounds {args.rounds} --max-jobs {args.max_jobs}"
        extra = {
            "explore": [
                {
                    "jobs": j,
                    "runs_per_s": statistics.median(rates[j]),
                    "wall_s": statistics.median(walls[j]),
                    "first_run_s": statistics.median(firsts[j]),
                }
                for j in counts
            ]
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
