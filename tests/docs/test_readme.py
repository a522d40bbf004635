"""The README works as written: its porting snippet is examples/porting_snippet.py and runs, and its
simulator commands run, in order, from a folder laid out like the repository's root."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

from _launch import ROOT, base_env

README = (ROOT / "README.md").read_text()


def _block(language: str, after: str) -> str:
    """The first fenced block of ``language`` after the heading ``after``."""
    start = README.index(after)
    match = re.search(rf"```{language}\n(.*?)```", README[start:], re.DOTALL)
    assert match is not None, f"no {language} block after {after!r} in README.md"
    return match.group(1)


def test_readme_porting_snippet_is_the_tested_example_file_and_prints_the_sum() -> None:
    snippet = ROOT / "examples" / "porting_snippet.py"
    assert _block("python", "## Porting a program") == snippet.read_text()
    out = subprocess.run(
        [sys.executable, str(snippet)],
        capture_output=True,
        text=True,
        env=base_env(),
        timeout=300,
        check=True,
    ).stdout
    assert out.startswith("tensor([2., 2.])\n")
    assert "# twinrpc trace: simulator, seed 7, 2 workers (worker0, worker1)" in out


def test_getting_started_opens_with_the_readmes_two_commands() -> None:
    page = (ROOT / "docs" / "tutorials" / "getting-started.md").read_text()
    readme_commands = re.search(r"```bash\n(.*?)```", README, re.DOTALL)
    page_commands = re.search(r"```bash\n(.*?)```", page, re.DOTALL)
    assert readme_commands is not None and page_commands is not None
    assert page_commands.group(1) == readme_commands.group(1)


def test_every_nox_session_explains_itself_in_one_line() -> None:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    sessions = [
        f
        for f in tree.body
        if isinstance(f, ast.FunctionDef) and any("nox.session" in ast.unparse(d) for d in f.decorator_list)
    ]
    assert len(sessions) >= 10
    for session in sessions:
        doc = ast.get_docstring(session)
        assert doc and doc.splitlines()[0].endswith("."), f"nox -l shows {session.name}'s first line: {doc!r}"


def test_readme_simulator_commands_run_as_written(tmp_path: Path) -> None:
    (tmp_path / "docs").symlink_to(ROOT / "docs")
    commands = [
        shlex.split(line.split("#")[0]) for line in _block("bash", "## Debugging a program").splitlines()
    ]
    results = []
    for command in commands:
        assert command[0] == "python", command
        done = subprocess.run(
            [sys.executable, *command[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=base_env(),
            timeout=600,
        )
        results.append(done.returncode)
        if command[3] == "explore":
            assert "minimal plan written to found/faults.json" in done.stdout + done.stderr, done.stderr
    # the plain run passes; explore and the replay of what it found fail with the race; the two traces
    # differ (diff exits 1 and says where); the export succeeds
    assert results == [0, 1, 1, 1, 0], results
    assert (tmp_path / "race.html").stat().st_size > 0
