"""The conformance suite run on a third-party backend that keeps its deviations in a file of its own.

The backend is the docs' worked example, docs/examples/slow_network_backend.py; its deviation
(SLOWNET-1) is in docs/examples/slow_network_backend.deviations.toml, which the class names in its
``deviations`` attribute. Nothing here reads or writes twinrpc's spec/deviations.toml.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
BACKEND = "slow_network_backend:SlowNetworkBackend"
OWN_FILE = EXAMPLES / "slow_network_backend.deviations.toml"
DEVIATING = {"test_default_rpc_timeout_is_60_seconds", "test_set_rpc_timeout_applies_only_to_later_calls"}
#: A small part of the suite that includes the deviating tests (whole suite: see the howto's command).
SELECTION = ("conformance/test_timeouts.py", "conformance/test_rpc_calls.py", "-k", "timeout or rpc_sync")

pytestmark = pytest.mark.timeout(600)

USAGE_ERROR = 4  # pytest.ExitCode.USAGE_ERROR


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(ROOT)])}
    env.pop("TWINRPC_BACKEND", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfxX",
            "--backend",
            BACKEND,
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_example_backend_deviation_is_a_strict_xfail_from_its_own_file(tmp_path: Path) -> None:
    # twinrpc's deviations are made unreadable for this run: if the plugin consulted them, it would stop
    # with a usage error. The requirement headings are twinrpc's spec, as for every backend.
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    for md in (ROOT / "spec").glob("*.md"):
        shutil.copy(md, spec_dir / md.name)
    (spec_dir / "deviations.toml").write_text("this is not TOML [[[\n", encoding="utf-8")
    twinrpc_file = ROOT / "spec" / "deviations.toml"
    before = _digest(twinrpc_file)
    matrix = tmp_path / "slownet.json"

    proc = _pytest(*SELECTION, "--spec-dir", str(spec_dir), "--matrix-json", str(matrix))

    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(matrix.read_text(encoding="utf-8"))
    assert report["backend"] == "slownet"
    assert report["deviations_file"] == str(OWN_FILE)
    assert [d["id"] for d in report["deviations"]] == ["SLOWNET-1"]
    outcomes = {t["test"]: (t["outcome"], t["deviation"]) for t in report["tests"]}
    assert {name: outcomes[name] for name in DEVIATING} == dict.fromkeys(DEVIATING, ("xfailed", "SLOWNET-1"))
    others = {name: outcome for name, (outcome, _) in outcomes.items() if name not in DEVIATING}
    assert len(others) >= 5 and set(others.values()) == {"passed"}, others
    assert "SLOWNET-1 (ERR-4): world.run's worlds start with rpc_timeout=120 s" in proc.stdout
    assert _digest(twinrpc_file) == before


def test_a_deviation_that_passes_fails_the_run(tmp_path: Path) -> None:
    # Strict: a listed test that passes on the backend is an XPASS(strict) failure, so stale entries go.
    own = tmp_path / "stale.toml"
    own.write_text(
        '[[deviation]]\nid = "SLOWNET-9"\nrequirement = "ERR-4"\nbackends = ["slownet"]\n'
        'tests = ["test_rpc_timeout_option_sets_the_default_timeout"]\nreason = "not a real difference"\n',
        encoding="utf-8",
    )
    proc = _pytest(
        "conformance/test_timeouts.py",
        "-k",
        "test_rpc_timeout_option_sets_the_default_timeout or test_default_rpc_timeout_is_60_seconds",
        "--deviations",
        str(own),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[XPASS(strict)] SLOWNET-9 (ERR-4): not a real difference" in proc.stdout
    # --deviations replaced the class's own file: its SLOWNET-1 test is an ordinary failure now.
    assert "FAILED conformance/test_timeouts.py::test_default_rpc_timeout_is_60_seconds" in proc.stdout


def test_a_deviation_file_naming_what_does_not_exist_is_a_usage_error(tmp_path: Path) -> None:
    # One problem per entry; the run stops before collecting anything and names every problem.
    own = tmp_path / "bad.toml"
    own.write_text(
        """\
[[deviation]]
id = "SLOWNET-1"
requirement = "NOPE-1"
backends = ["slownet"]
tests = ["test_default_rpc_timeout_is_60_seconds"]
reason = "an unknown requirement"

[[deviation]]
id = "SLOWNET-2"
requirement = "ERR-4"
backends = ["slownet"]
tests = ["test_that_does_not_exist"]
reason = "an unknown test"

[[deviation]]
id = "SLOWNET-3"
requirement = "ERR-4"
backends = ["sim"]
tests = ["test_default_rpc_timeout_is_60_seconds"]
reason = "another backend's deviation"
""",
        encoding="utf-8",
    )
    proc = _pytest("conformance/test_smoke.py", "--deviations", str(own))
    assert proc.returncode == USAGE_ERROR, proc.stdout + proc.stderr
    assert f"ERROR: {own} is inconsistent with the suite:" in proc.stderr
    assert "deviation SLOWNET-1: requirement 'NOPE-1' is not a heading in spec/*.md" in proc.stderr
    assert (
        "deviation SLOWNET-2: names test 'test_that_does_not_exist', but no such test exists in the suite"
        in proc.stderr
    )
    assert "deviation SLOWNET-3: names backend 'sim'; this file may name only ['slownet']" in proc.stderr


def test_a_missing_deviation_file_is_a_usage_error(tmp_path: Path) -> None:
    proc = _pytest("conformance/test_smoke.py", "--deviations", str(tmp_path / "nowhere.toml"))
    assert proc.returncode == USAGE_ERROR, proc.stdout + proc.stderr
    assert f"--deviations: no deviations file at {tmp_path / 'nowhere.toml'}" in proc.stderr


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('    name = "sim"\n', "its name 'sim' is a built-in backend's; choose another name"),
        (
            '    deviations = "missing.deviations.toml"\n',
            "my_backend.MyBackend.deviations: no deviations file at {tmp}/missing.deviations.toml",
        ),
    ],
    ids=["builtin-name", "missing-own-file"],
)
def test_a_backend_class_with_a_builtin_name_or_a_missing_own_file_is_a_usage_error(
    tmp_path: Path, body: str, message: str
) -> None:
    (tmp_path / "my_backend.py").write_text(
        "from slow_network_backend import SlowNetworkBackend\n\n\nclass MyBackend(SlowNetworkBackend):\n"
        + body,
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(EXAMPLES), str(ROOT)])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "conformance/test_smoke.py",
            "--backend",
            "my_backend:MyBackend",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == USAGE_ERROR, proc.stdout + proc.stderr
    assert message.format(tmp=tmp_path) in proc.stderr
