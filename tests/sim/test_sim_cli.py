"""``python -m twinrpc.simulator run``: unchanged programs as N simulated workers, torchrun-style.

Most tests run the command in this interpreter (``main([...])``, output through capsys) and then check
that the run left nothing behind: the interpreter's ``__main__``, ``os.environ``, ``sys.argv``, the
time functions and the ``torch.distributed`` modules are its own again. One test runs the real
command in a subprocess for its exit status.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch.distributed
import twinrpc.simulator
from twinrpc.simulator import Simulation, SimulationWarning
from twinrpc.simulator._cli._main import main
from twinrpc.simulator._launch._launch import LaunchOptions

import twinrpc.rpc

ROOT = Path(__file__).resolve().parents[2]

_REAL = {
    "time": time.time,
    "sleep": time.sleep,
    "monotonic": time.monotonic,
    "start": threading.Thread.start,
    "rpc": sys.modules["torch.distributed.rpc"],
    "main": sys.modules["__main__"],
}


def _program(tmp_path: Path, source: str, name: str = "prog.py", **modules: str) -> Path:
    for module, text in modules.items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(text))
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    environ = dict(os.environ)
    argv_before = list(sys.argv)
    status = main(["run", *argv])
    out, err = capsys.readouterr()
    # The run left the interpreter as it found it.
    assert dict(os.environ) == environ
    assert sys.argv == argv_before
    assert (
        time.time is _REAL["time"] and time.sleep is _REAL["sleep"] and time.monotonic is _REAL["monotonic"]
    )
    assert threading.Thread.start is _REAL["start"]
    assert sys.modules["torch.distributed.rpc"] is _REAL["rpc"] and torch.distributed.rpc is _REAL["rpc"]
    assert sys.modules["__main__"] is _REAL["main"]
    return status, out, err


def _lines(text: str, rank: int) -> list[str]:
    prefix = f"[rank{rank}]:"
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


# -- environment, arguments, modules ----------------------------------------------------------------
def test_each_worker_sees_its_own_torchrun_environment_and_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(
        tmp_path,
        """
        import os, sys
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS"]
        print(" ".join(f"{k}={os.environ[k]}" for k in keys))
        os.environ["MINE"] = os.environ["RANK"]   # a worker's own change stays its own
        print("getenv", os.getenv("RANK"), "mine", os.environ["MINE"], "error_file",
              os.environ["TORCHELASTIC_ERROR_FILE"].endswith(f"/{os.environ['RANK']}/error.json"))
        print("argv", sys.argv[1:])
        """,
    )
    status, out, _ = _run(
        capsys, "--nproc-per-node", "3", "--master-port", "1234", str(prog), "{rank}", "--n={world_size}",
        "${local_rank}", '{"rank": 1}', "{other}",
    )  # fmt: skip
    assert status == 0
    for r in range(3):
        assert _lines(out, r) == [
            f"RANK={r} LOCAL_RANK={r} WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 GROUP_RANK=0 ROLE_RANK={r} "
            f"ROLE_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=1234 TORCHELASTIC_RUN_ID=none "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}",
            f"getenv {r} mine {r} error_file True",
            f"argv ['{r}', '--n=3', '{r}', '{{\"rank\": 1}}', '{{other}}']",
        ]
    assert "MINE" not in os.environ


def test_module_level_state_is_per_worker_in_the_program_and_its_modules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A module-level counter in the program and in a module beside it: each worker has its own, and
    a function called by RPC runs in the callee's copy."""
    prog = _program(
        tmp_path,
        """
        import os
        import torch.distributed.rpc as rpc
        import counter

        hits = 0

        def bump_remote():
            global hits
            hits += 1
            return counter.bump(), hits, __name__

        rank = int(os.environ["RANK"])
        counter.bump()
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=3)
        peer = f"w{(rank + 1) % 3}"
        print("remote", [rpc.rpc_sync(peer, bump_remote) for _ in range(2)])
        rpc.shutdown()
        print("local", counter.count, hits, counter.__file__.endswith("counter.py"))
        """,
        counter="""
        count = 0

        def bump():
            global count
            count += 1
            return count
        """,
    )
    status, out, _ = _run(capsys, "--nproc-per-node", "3", str(prog))
    assert status == 0
    for r in range(3):
        # Each worker: one local bump, then two by its left neighbour's RPCs, in its own copy.
        assert _lines(out, r) == [
            "remote [(2, 1, '__main__'), (3, 2, '__main__')]",
            "local 3 2 True",
        ], out
    assert "counter" not in sys.modules


# -- time ---------------------------------------------------------------------------------------------
def test_time_follows_the_virtual_clock_so_a_long_sleep_takes_no_wall_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(
        tmp_path,
        """
        import time
        from time import sleep, monotonic

        t0, m0, p0, n0 = time.time(), monotonic(), time.perf_counter(), time.time_ns()
        sleep(1000)
        time.sleep(0.5)
        print(f"time {time.time() - t0:.3f} monotonic {monotonic() - m0:.3f} "
              f"perf_counter {time.perf_counter() - p0:.3f} ns {time.time_ns() - n0}")
        print("epoch", time.time() > 1.7e9, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
        """,
    )
    start = time.monotonic()
    status, out, _ = _run(capsys, "--nproc-per-node", "2", str(prog))
    wall = time.monotonic() - start
    assert status == 0
    for r in range(2):
        assert _lines(out, r) == [
            "time 1000.500 monotonic 1000.500 perf_counter 1000.500 ns 1000500000000",
            "epoch True 2024-01-01 00:16:40",
        ]
    assert wall < 100, f"the 1000 s sleep took {wall:.1f} s of wall time: not virtual"


# -- torch.distributed modules ------------------------------------------------------------------------
def test_torch_distributed_rpc_autograd_and_distributed_optimizer_are_served_by_twinrpc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(
        tmp_path,
        """
        import torch
        import torch.distributed as dist
        import torch.distributed.rpc as rpc
        import torch.distributed.autograd as dist_autograd
        from torch.distributed import rpc as rpc2
        from torch.distributed.optim import DistributedOptimizer, ZeroRedundancyOptimizer
        from torch.distributed.rpc import RRef, rpc_sync
        from torch.distributed.rpc.functions import async_execution

        print(rpc.__name__, rpc2 is rpc, dist.rpc is rpc, dist_autograd.__name__,
              dist.autograd is dist_autograd, DistributedOptimizer.__module__, ZeroRedundancyOptimizer.__module__,
              RRef.__module__, async_execution.__module__)
        """,
    )
    status, out, _ = _run(capsys, "--nproc-per-node", "1", str(prog))
    assert status == 0
    assert _lines(out, 0) == [
        "twinrpc.rpc True True twinrpc.autograd True twinrpc.optim "
        "torch.distributed.optim.zero_redundancy_optimizer twinrpc._rref twinrpc.rpc.functions"
    ]
    assert torch.distributed.autograd.__name__ == "torch.distributed.autograd"
    from torch.distributed.optim import DistributedOptimizer

    assert DistributedOptimizer.__module__ == "torch.distributed.optim.optimizer"
    assert twinrpc.rpc is not torch.distributed.rpc


def test_an_unchanged_program_using_torchs_remote_module_runs_on_twinrpcs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(
        tmp_path,
        """
        import os
        import torch
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.nn.api.remote_module as remote_module
        import torch.distributed.rpc as rpc
        from torch import nn
        from torch.distributed.nn import RemoteModule
        from torch.distributed.nn.api.remote_module import RemoteModule as RemoteModuleToo
        from torch.distributed.optim import DistributedOptimizer

        class Affine(nn.Module):
            def __init__(self, scale):
                super().__init__()
                self.weight = nn.Parameter(torch.full((2,), float(scale)))

            def forward(self, x, shift=0.0):
                return x * self.weight + shift

        rank = int(os.environ["RANK"])
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        if rank == 0:
            same = RemoteModule is RemoteModuleToo is remote_module.RemoteModule is torch.distributed.nn.RemoteModule
            print("served", same, RemoteModule.__module__)
            rm = RemoteModule("worker1/cpu", Affine, args=(3,))
            print("forward", rm(torch.ones(2), shift=1.0).tolist(), rm.forward_async(torch.ones(2)).wait().tolist())
            opt = DistributedOptimizer(torch.optim.SGD, rm.remote_parameters(), lr=0.5)
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [rm(torch.ones(2)).sum()])
                opt.step(cid)
            print("trained", rm.remote_parameters()[0].to_here().tolist())
        rpc.shutdown()
        """,
    )
    status, out, err = _run(capsys, "--nproc-per-node", "2", str(prog))
    assert status == 0, err
    assert _lines(out, 0) == [
        "served True twinrpc.nn._remote_module",
        "forward [4.0, 4.0] [3.0, 3.0]",
        "trained [2.5, 2.5]",  # 3 - 0.5 * d(sum(x * w))/dw with x = 1
    ]
    import torch.distributed.nn
    import torch.distributed.nn.api.remote_module

    assert torch.distributed.nn.RemoteModule.__module__ == "torch.distributed.nn.api.remote_module"
    assert torch.distributed.nn.api.remote_module.RemoteModule is torch.distributed.nn.RemoteModule
    assert sys.modules["torch.distributed.nn"] is torch.distributed.nn


# -- exit status and failures ---------------------------------------------------------------------------
_FAILING = """
import os, sys
rank = int(os.environ["RANK"])
print("hello from", rank)
if rank == 1:
    sys.exit(3)
if rank == 2:
    raise ValueError("boom on rank 2")
"""


def test_exit_status_is_zero_iff_every_worker_exits_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ok = _program(tmp_path, "import sys\nprint('fine')\nsys.exit(0)\n", name="ok.py")
    status, out, err = _run(capsys, "--nproc-per-node", "2", str(ok))
    assert (status, _lines(out, 0), _lines(out, 1), err) == (0, ["fine"], ["fine"], "")
    status, out, err = _run(capsys, "--nproc-per-node", "3", str(_program(tmp_path, _FAILING)))
    assert status == 1
    assert [_lines(out, r) for r in range(3)] == [["hello from 0"], ["hello from 1"], ["hello from 2"]]


def test_a_failure_prints_the_workers_traceback_and_torchruns_failure_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(tmp_path, _FAILING)
    status, _, err = _run(capsys, "--nproc-per-node", "3", "--seed", "4", str(prog), "x y")
    assert status == 1
    rank2 = _lines(err, 2)
    assert rank2[0] == "Traceback (most recent call last):"
    assert rank2[1].startswith(f'  File "{prog}", line 8, in <module>')  # the program's frame first
    assert rank2[-1] == "ValueError: boom on rank 2"
    assert _lines(err, 0) == [] and _lines(err, 1) == []
    summary = err[err.index("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:") :]
    assert f"{prog} FAILED" in summary
    # Both failures, each with its rank and exit code, as torchrun prints them.
    assert re.search(r"rank      : 1 \(local_rank: 1\)\n  exitcode  : 3 \(pid: \d+\)", summary), summary
    assert re.search(r"rank      : 2 \(local_rank: 2\)\n  exitcode  : 1 \(pid: \d+\)", summary), summary
    assert "Root Cause (first observed failure)" in summary
    assert (
        f"replay this run with: python -m twinrpc.simulator run --nproc-per-node 3 --seed 4 {prog} 'x y'"
        in err
    )


def test_a_record_decorated_entry_point_puts_its_traceback_into_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch's ``@record`` writes the error file torchrun points each worker at."""
    prog = _program(
        tmp_path,
        """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise RuntimeError("recorded failure")

        main()
        """,
    )
    status, _, err = _run(capsys, "--nproc-per-node", "1", str(prog))
    assert status == 1
    summary = err[err.index("ChildFailedError:") :]
    assert "error_file: <N/A>" not in summary and "/0/error.json" in summary
    assert "RuntimeError: recorded failure" in summary


def test_the_command_exits_with_the_status_and_the_output_of_torchrun(tmp_path: Path) -> None:
    prog = _program(tmp_path, _FAILING)
    cmd = [sys.executable, "-m", "twinrpc.simulator", "run", "--nproc-per-node", "3", str(prog)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        "[rank0]:hello from 0",
        "[rank1]:hello from 1",
        "[rank2]:hello from 2",
    ]
    assert "[rank2]:ValueError: boom on rank 2" in proc.stderr
    assert "ChildFailedError" in proc.stderr


def test_a_process_that_exits_without_shutdown_is_a_dead_peer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its connections close: the other worker's calls to it fail, as with a real process."""
    prog = _program(
        tmp_path,
        """
        import os, time
        import torch.distributed.rpc as rpc
        rank = int(os.environ["RANK"])
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
        if rank == 1:
            raise SystemExit(0)          # leaves without rpc.shutdown()
        time.sleep(1)
        try:
            rpc.rpc_sync("w1", os.getpid)
        except RuntimeError as exc:
            print(type(exc).__name__, "unavailable" in str(exc))
        """,
    )
    status, out, err = _run(capsys, "--nproc-per-node", "2", str(prog))
    assert _lines(out, 0) == ["WorkerUnavailableError True"], err
    assert status == 0


def test_a_fault_plan_crash_kills_the_workers_rpc_process_with_sigkill(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--faults: worker 1 crashes at t=0.5 s; its peer sees it die, the summary shows the signal."""
    faults = tmp_path / "faults.toml"
    faults.write_text('[[faults]]\ntype = "crash"\nworker = 1\nat = 0.5\n')
    prog = _program(
        tmp_path,
        """
        import os, time
        import torch.distributed.rpc as rpc
        rank = int(os.environ["RANK"])
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
        time.sleep(1)
        if rank == 0:
            try:
                rpc.rpc_sync("w1", os.getpid)
            except RuntimeError as exc:
                print(type(exc).__name__)
        """,
    )
    status, out, err = _run(capsys, "--nproc-per-node", "2", "--faults", str(faults), str(prog))
    assert status == 1
    assert _lines(out, 0) == ["WorkerUnavailableError"], err
    assert re.search(r"rank      : 1 \(local_rank: 1\)\n  exitcode  : -9 \(pid: \d+\) +\(SIGKILL\)", err), err
    assert f"--faults {faults}" in err  # in the replay command


def test_a_hang_is_reported_with_the_blocked_tasks_and_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(
        tmp_path,
        """
        import os
        import torch.distributed.rpc as rpc
        rank = int(os.environ["RANK"])
        if rank == 0:
            rpc.init_rpc("w0", rank=0, world_size=2)   # rank 1 never joins
        """,
    )
    status, _, err = _run(capsys, "--nproc-per-node", "2", str(prog))
    assert status == 1
    assert "the simulation hung" in err and "deadlock" in err
    assert "rank(s) [0] did not exit" in err


# -- processes started by a worker ------------------------------------------------------------------------
def test_processes_started_with_multiprocessing_are_simulated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(
        tmp_path,
        """
        import os, sys
        import multiprocessing
        import torch.multiprocessing as mp
        import torch.distributed.rpc as rpc

        state = []

        def child(rank, code):
            state.append("child")                  # forked: the parent's modules
            rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
            print("child of", os.environ["RANK"], "sees", rpc.get_worker_info().name)
            rpc.shutdown()
            sys.exit(code)

        def spawned(i, tag):
            print("spawned", i, tag, state)        # spawned: fresh modules, so state is []
            if tag == "fail":
                raise KeyError("from the spawned process")

        if __name__ == "__main__":
            rank = int(os.environ["RANK"])
            p = mp.Process(target=child, args=(rank, 5 + rank))
            p.start()
            p.join()
            print("exitcode", p.exitcode, "alive", p.is_alive(), "state", state)
            mp.spawn(spawned, args=("ok",), nprocs=2)
            try:
                mp.spawn(spawned, args=("fail",), nprocs=1)
            except mp.ProcessRaisedException as exc:
                print("raised", "KeyError: 'from the spawned process'" in str(exc))
            ctx = multiprocessing.get_context("spawn")
            q = ctx.Process(target=spawned, args=(9, "ctx"))
            q.start(); q.join()
            print("spawn context exitcode", q.exitcode)
        """,
    )
    status, out, err = _run(capsys, "--nproc-per-node", "2", str(prog))
    assert status == 0, err
    for r in range(2):
        lines = _lines(out, r)
        # mp.spawn's two processes run concurrently: either may print first, as in real processes
        lines[2:4] = sorted(lines[2:4])
        assert lines == [
            f"child of {r} sees w{r}",
            f"exitcode {5 + r} alive False state ['child']",
            "spawned 0 ok []",
            "spawned 1 ok []",
            "spawned 0 fail []",
            "raised True",
            "spawned 9 ctx []",
            "spawn context exitcode 0",
        ], err


# -- warnings ---------------------------------------------------------------------------------------------
def _reads_the_clock_and_starts_a_thread(rank: int) -> None:
    for _ in range(3):  # once per call site, however often it runs
        time.time()
        time.sleep(0)
    threading.Thread(target=lambda: None).start()


def test_plain_simulation_warns_once_per_call_site_when_the_program_reads_the_wall_clock() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Simulation(world_size=2, seed=0).run(_reads_the_clock_and_starts_a_thread)
    mine = [w for w in caught if issubclass(w.category, SimulationWarning)]
    here = Path(__file__).name
    sites = sorted(
        (Path(w.filename).name, w.lineno, str(w.message).split(": ", 1)[1].split(" ")[0]) for w in mine
    )
    line = _reads_the_clock_and_starts_a_thread.__code__.co_firstlineno
    assert sites == [
        (here, line + 2, "time.time()"),
        (here, line + 3, "time.sleep()"),
        (here, line + 4, "threading.Thread.start()"),
    ]
    assert all(str(w.message).startswith(f"{__file__}:{w.lineno}: ") for w in mine)
    assert "breaks determinism" in str(mine[0].message)
    # Outside a simulation: the real functions, no warnings.
    assert time.time is _REAL["time"] and threading.Thread.start is _REAL["start"]


def test_a_thread_started_by_a_program_under_the_command_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(
        tmp_path,
        """
        import threading, time
        t = threading.Thread(target=print, args=("from a thread",))
        t.start()
        t.join()
        print("virtual", time.time() < 1.8e9)
        """,
    )
    with pytest.warns(SimulationWarning) as caught:
        status, out, _ = _run(capsys, "--nproc-per-node", "1", str(prog))
    assert status == 0
    assert [str(w.message).split(" inside")[0] for w in caught] == [
        f"{prog}:4: threading.Thread.start() starts an OS thread"
    ]
    assert "[rank0]:from a thread" in out and "[rank0]:virtual True" in out


# -- replay ------------------------------------------------------------------------------------------------
def test_the_same_seed_replays_the_same_output_and_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(
        tmp_path,
        """
        import os, random, time
        import torch
        import torch.distributed.rpc as rpc
        rank = int(os.environ["RANK"])
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=3)
        futs = [rpc.rpc_async(f"w{(rank + k) % 3}", time.time) for k in range(1, 3) for _ in range(3)]
        print([round(f.wait() % 1, 6) for f in futs], random.random(), torch.rand(1).item())
        rpc.shutdown()
        """,
    )
    runs = []
    for i in range(2):
        trace = tmp_path / f"trace{i}.jsonl"
        status, out, _ = _run(
            capsys, "--nproc-per-node", "3", "--seed", "11", "--trace", str(trace), str(prog)
        )
        assert status == 0
        runs.append((out, trace.read_bytes()))
    assert runs[0] == runs[1]
    assert runs[0][1].count(b"\n") > 50


_CHOSEN_PAUSES = """
    import os, random, sys, time
    import torch.distributed.rpc as rpc

    def echo(x):
        return x

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        for _ in range(3):
            if sys.argv[1] == "urandom":  # entropy the command cannot seed
                pause = int.from_bytes(os.urandom(8), "little") / 2**64
            else:  # Python's generator, seeded from --seed by the command
                pause = random.random()
            time.sleep(pause)
            rpc.rpc_sync("w1", echo, args=(pause,))
        print("rank 0 done")
    rpc.shutdown()
    """


def test_check_determinism_runs_twice_and_passes_a_program_whose_randomness_the_seed_fixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(tmp_path, _CHOSEN_PAUSES)
    trace = tmp_path / "trace.jsonl"
    status, out, err = _run(
        capsys, "--nproc-per-node", "2", "--check-determinism", "--trace", str(trace), str(prog), "seeded"
    )
    assert status == 0, err
    assert out.splitlines() == ["[rank0]:rank 0 done"]  # the second run's output is not shown
    events = trace.read_bytes().count(b"\n") - 1  # the header line, then one line per event
    assert f"deterministic: two runs with seed 0 recorded the same {events} trace events" in err


def test_check_determinism_prints_the_first_divergence_of_a_program_reading_os_urandom(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(tmp_path, _CHOSEN_PAUSES)
    status, out, err = _run(capsys, "--nproc-per-node", "2", "--check-determinism", str(prog), "urandom")
    assert status == 1
    assert out.splitlines() == ["[rank0]:rank 0 done"]  # the program itself succeeded
    assert "the run is not deterministic: two runs with seed 0 differ" in err
    assert "os.urandom" in err
    # The first difference is where rank 0 wakes from its first sleep, at a different time in each run.
    m = re.search(
        r"run 1: #(\d+) ([0-9.]+) w0 switch main\[0\].*\n  run 2: #\1 ([0-9.]+) w0 switch main", err
    )
    assert m is not None, err
    assert m.group(2) != m.group(3)
    assert "context in run 1:" in err and "context in run 2:" in err


def test_check_determinism_reports_a_failing_run_with_its_own_status_when_it_fails_the_same_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(tmp_path, "import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    status, _, err = _run(capsys, "--nproc-per-node", "2", "--check-determinism", str(prog))
    assert status == 1
    assert err.count("ChildFailedError") == 1  # the first run's report only
    assert "deterministic: two runs with seed 0" in err


# -- the running simulation -----------------------------------------------------------------------------
_FAULTS_ON_ITS_OWN_RUN = """
    import os, sys, time
    import torch.distributed.rpc as rpc
    import twinrpc.simulator

    def echo(x):
        return x

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        sim = twinrpc.simulator.current()
        print(f"{type(sim).__name__} of {sim.world_size} workers")
        if sys.argv[1] == "pause":
            sim.pause(1, 5.0)
            start = time.time()
            rpc.rpc_sync("w1", echo, args=(1,))
            print(f"w1 answered after {time.time() - start:.1f} s")
        else:
            sim.crash(1)
            try:
                rpc.rpc_sync("w1", echo, args=(1,))
            except RuntimeError as exc:
                print(f"w1 failed: {type(exc).__name__}")
            rpc.shutdown(graceful=False)
            sys.exit(0)
    rpc.shutdown()
    """


def test_a_program_under_run_pauses_a_peer_through_the_current_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(tmp_path, _FAULTS_ON_ITS_OWN_RUN)
    status, out, err = _run(capsys, "--nproc-per-node", "2", str(prog), "pause")
    assert status == 0, err
    assert _lines(out, 0) == ["Simulation of 2 workers", "w1 answered after 5.0 s"]


def test_a_program_under_run_crashes_a_peer_through_the_current_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = _program(tmp_path, _FAULTS_ON_ITS_OWN_RUN)
    status, out, err = _run(capsys, "--nproc-per-node", "2", str(prog), "crash")
    assert status == 1  # rank 1 was killed
    assert _lines(out, 0) == ["Simulation of 2 workers", "w1 failed: WorkerUnavailableError"]
    assert re.search(r"rank\s+: 1 .*\n\s+exitcode\s+: -9 .*\(SIGKILL\)", err), err


_SEEN: list[object] = []


def _note_current_simulation() -> bool:
    _SEEN.append(twinrpc.simulator.current())
    return True


def test_current_is_the_simulation_in_any_of_its_tasks_and_none_outside() -> None:
    seen = _SEEN
    seen.clear()

    def program(rank: int) -> None:
        seen.append(twinrpc.simulator.current())
        twinrpc.rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
        assert twinrpc.rpc.rpc_sync(f"w{1 - rank}", _note_current_simulation)  # in an RPC handler
        twinrpc.rpc.shutdown()

    assert twinrpc.simulator.current() is None
    sim = Simulation(2, seed=3)
    sim.run(program).values()
    assert seen == [sim] * 4  # both programs and both handlers
    assert twinrpc.simulator.current() is None


def test_a_compute_file_makes_computation_take_virtual_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Rank 0 computes, then calls rank 1: the call leaves once the computation's cost has passed on
    # rank 0, so rank 1's clock when it serves the call is that much later.
    prog = _program(
        tmp_path,
        """
        import os, time
        import torch
        import torch.distributed.rpc as rpc
        rank = int(os.environ["RANK"])
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        if rank == 0:
            rpc.rpc_sync("worker1", abs, args=(1,))  # makes the link (links are made on first use)
            a = torch.rand(64, 64)
            t0 = time.monotonic()
            for _ in range(10):
                a = torch.mm(a, a)
            print(f"served after {rpc.rpc_sync('worker1', time.monotonic) - t0!r}")
        rpc.shutdown()
        """,
    )

    def served_after(*options: str) -> float:
        status, out, _ = _run(capsys, "--nproc-per-node", "2", *options, str(prog))
        assert status == 0, out
        return float(re.search(r"served after (\S+)", out).group(1))  # type: ignore[union-attr]

    free = served_after()
    compute = tmp_path / "compute.toml"
    twinrpc.simulator.ComputeModel(op_cost=1e-6, flop_cost=1e-9).dump(compute)
    costed = served_after("--compute", str(compute))
    # ten products of 2 * 64**3 FLOPs at 1 ns each, plus 1 us for each of the eleven operators (the
    # products and torch.rand: the worker is busy from its first operator on)
    assert costed - free == pytest.approx(10 * 2 * 64**3 * 1e-9 + 11 * 1e-6, rel=1e-6)
    bad = tmp_path / "bad.json"
    bad.write_text('{"op_cost": 1e-6, "flops": 2}')
    assert main(["run", "--compute", str(bad), str(prog)]) == 2
    assert "--compute" in (err := capsys.readouterr().err) and "unknown field 'flops'" in err
    replay = LaunchOptions(program="p.py", nproc_per_node=2, compute="c.toml").replay_command()
    assert replay == "python -m twinrpc.simulator run --nproc-per-node 2 --seed 0 --compute c.toml p.py"


# -- bad input -----------------------------------------------------------------------------------------------
def test_bad_input_is_refused_with_a_message_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "can't open file" in capsys.readouterr().err
    bad = tmp_path / "net.json"
    bad.write_text('{"latency": 1, "speed": 2}')
    prog = _program(tmp_path, "print(1)\n")
    assert main(["run", "--network", str(bad), str(prog)]) == 2
    assert "speed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--nproc-per-node", "0", str(prog)])
    assert "--nproc-per-node must be at least 1, got 0" in capsys.readouterr().err
