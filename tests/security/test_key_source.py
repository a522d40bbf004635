"""Where the job key comes from (src/twinrpc/_key_source.py): ``auth_key=``, a file readable by its
owner only (``TWINRPC_AUTH_KEY_FILE``), or ``TWINRPC_AUTH_KEY``, which is removed from the environment
once read; and a gloo job keyed from a file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import ROOT, base_env, first_worker_json, free_port, run_all

import twinrpc.rpc as rpc
from twinrpc._key_source import AUTH_KEY_ENV, AUTH_KEY_FILE_ENV, _EnvironmentKey, auth_key_of


@pytest.fixture
def no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(AUTH_KEY_ENV, raising=False)
    monkeypatch.delenv(AUTH_KEY_FILE_ENV, raising=False)
    monkeypatch.setattr(_EnvironmentKey, "key", None)
    return monkeypatch


def _key_file(path: Path, content: bytes, mode: int) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path


#: run in a fresh process started with TWINRPC_AUTH_KEY: what it, its environment and a child see
_READ_ONCE = """
import json, os, subprocess, sys
import twinrpc.rpc as rpc
from twinrpc.rpc.options import auth_key_of
first = auth_key_of(rpc.RpcBackendOptions())
second = auth_key_of(rpc.RpcBackendOptions())
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('TWINRPC_AUTH_KEY'))"],
                       capture_output=True, text=True).stdout.strip()
print(json.dumps({"first": first.decode(), "second": second.decode(), "in os.environ": "TWINRPC_AUTH_KEY" in os.environ,
                  "in /proc/self/environ": b"launcher-secret" in open("/proc/self/environ", "rb").read(),
                  "child": child}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/environ")
def test_the_environment_key_is_removed_once_read_and_kept_for_the_process() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _READ_ONCE],
        env=base_env(TWINRPC_AUTH_KEY="launcher-secret"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == {
        "first": "launcher-secret",
        "second": "launcher-secret",  # every later init_rpc of the process (each simulated worker)
        "in os.environ": False,
        "in /proc/self/environ": False,  # its bytes were overwritten before the variable was removed
        "child": "None",  # a process it starts does not inherit it
    }


def test_a_key_file_readable_by_its_owner_only_gives_the_key(
    no_key_in_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = _key_file(tmp_path / "key", b"file secret\n", 0o600)
    no_key_in_environment.setenv(AUTH_KEY_FILE_ENV, str(path))
    assert auth_key_of(rpc.RpcBackendOptions()) == b"file secret"  # one trailing newline dropped
    assert auth_key_of(rpc.RpcBackendOptions(auth_key=b"mine")) == b"mine"  # the option wins


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_key_file_others_can_read_or_write_is_refused(
    no_key_in_environment: pytest.MonkeyPatch, tmp_path: Path, mode: int
) -> None:
    path = _key_file(tmp_path / "key", b"file secret", mode)
    no_key_in_environment.setenv(AUTH_KEY_FILE_ENV, str(path))
    with pytest.raises(ValueError, match=r"group or others .*chmod 600") as info:
        auth_key_of(rpc.RpcBackendOptions())
    assert "file secret" not in str(info.value)


def test_an_empty_key_file_or_both_sources_are_refused(
    no_key_in_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_key_in_environment.setenv(AUTH_KEY_FILE_ENV, str(_key_file(tmp_path / "empty", b"\n", 0o600)))
    with pytest.raises(ValueError, match="is empty"):
        auth_key_of(rpc.RpcBackendOptions())
    no_key_in_environment.setenv(AUTH_KEY_FILE_ENV, str(_key_file(tmp_path / "key", b"k", 0o600)))
    no_key_in_environment.setenv(AUTH_KEY_ENV, "k")
    with pytest.raises(ValueError, match="both TWINRPC_AUTH_KEY and TWINRPC_AUTH_KEY_FILE are set"):
        auth_key_of(rpc.RpcBackendOptions())
    no_key_in_environment.setenv(AUTH_KEY_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        auth_key_of(rpc.RpcBackendOptions())


def test_a_gloo_job_keyed_from_files_runs_and_different_files_fail_init_rpc(tmp_path: Path) -> None:
    same = _key_file(tmp_path / "same", b"job secret", 0o600)
    other = _key_file(tmp_path / "other", b"another secret", 0o600)
    assert (
        first_worker_json("_unpickle_allow_program.py", TWINRPC_AUTH_KEY_FILE=str(same))["allowed"] == "ok: 2"
    )
    program = ROOT / "tests" / "_unpickle_allow_program.py"
    port = str(free_port())
    mixed = run_all(
        [
            (
                [sys.executable, str(program)],
                base_env(
                    RANK=str(rank),
                    WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    TWINRPC_AUTH_KEY_FILE=str(path),
                ),
            )
            for rank, path in enumerate((same, other))
        ],
        ROOT / "tests",
    )
    for res in mixed:
        assert res.returncode != 0 and "AuthenticationError" in res.stderr, res.describe()
        assert "TWINRPC_AUTH_KEY_FILE" in res.stderr  # the hint names the file form too
