"""Helpers for the multiprocess launch tests: free ports, running workers, checking clean exits."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: a launch that takes longer has hung; the processes are killed and the test fails with their output
LAUNCH_TIMEOUT = 240.0
#: what a process must never print at exit: a C++ abort, a crashed interpreter
BAD_EXIT_MARKERS = ("terminate called", "Aborted", "core dumped", "Fatal Python error")


#: picks free_port's candidates (its own generator: hypothesis reseeds the global one, which would give
#: every xdist worker the same ports)
_PORTS = random.Random()
#: the lowest port free_port picks
_LOWEST_PORT = 10_000


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port that is free now, picked at random below the kernel's ephemeral range. A port bound
    to 0 and released comes from that range, where the client end of every connection (another test's
    gloo pairs and store clients) takes its port too, so it may be gone by the time the test listens
    on it (seen: EADDRINUSE from a TCPStore while the suite ran with three workers)."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = _PORTS.randrange(_LOWEST_PORT, max(low, _LOWEST_PORT + 1000))
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address, as a store server listens
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port between {_LOWEST_PORT} and {low} after 200 tries")


@dataclass(frozen=True)
class Exited:
    """One finished process: its command, exit code and output."""

    args: Sequence[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"$ {' '.join(self.args)}\nexit code {self.returncode}\n--- stdout ---\n{self.stdout}"
            f"--- stderr ---\n{self.stderr}"
        )

    def check_clean(self, *, tracebacks: bool = False) -> None:
        """Exit code 0 and nothing on stderr that says the interpreter or C++ runtime aborted; no
        Python traceback either unless ``tracebacks`` (PyTorch's RPC logs a remote exception's)."""
        markers = BAD_EXIT_MARKERS if tracebacks else (*BAD_EXIT_MARKERS, "Traceback")
        bad = [m for m in markers if m in self.stderr]
        assert self.returncode == 0 and not bad, f"unclean exit ({bad}):\n{self.describe()}"


def base_env(**extra: str) -> dict[str, str]:
    """The test's environment without inherited launcher variables, with ``extra`` added."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GLOO_SOCKET_IFNAME")
        and not k.startswith(("TORCHELASTIC_", "PYTEST_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_all(commands: Sequence[tuple[Sequence[str], Mapping[str, str]]], cwd: Path) -> list[Exited]:
    """Start every command at once, wait for all (killing all after LAUNCH_TIMEOUT), return them."""
    procs = [
        subprocess.Popen(
            list(args), env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for args, env in commands
    ]
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    results: list[Exited] = []
    timed_out = False
    for (args, _), p in zip(commands, procs, strict=True):
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            p.kill()
            out, err = p.communicate()
        results.append(Exited(args, p.returncode, out, err))
    if timed_out:
        raise AssertionError(
            f"hung for {LAUNCH_TIMEOUT:g} s and killed:\n" + "\n".join(r.describe() for r in results)
        )
    return results


def run_workers(script: Path, *args: str, world_size: int = 2, cwd: Path, **env: str) -> list[Exited]:
    """``python script *args`` once per rank, RANK and WORLD_SIZE set as torchrun sets them."""
    return run_all(
        [
            ([sys.executable, str(script), *args], base_env(RANK=str(r), WORLD_SIZE=str(world_size), **env))
            for r in range(world_size)
        ],
        cwd,
    )


def first_worker_json(script: str, *, tracebacks: bool = True, **env: str) -> Any:
    """Run ``tests/<script>`` as a 2-worker gloo job on loopback (a fresh MASTER_PORT, ``env`` added),
    check every worker exited cleanly, and return what rank 0 printed last, parsed as JSON (the
    programs that run in both worlds print their outcomes so). ``tracebacks``: remote errors' logged
    tracebacks are expected."""
    results = run_workers(
        ROOT / "tests" / script,
        cwd=ROOT / "tests",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        **env,
    )
    for res in results:
        res.check_clean(tracebacks=tracebacks)
    return json.loads(results[0].stdout.strip().splitlines()[-1])
