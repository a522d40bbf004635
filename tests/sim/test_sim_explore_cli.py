"""``python -m twinrpc.simulator explore``: an unchanged torchrun-style program over seeds and fault plans.

The planted bug is the lost update, written for ``torch.distributed.rpc`` with ``RANK`` from the
environment: two trainers read a server's counter and write back value + 1; trainer 2 starts 1.2 ms
later, so only a fault (or an unlucky seed) makes a read land between the other trainer's read and
write. The commands run in this interpreter (``main([...])``, output through capsys); the exported
regression test runs in a fresh one.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from twinrpc.simulator import FaultPlan
from twinrpc.simulator._cli._explore import parse_traceback
from twinrpc.simulator._cli._main import main

SCRIPT = '''
"""The lost update, as a torchrun program."""
import os
import time

import torch.distributed.rpc as rpc

ATOMIC = False
_counter = {"value": 0}


def read():
    return _counter["value"]


def write(value):
    _counter["value"] = value


def increment():
    _counter["value"] += 1


def main():
    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    if rank == 2:
        time.sleep(1.2e-3)
    if rank:
        for _ in range(3):
            if ATOMIC:
                rpc.rpc_sync("worker0", increment)
            else:
                value = rpc.rpc_sync("worker0", read)
                rpc.rpc_sync("worker0", write, args=(value + 1,))
    rpc.shutdown()
    if rank == 0:
        assert _counter["value"] == 6, f"lost an update: the counter is {_counter['value']}, expected 6"


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "lost_update.py"
    path.write_text(SCRIPT, encoding="utf-8")
    return path


def _line(text: str, marker: str) -> str:
    for line in text.splitlines():
        if marker in line:
            return line.split(marker, 1)[1].strip()
    raise AssertionError(f"no line with {marker!r} in:\n{text}")


def test_explore_finds_shrinks_and_exports_the_lost_update(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "found"
    status = main(["explore", "--nproc-per-node", "3", "--out", str(out_dir), str(script)])
    out = capsys.readouterr().out
    assert status == 1, out
    header = _line(out, "twinrpc.simulator.explore: run")
    assert int(header.split()[0]) <= 200 and header.endswith("and 1 fault"), header
    assert "AssertionError raised by worker 0" in out
    assert "lost an update: the counter is" in out
    plan = FaultPlan.load(out_dir / "faults.json")
    assert len(plan) == 1
    command = _line(out, "replay:")
    assert command.startswith("python -m twinrpc.simulator run --nproc-per-node 3 --seed ")
    assert f"--faults {out_dir / 'faults.json'}" in command
    # the printed command replays the minimal run: the same failure
    status = main(shlex.split(command)[3:])
    replayed = capsys.readouterr()
    assert status == 1 and "AssertionError: lost an update: the counter is" in replayed.err
    # the regression test replays that run with the same command (which fails while the bug is
    # there, as just seen) and passes once the bug is fixed
    test = out_dir / "test_lost_update_regression.py"
    assert "'twinrpc.simulator', 'run'" in test.read_text()
    script.write_text(SCRIPT.replace("ATOMIC = False", "ATOMIC = True"), encoding="utf-8")
    assert _pytest(test) == 0


def _pytest(test: Path) -> int:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        cwd=test.parent,
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "passed" in run.stdout or "failed" in run.stdout, run.stdout + run.stderr
    return run.returncode


def test_swarm_exploration_minimizes_the_plan_it_drew(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["explore", "--nproc-per-node", "3", "--swarm", "--out", str(tmp_path / "s"), str(script)])
    out = capsys.readouterr().out
    assert status == 1, out
    minimal = len(FaultPlan.load(tmp_path / "s" / "faults.json"))
    drawn = _line(out, "first failing run:")  # the seed's whole swarm plan, before minimizing
    assert minimal <= 3 and f", {minimal} fault" not in drawn, out


def test_a_program_that_never_fails_passes_every_run(
    script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script.write_text(SCRIPT.replace("ATOMIC = False", "ATOMIC = True"), encoding="utf-8")
    status = main(["explore", "--nproc-per-node", "3", "--runs", "8", str(script)])
    out = capsys.readouterr().out
    assert status == 0 and "8 runs of" in out and "passed" in out


def test_bad_input_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explore", "--nproc-per-node", "2", str(tmp_path / "missing.py")]) == 2
    assert "missing.py" in capsys.readouterr().err
    assert main(["explore", "--nproc-per-node", "0", str(tmp_path / "missing.py")]) == 2


def test_the_last_exception_of_a_printed_traceback_is_the_failure() -> None:
    text = (
        "Traceback (most recent call last):\n"
        '  File "a.py", line 3, in <module>\n'
        "    f()\n"
        "    ^^^\n"
        "ValueError: bad value 3\n"
        "\n"
        "The above exception was the direct cause of the following exception:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "a.py", line 5, in <module>\n'
        "    g()\n"
        "twinrpc._errors.RemoteError: on worker 1:\n"
        "more detail\n"
    )
    assert parse_traceback(text) == ("twinrpc._errors.RemoteError", "on worker 1:\nmore detail")
    assert parse_traceback('Traceback (most recent call last):\n  File "x", line 1\nKeyError\n') == (
        "builtins.KeyError",
        "",
    )
