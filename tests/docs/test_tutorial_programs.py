"""PyTorch's RPC example programs (examples/tutorials/), written for ``torch.distributed.rpc`` and started
by their own launchers (``torch.multiprocessing.spawn``), run in three worlds: upstream PyTorch (the
oracle), twinrpc's gloo world with their imports ported (examples/port_imports.py), and unchanged under
``python -m twinrpc.simulator run``. Where a program's printed numbers are deterministic (seeded, and
not decided by which process gets somewhere first), every world must print PyTorch's.

Cost: upstream PyTorch's runs set the time (TensorPipe takes seconds to start a world); the three
worlds of a program run at once, with the smallest sizes that still exercise it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _launch import ROOT, Exited, base_env, free_port, run_all

TUTORIALS = ROOT / "examples" / "tutorials"
sys.path.insert(0, str(ROOT / "examples"))
from port_imports import port_source  # noqa: E402

PREFIX = re.compile(r"^\[rank\d+\]:", re.MULTILINE)


@dataclass(frozen=True)
class Program:
    """One example program, the arguments it runs with here, and the lines every world must agree on."""

    file: str
    args: tuple[str, ...] = ()
    #: the printed lines every world must print as PyTorch does (default: all of them)
    deterministic: Callable[[str], bool] = field(default=lambda line: True)
    #: a check of the output that holds in every world (beyond agreeing with PyTorch)
    check: Callable[[list[str]], None] = field(default=lambda lines: None)

    @property
    def name(self) -> str:
        return self.file.removesuffix(".py")


def _ddp_replicas_agree(lines: list[str]) -> None:
    # Both trainers print to one stdout, so a line of one may run into the other's (seen with
    # upstream's processes: "Training done for epoch 0Training done for epoch 0"): count in the text.
    text = "\n".join(lines)
    assert text.count("Training done for epoch 0") == 2 and text.count("Training done for epoch 1") == 2, (
        lines
    )
    (sums,) = [line for line in lines if line.startswith("dense weights' sums:")]
    first, second = sums.split(":")[1].split()
    assert first == second, sums  # DDP keeps both trainers' dense replicas equal


def _episodes(lines: list[str]) -> None:
    assert sum(line.startswith("Episode ") for line in lines) == 3, lines


PROGRAMS = {
    p.name: p
    for p in (
        Program("rnn.py"),
        Program("reinforce.py", ("--episodes", "3"), check=_episodes),
        Program(
            "batch_reinforce.py",
            ("--num-episode", "2"),
            # with one observer, or batched, the samples do not depend on arrival order
            deterministic=lambda line: line.startswith("world 2") or "batch True" in line,
        ),
        Program("batch_parameter_server.py"),
        Program("pipeline.py"),
        Program("ddp_rpc.py", deterministic=lambda line: False, check=_ddp_replicas_agree),
    )
}


def _lines(result: Exited) -> list[str]:
    assert result.returncode == 0, result.describe()
    return [line for line in PREFIX.sub("", result.stdout).splitlines() if line.strip()]


def _ported(tmp: Path) -> Path:
    """Every file of examples/tutorials/ with its torch RPC imports turned into twinrpc's."""
    for source in TUTORIALS.glob("*.py"):
        (tmp / source.name).write_text(port_source(source.read_text()))
    return tmp


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_tutorial_program_computes_what_pytorch_does_on_gloo_and_unchanged_under_the_simulator(
    name: str, tmp_path: Path
) -> None:
    """The three worlds run at once (each its own processes, ports of their own)."""
    program = PROGRAMS[name]
    simulated = [sys.executable, "-m", "twinrpc.simulator", "run", "--nproc-per-node", "1", "--seed", "0"]
    ported = _ported(tmp_path)
    runs = [
        [sys.executable, str(TUTORIALS / program.file), *program.args],
        [sys.executable, str(ported / program.file), *program.args],
        [*simulated, str(TUTORIALS / program.file), *program.args],
    ]
    results = run_all([(cmd, base_env(EXAMPLE_PORT=str(free_port()))) for cmd in runs], tmp_path)
    upstream, gloo, simulated_run = (_lines(r) for r in results)
    program.check(upstream)
    for world, lines in (("gloo", gloo), ("sim", simulated_run)):
        program.check(lines)
        mine = [line for line in lines if program.deterministic(line)]
        theirs = [line for line in upstream if program.deterministic(line)]
        assert mine == theirs, f"{world} printed other numbers than PyTorch"
