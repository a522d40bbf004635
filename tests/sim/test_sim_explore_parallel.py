"""An exploration spread over processes (``explore --jobs``) and over machines (``explore --shard``,
``explore merge``): the same seed explores the same runs and reports the same first failure, however
the runs are divided.

The search itself is tested with a stand-in for a program (a :class:`CaseRunner` that judges a case
by its seed, in microseconds); the command line with the race tutorial's program
(docs/examples/ps_race.py), whose race ``explore`` finds at run 17 and shrinks to seed 0 and one
delayed message (docs/tutorials/parameter-server-race.md).
"""

from __future__ import annotations

import io
import json
import shlex
from pathlib import Path

import pytest
from twinrpc.simulator._cli._main import main
from twinrpc.simulator._exploration._case import Case, _Outcome, case_key
from twinrpc.simulator._exploration._parallel import (
    BLOCK_RUNS,
    ExplorationPlan,
    Progress,
    block_seed,
    explore_blocks,
)

ROOT = Path(__file__).resolve().parents[2]
PS_RACE = ROOT / "docs" / "examples" / "ps_race.py"
RACE_FOUND = "twinrpc.simulator.explore: run 17 failed; shrunk in 28 more runs to seed 0 and 1 fault"


class UnluckySeeds:
    """A program that fails under every seed ``s`` with ``s % modulus == 7`` (picklable: a job runs it)."""

    def __init__(self, modulus: int) -> None:
        self.modulus = modulus
        self.environment: dict[str, str | None] = {}
        self.seen: list[str] = []

    def run(self, case: Case) -> _Outcome:
        self.seen.append(case_key(case))
        if case.seed % self.modulus == 7:
            return _Outcome(None, ValueError(f"unlucky seed {case.seed}"), rank=1, time=0.0005)
        return _Outcome(None, duration=0.001)

    def close(self) -> None:
        pass


HORIZON = 0.001  # what a calibration run of the stand-in would measure


def test_a_sharded_exploration_runs_the_same_cases_as_the_whole() -> None:
    whole = ExplorationPlan(UnluckySeeds(modulus=2**40), 2, seed=5, runs=121)
    outcome = explore_blocks(whole, whole.blocks(), HORIZON)
    assert outcome.found is None and outcome.runs == 120  # run 1, the calibration, is not a block's
    assert len(whole.blocks()) == 7 and block_seed(5, 0) == 5 and block_seed(5, 1) != block_seed(6, 1)
    parts: list[str] = []
    runs = 0
    for index in range(3):
        shard = ExplorationPlan(UnluckySeeds(modulus=2**40), 2, seed=5, runs=121, shrink=False)
        runs += explore_blocks(shard, [b for b in shard.blocks() if b % 3 == index], HORIZON).runs
        assert isinstance(shard.runner, UnluckySeeds)
        parts += shard.runner.seen
    assert runs == 120
    assert isinstance(whole.runner, UnluckySeeds)
    assert sorted(parts) == sorted(whole.runner.seen) and len(set(parts)) > 100
    other = ExplorationPlan(UnluckySeeds(modulus=2**40), 2, seed=6, runs=121)
    explore_blocks(other, other.blocks(), HORIZON)
    assert isinstance(other.runner, UnluckySeeds)
    assert set(other.runner.seen) != set(whole.runner.seen)  # another seed, other runs


def _first_failure(jobs: int, blocks: list[int] | None = None) -> tuple[int, str, str, int] | None:
    plan = ExplorationPlan(UnluckySeeds(modulus=80), 2, seed=0, runs=400, shrink=blocks is None)
    outcome = explore_blocks(plan, plan.blocks() if blocks is None else blocks, HORIZON, jobs=jobs)
    assert outcome.runs < 400  # it stopped at the failure
    if outcome.found is None:
        return None
    found = outcome.found
    return found.found_at, case_key(found.first[0]), case_key(found.best[0]), found.calls


def test_two_jobs_stop_at_the_failure_one_job_finds_and_shrink_it_the_same_way() -> None:
    alone = _first_failure(jobs=1)
    assert alone is not None and alone[0] > BLOCK_RUNS  # in block 1: job 1 finds it while job 0 runs block 0
    assert alone[2] != alone[1]  # shrunk (seed 1447 to a smaller unlucky seed)
    assert _first_failure(jobs=2) == alone


def test_shards_find_the_failure_the_whole_exploration_finds_first() -> None:
    alone = _first_failure(jobs=1)
    assert alone is not None
    found = [_first_failure(jobs=1, blocks=[b for b in range(20) if b % 4 == i]) for i in range(4)]
    first = min(f for f in found if f is not None)
    assert first[:2] == alone[:2]  # the same run, the same case (shards do not shrink)


def test_progress_is_shown_on_a_terminal_only() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    shown, hidden = Terminal(), io.StringIO()
    for stream in (shown, hidden):
        progress = Progress(stream, jobs=2)
        progress.add(3)
        progress.add(0, failures=1)
        progress.close()
    assert "explore: 3 runs in 2 jobs," in shown.getvalue() and "runs/s, 1 failure" in shown.getvalue()
    assert hidden.getvalue() == ""


def _explore(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = main(["explore", "--nproc-per-node", "3", "--runs", "40", *args])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def _line(text: str, marker: str) -> str:
    return next(line.split(marker, 1)[1].strip() for line in text.splitlines() if marker in line)


def test_two_jobs_find_and_shrink_the_tutorials_race_and_the_replay_command_reproduces_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = _explore(capsys, "--jobs", "2", "--out", str(tmp_path / "found"), str(PS_RACE))
    assert status == 1 and RACE_FOUND in out, out
    command = _line(out, "replay:")
    assert command.startswith("python -m twinrpc.simulator run --nproc-per-node 3 --seed 0 --faults ")
    assert main(shlex.split(command)[3:]) == 1
    assert "modified by an inplace operation" in capsys.readouterr().err


def test_two_shards_merged_find_and_shrink_the_tutorials_race(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = tmp_path / "shards"
    statuses = [
        _explore(capsys, "--jobs", "1", "--shard", f"{i}/2", "--out", str(shards), str(PS_RACE))[0]
        for i in (0, 1)
    ]
    assert statuses[0] == 1  # block 0 (runs 1-20) is shard 0's, and holds run 17
    results = json.loads((shards / "shard-0-of-2.json").read_text())
    assert results["runs_done"] == 17 and [f["run"] for f in results["failures"]] == [17]
    # the shard's own replay command (of the run as found, not shrunk) reproduces it
    assert main(shlex.split(results["failures"][0]["replay"])[3:]) == 1
    assert "modified by an inplace operation" in capsys.readouterr().err
    assert json.loads((shards / "shard-1-of-2.json").read_text())["blocks"] == [1]
    status = main(["explore", "merge", "--out", str(tmp_path / "found"), str(shards)])
    out = capsys.readouterr().out
    assert status == 1 and RACE_FOUND in out and "the first at run 17 (shard 0/2)" in out, out
    assert (tmp_path / "found" / "test_ps_race_regression.py").is_file()


def test_merge_names_missing_shards_and_refuses_those_of_another_exploration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def shard(index: int, count: int, seed: int = 0) -> None:
        data = {
            "format": "twinrpc.simulator explore shard 1",
            "shard": index,
            "shards": count,
            "exploration": {"program": "p.py", "seed": seed},
            "horizon": 0.004,
            "blocks": [],
            "runs_done": 20,
            "note": "",
            "failures": [],
            "environment": {},
        }
        (tmp_path / f"shard-{index}-of-{count}.json").write_text(json.dumps(data))

    shard(0, 3)
    shard(2, 3)
    assert main(["explore", "merge", str(tmp_path)]) == 2  # no failure, but shard 1 is missing
    captured = capsys.readouterr()
    assert "shards 1 of 3 are missing" in captured.err and "40 runs of p.py passed" in captured.out
    shard(1, 3, seed=1)
    assert main(["explore", "merge", str(tmp_path)]) == 2
    assert "belongs to another exploration" in capsys.readouterr().err
    shard(1, 3)
    assert main(["explore", "merge", str(tmp_path)]) == 0
    assert main(["explore", "merge", str(tmp_path / "nowhere")]) == 2


def test_a_shard_is_i_of_n_with_i_below_n(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("2/2", "1", "a/b", "-1/2"):
        with pytest.raises(SystemExit) as exit_:
            main(["explore", "--shard", bad, str(PS_RACE)])
        assert exit_.value.code == 2
    assert "expected I/N with 0 <= I < N" in capsys.readouterr().err
