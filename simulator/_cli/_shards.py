"""``explore --shard I/N`` and ``explore merge DIR...``: one exploration spread over machines by a
scheduler the user already has (a Slurm array job, ``xargs -P``), and gathered again.

A shard runs the blocks ``b`` of the exploration with ``b % N == I`` (:mod:`.._exploration._parallel`),
stops at its first failure without shrinking it, and writes ``DIR/shard-I-of-N.json``: the
exploration's settings, the runs it made, and its failure with the command that replays it. ``merge``
reads the shards, reports the failure with the lowest run index, runs that block again (in order, so
it reaches the same failing run) and shrinks it: what ``explore`` with the same seed reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .._errors import LaunchError, SimulationError
from .._exploration._case import Case
from .._exploration._parallel import ExplorationPlan, Found, explore_blocks, prepare_jobs, run_block
from .._launch._launch import LaunchOptions, load_network
from ._explore import ProgramRunner, report, run_command_line

#: what a shard file says it is (``merge`` refuses anything else)
SHARD_FORMAT = "twinrpc.simulator explore shard 1"


def shard_path(out: Path, index: int, count: int) -> Path:
    return out / f"shard-{index}-of-{count}.json"


def _settings(plan: ExplorationPlan, args: argparse.Namespace) -> dict[str, Any]:
    """What every shard of one exploration must share (``merge`` checks it)."""
    runner = plan.runner
    assert isinstance(runner, ProgramRunner)
    options = runner.options
    return {
        "program": options.program,
        "args": list(options.args),
        "nproc_per_node": options.nproc_per_node,
        "network": args.network,
        "compute": options.compute,
        "max_time": options.max_time,
        "seed": plan.seed,
        "runs": plan.runs,
        "swarm": plan.swarm,
        "shrink_runs": plan.max_shrink_runs,
    }


def run_shard(plan: ExplorationPlan, args: argparse.Namespace, jobs: int) -> int:
    """Run shard ``args.shard`` of the exploration and write its results; status 1 when it found a
    failure, else 0."""
    index, count = args.shard
    out = Path(args.out)
    prepare_jobs(plan, jobs)
    calibration = plan.calibration()
    found: Found | None = None
    runs = 1 if index == 0 else 0  # the calibration run is shard 0's (every shard makes it)
    if calibration.run_baseline():
        found = Found.of_calibration(calibration) if index == 0 else None
        blocks: list[int] = []
        note = "run 1 (seed 0, no faults) failed: the exploration ends there, and shard 0 reports it"
    else:
        blocks = [b for b in plan.blocks() if b % count == index]
        outcome = explore_blocks(plan, blocks, calibration.horizon, jobs=jobs)
        runs += outcome.runs
        found = outcome.found
        note = ""
    plan.runner.close()
    environment = dict(sorted(plan.runner.environment.items()))
    out.mkdir(parents=True, exist_ok=True)
    failures = []
    if found is not None:
        case, outcome_ = found.first
        plan_file = out / f"shard-{index}-of-{count}-run-{found.found_at}-faults.json"
        plan_file.write_text(case.faults.to_json() + "\n", encoding="utf-8")
        runner = plan.runner
        assert isinstance(runner, ProgramRunner)
        shown = Case(case.seed, case.faults, None) if case.network == runner.network else case
        failures.append(
            {
                "run": found.found_at,
                "block": found.block,
                "case": case.to_dict(),
                "exception_type": found.signature.type_name,
                "pattern": found.signature.pattern,
                "error": outcome_.where(),
                "message": str(outcome_.error),
                "replay": run_command_line(runner.options, shown, str(plan_file), args.network, environment),
            }
        )
    result = {
        "format": SHARD_FORMAT,
        "shard": index,
        "shards": count,
        "exploration": _settings(plan, args),
        "horizon": calibration.horizon,
        "blocks": blocks,
        "runs_done": runs,
        "note": note,
        "failures": failures,
        "environment": environment,
    }
    path = shard_path(out, index, count)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    summary = f"explore --shard {index}/{count}: {runs} runs of {plan.runner.options.program}"
    if failures:
        print(f"{summary}; run {failures[0]['run']} failed: {failures[0]['error']}")
        print(f"  replay: {failures[0]['replay']}")
    else:
        print(f"{summary} passed")
    print(
        f"  results written to {path}; gather the shards with: python -m twinrpc.simulator explore merge {out}"
    )
    return 1 if failures else 0


def merge_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m twinrpc.simulator explore merge",
        description="Gather the shards of one exploration (explore --shard I/N --out DIR); shrink the "
        "failure with the lowest run index, write its plan and regression test, print its replay command.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="directories (or shard files) the shards wrote")
    p.add_argument(
        "--out", default="explore-out", metavar="DIR", help="where the plan and test go (explore-out)"
    )
    p.add_argument("--expect", choices=("pass", "fail"), default="pass", help="as for explore")
    return p


def read_shards(paths: list[str]) -> list[dict[str, Any]]:
    """Every shard file in ``paths`` (directories, or the files themselves)."""
    shards = []
    for name in paths:
        path = Path(name)
        files = sorted(path.glob("shard-*-of-*.json")) if path.is_dir() else [path]
        files = [f for f in files if "-run-" not in f.name]
        if not files:
            raise LaunchError(f"no shard results (shard-I-of-N.json) in {name!r}")
        for file in files:
            try:
                data = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise LaunchError(f"can't read shard results {str(file)!r}: {exc}") from exc
            if not isinstance(data, dict) or data.get("format") != SHARD_FORMAT:
                raise LaunchError(f"{str(file)!r} is not written by 'explore --shard'")
            shards.append(data)
    return shards


def merge_command(argv: list[str]) -> int:
    """``explore merge``'s entry point: status 1 when a failure was found, 0 when every run of every
    shard passed, 2 on bad input or when shards are missing (and none found a failure)."""
    args = merge_parser().parse_args(argv)
    err = sys.stderr
    try:
        shards = read_shards(args.dirs)
        settings = shards[0]["exploration"]
        count = shards[0]["shards"]
        by_index: dict[int, dict[str, Any]] = {}
        for shard in shards:
            if shard["exploration"] != settings or shard["shards"] != count:
                raise LaunchError(
                    f"shard {shard['shard']}/{shard['shards']} belongs to another exploration: "
                    f"{shard['exploration']} is not {settings} over {count} shards"
                )
            by_index[shard["shard"]] = shard
    except LaunchError as exc:
        print(f"python -m twinrpc.simulator explore merge: {exc}", file=err)
        return 2
    missing = sorted(set(range(count)) - set(by_index))
    runs = sum(s["runs_done"] for s in by_index.values())
    failures = sorted(
        ((f["run"], s["shard"], f) for s in by_index.values() for f in s["failures"]), key=lambda x: x[:2]
    )
    program = settings["program"]
    head = f"explore merge: {len(by_index)} of {count} shards, {runs} runs of {program}"
    if missing:
        print(
            f"explore merge: shards {', '.join(map(str, missing))} of {count} are missing: a failure at a "
            "lower run index in one of them would be missed",
            file=err,
        )
    if not failures:
        print(f"{head} passed (exploration seed {settings['seed']})")
        return 2 if missing else 0
    run, index, first = failures[0]
    print(f"{head}; {len(failures)} failed, the first at run {run} (shard {index}/{count}): shrinking it")
    options = LaunchOptions(
        program=program,
        args=tuple(settings["args"]),
        nproc_per_node=settings["nproc_per_node"],
        compute=settings["compute"],
        max_time=settings["max_time"],
    )
    try:
        network = load_network(settings["network"]) if settings["network"] else None
        plan = ExplorationPlan(
            ProgramRunner(options, network),
            settings["nproc_per_node"],
            seed=settings["seed"],
            runs=settings["runs"],
            swarm=settings["swarm"],
            max_shrink_runs=settings["shrink_runs"],
        )
        found = _again(plan, first, by_index[index]["horizon"])
    except (LaunchError, SimulationError, ValueError) as exc:
        print(f"python -m twinrpc.simulator explore merge: {exc}", file=err)
        return 2
    environment = {**by_index[index]["environment"], **plan.runner.environment}
    namespace = argparse.Namespace(out=args.out, expect=args.expect, network=settings["network"])
    return report(found, plan, namespace, environment)


def _again(plan: ExplorationPlan, failure: dict[str, Any], horizon: float | None) -> Found:
    """Run the failing run's block again, in order, and shrink the failure (it must be the same run)."""
    if failure["run"] == 1:  # the calibration run: already minimal
        calibration = plan.calibration()
        if not calibration.run_baseline():
            raise SimulationError(_differs(failure, "run 1 passes now"))
        plan.runner.close()
        return Found.of_calibration(calibration)
    try:
        result = run_block(plan, failure["block"], plan.runner, horizon)
    finally:
        plan.runner.close()
    found = result.found
    if found is None:
        raise SimulationError(_differs(failure, f"every run of block {failure['block']} passes now"))
    if found.found_at != failure["run"] or found.first[0] != Case.from_dict(failure["case"]):
        raise SimulationError(_differs(failure, f"run {found.found_at} fails first now"))
    return found


def _differs(failure: dict[str, Any], what: str) -> str:
    return (
        f"the shard's run {failure['run']} failed, but {what}: the program, its inputs, or twinrpc's version "
        f"changed since the shards ran. Replay it alone: {failure['replay']}"
    )
