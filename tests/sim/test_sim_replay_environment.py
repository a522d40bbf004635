"""The replay line carries the environment the program read (``run`` and ``explore``).

A program that fails only with ``RACY=1`` fails again when its printed command is run from a shell
that does not have ``RACY`` (the command sets it), and a program that fails only while ``RACY`` is
unset fails again from a shell that exports it (the command unsets it). The exported regression test
gives its ``run`` the same environment. Variables the program never read, the ones the launcher sets
itself, and reads by libraries stay out of the command.
"""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from twinrpc.simulator._cli._main import main
from twinrpc.simulator._launch._launch import LaunchOptions, environment_prefix, launch

RACY = """
import os
import torch.distributed.rpc as rpc

rank = int(os.environ["RANK"])
rpc.init_rpc(f"worker{rank}", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
if os.environ.get("RACY") == "1" and rank == 1:
    raise RuntimeError("the race only RACY=1 lets happen")
rpc.shutdown()
"""

MARKER = "replay this run with: "


def _program(tmp_path: Path, source: str, name: str = "racy.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def _replay_line(err: str) -> str:
    lines = [line.split(MARKER, 1)[1] for line in err.splitlines() if MARKER in line]
    assert len(lines) == 1, err
    return lines[0]


def _shell_environment(**changes: str | None) -> dict[str, str]:
    """This environment with ``changes`` (None: unset), ``python`` being this interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in changes or changes[k] is not None}
    env.update({k: v for k, v in changes.items() if v is not None})
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def _sh(command: str, cwd: Path, **changes: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", "-c", command],
        cwd=cwd,
        env=_shell_environment(**changes),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_run_that_fails_only_with_racy_set_prints_a_command_that_sets_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prog = _program(tmp_path, RACY)
    monkeypatch.setenv("RACY", "1")
    monkeypatch.setenv("SOME_UNRELATED", "1")
    status = main(["run", "--nproc-per-node", "2", "--seed", "3", str(prog)])
    err = capsys.readouterr().err
    assert status == 1 and "RuntimeError: the race only RACY=1 lets happen" in err, err
    command = _replay_line(err)
    assert command == f"RACY=1 python -m twinrpc.simulator run --nproc-per-node 2 --seed 3 {prog}"
    # not read by the program: not in the command; nor are RANK and WORLD_SIZE, which it did read
    assert "SOME_UNRELATED" not in command and "RANK" not in command and "WORLD_SIZE" not in command
    # run from a shell without RACY, the printed command fails again, the same way
    replayed = _sh(command, tmp_path, RACY=None, SOME_UNRELATED=None)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "RuntimeError: the race only RACY=1 lets happen" in replayed.stderr
    assert _replay_line(replayed.stderr) == command


def test_a_variable_read_while_unset_is_unset_for_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prog = _program(
        tmp_path,
        """
        import os
        if "RACY" not in os.environ and os.environ["RANK"] == "0":
            raise RuntimeError("fails unless RACY is set")
        """,
    )
    monkeypatch.delenv("RACY", raising=False)
    assert main(["run", "--nproc-per-node", "2", str(prog)]) == 1
    command = _replay_line(capsys.readouterr().err)
    assert command == f"env -u RACY python -m twinrpc.simulator run --nproc-per-node 2 --seed 0 {prog}"
    # a shell that exports RACY replays the run as it was: without RACY, failing
    replayed = _sh(command, tmp_path, RACY="1")
    assert replayed.returncode == 1 and "RuntimeError: fails unless RACY is set" in replayed.stderr, (
        replayed.stdout + replayed.stderr
    )


def test_explore_exports_the_environment_into_the_command_and_the_regression_test(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prog = _program(tmp_path, RACY)
    out_dir = tmp_path / "found"
    monkeypatch.setenv("RACY", "1")
    monkeypatch.setenv("SOME_UNRELATED", "1")
    status = main(["explore", "--nproc-per-node", "2", "--runs", "3", "--out", str(out_dir), str(prog)])
    out = capsys.readouterr().out
    assert status == 1 and "the race only RACY=1 lets happen" in out, out
    command = next(line.split("replay: ", 1)[1] for line in out.splitlines() if "replay: " in line)
    assert command.startswith("RACY=1 python -m twinrpc.simulator run --nproc-per-node 2 "), command
    assert "SOME_UNRELATED" not in command
    test = out_dir / "test_racy_regression.py"
    source = test.read_text(encoding="utf-8")
    assert "ENVIRONMENT = {'RACY': '1'}" in source and "SOME_UNRELATED" not in source
    # The exported test asserts the run passes (commit it with the fix): with the bug still there it
    # fails, although the shell running pytest has no RACY: the test sets it for its run.
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        cwd=test.parent,
        env=_shell_environment(RACY=None, SOME_UNRELATED=None),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout + run.stderr
    assert "RuntimeError: the race only RACY=1 lets happen" in run.stdout


def _launch(prog: Path, nproc: int = 2) -> tuple[int, dict[str, str | None], str]:
    sink = io.StringIO()
    result = launch(LaunchOptions(program=str(prog), nproc_per_node=nproc), stdout=sink, stderr=sink)
    return result.status, dict(result.environment), sink.getvalue()


def test_what_counts_as_a_read_of_the_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads by the program's own code, in any process it starts, through any of os.environ's
    ways in; not reads by libraries, of the whole environment at once, of what the process wrote
    itself, or of what the launcher sets from its flags."""
    helper = tmp_path / "helper.py"
    helper.write_text("import os\n\ndef level():\n    return os.getenv('HELPER_LEVEL')\n", encoding="utf-8")
    prog = _program(
        tmp_path,
        """
        import argparse, multiprocessing, os, shutil
        import helper

        def child():
            os.environ.get("CHILD_ONLY")

        if __name__ == "__main__":
            os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]
            os.environ.get("BY_GET"), os.getenv("BY_GETENV"), "BY_IN" in os.environ
            os.environ.setdefault("BY_SETDEFAULT", "x")
            helper.level()
            os.environ["MINE"] = "1"
            os.environ["MINE"]
            whole = dict(os.environ), os.environ.copy(), list(os.environ.items())
            shutil.get_terminal_size()              # the standard library reads COLUMNS, LINES
            argparse.ArgumentParser().format_help()
            p = multiprocessing.Process(target=child)
            p.start(); p.join()
        """,
    )
    for name in ("BY_GET", "BY_IN", "HELPER_LEVEL", "CHILD_ONLY", "MINE"):
        monkeypatch.setenv(name, "set")
    for name in ("BY_GETENV", "BY_SETDEFAULT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "91")
    monkeypatch.setenv("SOME_UNRELATED", "1")
    status, environment, output = _launch(prog)
    assert status == 0, output
    assert environment == {
        "BY_GET": "set",
        "BY_GETENV": None,
        "BY_IN": "set",
        "BY_SETDEFAULT": None,
        "CHILD_ONLY": "set",
        "HELPER_LEVEL": "set",
    }


def test_the_launchers_own_variables_are_in_only_when_overridden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prog = _program(
        tmp_path,
        """
        import os
        os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), os.environ["LOCAL_RANK"]
        os.environ["TORCHELASTIC_ERROR_FILE"], os.environ["MASTER_PORT"]
        """,
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert _launch(prog)[1] == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launcher's default with 2 workers
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    assert _launch(prog)[1] == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read by the launcher for the workers' torch threads
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    assert _launch(prog)[1] == {"OMP_NUM_THREADS": "2", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    # --master-port gives MASTER_PORT on the command line
    options = LaunchOptions(program="p.py", master_port=1234)
    assert options.replay_command() == (
        "python -m twinrpc.simulator run --nproc-per-node 1 --seed 0 --master-port 1234 p.py"
    )


def test_the_prefix_is_shell_quoted() -> None:
    assert environment_prefix({}) == ""
    assert environment_prefix({"A": "1", "B": "two words", "C": ""}) == "A=1 B='two words' C='' "
    assert environment_prefix({"A": "x;y", "GONE": None}) == "env -u GONE 'A=x;y' "
    assert environment_prefix({"NOT-A-NAME": "1"}) == "env NOT-A-NAME=1 "
    words = shlex.split(environment_prefix({"A": "it's", "B": "$HOME"}) + "cmd")
    assert words == ["A=it's", "B=$HOME", "cmd"]
