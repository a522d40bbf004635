"""A program's own launcher under ``python -m twinrpc.simulator run``.

PyTorch's RPC examples start their workers themselves: ``torch.multiprocessing.spawn(fn, nprocs=W)``,
or ``mp.Process(...)`` + ``start``/``join``. Run with ``--nproc-per-node 1``, such a program gets W
simulated processes, each joining RPC as the rank it asks for (docs/howto/run-a-program.md). Each
test writes a small program, runs it through the launch API (one through the command line), and
checks what it printed and how the run ended; the runs are seeded, so the same seed gives the same
trace.
"""

from __future__ import annotations

import contextvars
import io
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from twinrpc.simulator._kernel._scheduler import Scheduler
from twinrpc.simulator._launch._launch import LaunchOptions, LaunchResult, launch

#: an RPC worker as the tutorials write it: rank 0 asks every peer who it is, all shut down
WORKER = """
import os, sys
import torch
import torch.distributed.rpc as rpc

def whoami():
    return rpc.get_worker_info().name, os.environ["MY_RANK"]

def run_worker(rank, world_size, tag="worker"):
    os.environ["MASTER_ADDR"] = "localhost"    # set per process, as the tutorials do
    os.environ["MASTER_PORT"] = "29500"
    os.environ["MY_RANK"] = str(rank)
    rpc.init_rpc(f"{tag}{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        # each peer answers from its own process: its own name and its own environment
        print(tag, [rpc.rpc_sync(f"{tag}{peer}", whoami) for peer in range(world_size)])
        last = f"{tag}{world_size - 1}"
        print(tag, "sum", rpc.rpc_sync(last, torch.add, args=(torch.ones(2), world_size)).tolist())
    rpc.shutdown()
"""


def _launch(tmp_path: Path, source: str, *, nproc: int = 1, seed: int = 0) -> tuple[LaunchResult, str, str]:
    program = tmp_path / "prog.py"
    program.write_text(textwrap.dedent(source))
    out, err = io.StringIO(), io.StringIO()
    options = LaunchOptions(program=str(program), nproc_per_node=nproc, seed=seed)
    result = launch(options, stdout=out, stderr=err)
    return result, out.getvalue(), err.getvalue()


def _lines(text: str, rank: int = 0) -> list[str]:
    prefix = f"[rank{rank}]:"
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def _names(tag: str, n: int) -> str:
    return f"{tag} " + repr([(f"{tag}{r}", str(r)) for r in range(n)])


def test_mp_spawn_gives_each_process_its_own_rank_and_environment(tmp_path: Path) -> None:
    source = (
        WORKER
        + """
if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(run_worker, args=(3,), nprocs=3, join=True)
    print("parent sees MY_RANK", os.environ.get("MY_RANK"))
"""
    )
    result, out, err = _launch(tmp_path, source)
    assert result.status == 0, err
    assert _lines(out) == [_names("worker", 3), "worker sum [4.0, 4.0]", "parent sees MY_RANK None"]
    again, out_again, _ = _launch(tmp_path, source)
    assert again.trace.digest() == result.trace.digest() and out_again == out


def test_mp_spawn_without_join_returns_a_context_to_join(tmp_path: Path) -> None:
    result, out, err = _launch(
        tmp_path,
        WORKER
        + """
if __name__ == "__main__":
    import torch.multiprocessing as mp
    context = mp.spawn(run_worker, args=(2,), nprocs=2, join=False)
    print("pids", len(set(context.pids())), os.getpid() not in context.pids())
    while not context.join():
        pass
    print("joined", [p.exitcode for p in context.processes])
""",
    )
    assert result.status == 0, err
    assert _lines(out) == ["pids 2 True", _names("worker", 2), "worker sum [3.0, 3.0]", "joined [0, 0]"]


@pytest.mark.parametrize(
    "make_processes",
    [
        "import torch.multiprocessing as mp",
        "import multiprocessing as mp",
        "import multiprocessing; mp = multiprocessing.get_context('spawn')",
    ],
    ids=["torch.multiprocessing", "multiprocessing", "get_context-spawn"],
)
def test_processes_started_and_joined_by_the_program_join_rpc_as_their_ranks(
    tmp_path: Path, make_processes: str
) -> None:
    result, out, err = _launch(
        tmp_path,
        WORKER
        + f"""
def run_and_exit(rank, world_size):
    run_worker(rank, world_size)
    sys.exit(3 if rank == 1 else 0)

if __name__ == "__main__":
    {make_processes}
    processes = [mp.Process(target=run_and_exit, args=(rank, 2)) for rank in range(2)]
    for p in processes:
        p.start()
    pids = {{p.pid for p in processes}}
    print("started", [p.is_alive() for p in processes], len(pids), os.getpid() not in pids)
    for p in processes:
        p.join()
    print("joined", [p.is_alive() for p in processes], [p.exitcode for p in processes])
""",
    )
    assert result.status == 0, err
    assert _lines(out) == [
        "started [True, True] 2 True",
        _names("worker", 2),
        "worker sum [3.0, 3.0]",
        "joined [False, False] [0, 3]",
    ]


def test_spawns_in_a_row_are_each_a_new_world(tmp_path: Path) -> None:
    source = (
        WORKER
        + """
if __name__ == "__main__":
    import torch.multiprocessing as mp
    for tag, n in (("a", 2), ("b", 3), ("c", 1), ("d", 2)):
        mp.spawn(run_worker, args=(n, tag), nprocs=n)
"""
    )
    result, out, err = _launch(tmp_path, source, seed=3)
    assert result.status == 0, err
    expected = []
    for tag, n in (("a", 2), ("b", 3), ("c", 1), ("d", 2)):
        expected += [_names(tag, n), f"{tag} sum [{n + 1.0}, {n + 1.0}]"]
    assert _lines(out) == expected
    assert _launch(tmp_path, source, seed=3)[0].trace.digest() == result.trace.digest()


@pytest.mark.parametrize("failing", [0, 2], ids=["before-its-siblings-start", "after"])
def test_a_failing_spawned_process_raises_process_raised_exception_in_the_parent(
    tmp_path: Path, failing: int
) -> None:
    """Its siblings, blocked in init_rpc waiting for it, are terminated; the parent gets its error."""
    result, out, err = _launch(
        tmp_path,
        WORKER
        + f"""
def fail_or_work(rank, world_size):
    if rank == {failing}:
        raise ValueError(f"boom in process {{rank}}")
    run_worker(rank, world_size)

if __name__ == "__main__":
    import torch.multiprocessing as mp
    try:
        mp.spawn(fail_or_work, args=(3,), nprocs=3)
    except mp.ProcessRaisedException as exc:
        print(type(exc).__name__, exc.error_index, isinstance(exc.error_pid, int))
        print(str(exc).splitlines()[-1])
    mp.spawn(fail_or_work, args=(3,), nprocs=3)     # uncaught: the run fails with it
""",
    )
    assert result.status == 1
    lines = _lines(out)
    assert lines == [
        f"ProcessRaisedException {failing} True",
        f"ValueError: boom in process {failing}",
    ]
    assert f"-- Process {failing} terminated with the following error:" in err
    assert 'raise ValueError(f"boom in process {rank}")' in err
    assert "hung" not in err and "deadlock" not in err


def test_siblings_killed_before_they_start_never_run_and_the_error_ends_the_run(tmp_path: Path) -> None:
    """Process 0 fails at once; whether its siblings have started when mp.spawn terminates them
    depends on the seed. Over the seeds, some are killed before they start: they exit by SIGTERM
    without running, and every run ends with process 0's error, never a hang."""
    source = """
    import torch.distributed.rpc as rpc
    import torch.multiprocessing as mp

    def run(rank, world_size):
        if rank == 0:
            raise ValueError("boom in process 0")
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
        rpc.shutdown()

    if __name__ == "__main__":
        mp.spawn(run, args=(3,), nprocs=3)
    """
    never_started = []
    for seed in range(12):
        result, _, err = _launch(tmp_path, source, seed=seed)
        assert result.status == 1
        assert "-- Process 0 terminated with the following error:" in err and "boom in process 0" in err
        assert "hung" not in err and "deadlock" not in err
        events = [(e.event, e.detail) for e in result.trace.events() if e.event.startswith("process-")]
        started = {d.split()[1] for kind, d in events if kind == "process-start"}
        for kind, detail in events:
            if kind == "process-exit" and detail.split()[1] not in started:
                never_started.append((seed, detail))
    assert never_started, "no seed killed a process before it started: the case is not exercised"
    assert all(detail.endswith(f"exit code {-signal.SIGTERM}") for _, detail in never_started), never_started


def test_a_failing_process_prints_its_traceback_and_a_hang_it_causes_shows_it(tmp_path: Path) -> None:
    """mp.Process: exit code 1 and the traceback; its sibling then waits in init_rpc forever, as it
    would for real, and the hang's report shows the error that caused it."""
    result, out, err = _launch(
        tmp_path,
        WORKER
        + """
def fail_or_work(rank, world_size):
    if rank == 1:
        raise KeyError("rank 1 never joins")
    run_worker(rank, world_size)

if __name__ == "__main__":
    import multiprocessing as mp
    lone = mp.Process(target=fail_or_work, args=(1, 1))
    lone.start(); lone.join()
    print("exitcode", lone.exitcode)
    processes = [mp.Process(target=fail_or_work, args=(rank, 2)) for rank in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
""",
    )
    assert result.status == 1
    assert _lines(out) == ["exitcode 1"]
    assert "[rank0]:Process Process-1:" in err and "[rank0]:KeyError: 'rank 1 never joins'" in err
    assert "the simulation hung" in err
    report = err[err.index("the simulation hung") :]
    assert "started by pid" in report and "KeyError: 'rank 1 never joins'" in report


def test_start_method_is_per_simulated_process(tmp_path: Path) -> None:
    """Each rank's main process sets its own; a spawned child gets its parent's (and a context's
    process its context's), and starting one fixes the parent's, as in Python."""
    result, out, err = _launch(
        tmp_path,
        """
        import multiprocessing
        import torch.multiprocessing as mp

        def show(i, *_):
            print("child", i, mp.get_start_method(allow_none=True))

        if __name__ == "__main__":
            mp.set_start_method("spawn")
            print("main", mp.get_start_method())
            mp.spawn(show, nprocs=1)
            forked = multiprocessing.get_context("fork").Process(target=show, args=(1,))
            forked.start(); forked.join()
            try:
                mp.set_start_method("fork")
            except RuntimeError as exc:
                print("again:", exc)
        """,
        nproc=2,
    )
    assert result.status == 0, err
    for rank in range(2):
        assert _lines(out, rank) == [
            "main spawn",
            "child 0 spawn",
            "child 1 fork",
            "again: context has already been set",
        ], err


def test_a_rank_joins_from_one_process_at_a_time(tmp_path: Path) -> None:
    result, out, err = _launch(
        tmp_path,
        """
        import torch.distributed.rpc as rpc
        import torch.multiprocessing as mp

        def also_rank_0(i):
            rpc.init_rpc("again", rank=0, world_size=1)

        if __name__ == "__main__":
            rpc.init_rpc("main", rank=0, world_size=1)
            try:
                mp.spawn(also_rank_0, nprocs=1)
            except mp.ProcessRaisedException as exc:
                print(str(exc).splitlines()[-1])
            rpc.shutdown()
        """,
    )
    assert result.status == 0, err
    [line] = _lines(out)
    assert line.startswith("RuntimeError: init_rpc(rank=0) in simulated process pid ")
    assert "rank 0 already runs RPC in simulated process pid 1001" in line


def test_the_command_runs_a_tutorial_shaped_program_with_its_own_launcher(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text(
        WORKER
        + """
if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.set_start_method("spawn")
    mp.spawn(run_worker, args=(2,), nprocs=2, join=True)
"""
    )
    cmd = [sys.executable, "-m", "twinrpc.simulator", "run", "--nproc-per-node", "1", str(program)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[rank0]:" + _names("worker", 2), "[rank0]:worker sum [3.0, 3.0]"]


def test_the_scheduler_never_starts_a_task_stopped_before_it_started() -> None:
    """A process killed before its main task ran (its sibling failed first) stays dead."""
    sched = Scheduler(0)
    ran: list[str] = []
    victim = sched.spawn(0, contextvars.Context(), "victim", ran.append, ("victim",))
    sched.spawn(0, contextvars.Context(), "other", ran.append, ("other",))
    victim.done = True
    sched.tasks.pop(victim.id)
    sched.schedule(1.0, lambda _: ran.append("later"))
    sched.run(until=lambda: "later" in ran)
    assert ran == ["other", "later"]


def test_a_process_without_a_rank_argument_joins_as_the_rank_in_its_environment(tmp_path: Path) -> None:
    """init_rpc without rank reads RANK, as env:// does; each process sets its own."""
    result, out, err = _launch(
        tmp_path,
        """
        import os
        import torch.distributed.rpc as rpc
        import torch.multiprocessing as mp

        def run(i):
            os.environ["RANK"] = str(1 - i)
            rpc.init_rpc(f"w{1 - i}", world_size=2)
            print(i, rpc.get_worker_info().id, os.environ["RANK"])
            rpc.shutdown()

        if __name__ == "__main__":
            mp.spawn(run, nprocs=2)
            print("parent RANK", os.environ["RANK"])
        """,
    )
    assert result.status == 0, err
    assert sorted(_lines(out)[:2]) == ["0 1 1", "1 0 0"] and _lines(out)[2] == "parent RANK 0"


def test_spawned_processes_set_up_their_own_process_groups_before_joining_rpc(tmp_path: Path) -> None:
    """The DDP-beside-RPC tutorial's order: trainers init_process_group first, then init_rpc; c10d's
    state is each process's, so the two trainers' groups do not collide on their parent's worker.
    The gradients are PyTorch's: the mean of 1 and 2 over DDP's all-reduce."""
    result, out, err = _launch(
        tmp_path,
        """
        import os
        import torch
        import torch.distributed as dist
        import torch.distributed.rpc as rpc
        import torch.multiprocessing as mp
        from torch.nn.parallel import DistributedDataParallel as DDP

        def run_worker(rank, world_size):
            if rank <= 1:
                dist.init_process_group("gloo", rank=rank, world_size=2, init_method="tcp://localhost:29501")
                model = DDP(torch.nn.Linear(2, 1))
                model(torch.ones(1, 2) * (rank + 1)).sum().backward()
                print("trainer", rank, model.module.weight.grad.tolist())
            rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
            if rank == 2:
                print("master", rpc.rpc_sync("w0", torch.add, args=(torch.ones(1), 1)).tolist())
            rpc.shutdown()
            if rank <= 1:
                dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(run_worker, args=(3,), nprocs=3)
        """,
    )
    assert result.status == 0, err
    assert sorted(_lines(out)) == ["master [2.0]", "trainer 0 [[1.5, 1.5]]", "trainer 1 [[1.5, 1.5]]"]


#: each process seeds its own generators, then draws after the others have seeded theirs
RANDOM_STATE = """
import random
import numpy as np
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

def draw():
    return (torch.rand(2).tolist(), random.random(), float(np.random.rand()))

def run_worker(rank, world_size):
    torch.manual_seed(rank)
    random.seed(rank)
    np.random.seed(rank)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)  # every process runs in between
    if rank == 0:
        print("draws", [rpc.rpc_sync(f"worker{r}", draw) for r in range(world_size)])
    rpc.shutdown()

def forked_child(queue_path):
    with open(queue_path, "w") as f:
        f.write(repr(torch.rand(1).tolist()))

if __name__ == "__main__":
    mp.spawn(run_worker, args=(3,), nprocs=3, join=True)
    torch.manual_seed(7)
    ctx = mp.get_context("fork")
    child = ctx.Process(target=forked_child, args=("forked.txt",))
    child.start()
    child.join()
    print("parent", torch.rand(1).tolist(), "child", open("forked.txt").read())
"""


def test_each_simulated_process_has_its_own_random_generators(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    import numpy as np
    import torch

    monkeypatch.chdir(tmp_path)
    result, out, err = _launch(tmp_path, RANDOM_STATE)
    assert result.status == 0, err
    (draws, forked) = _lines(out)
    expected = []
    for rank in range(3):
        torch_draw = torch.Generator().manual_seed(rank)
        expected.append(
            (
                torch.rand(2, generator=torch_draw).tolist(),
                random.Random(rank).random(),
                np.random.RandomState(rank).rand(),
            )
        )
    assert draws == f"draws {expected!r}"  # as three real processes print: each its own seed
    seven = torch.rand(2, generator=torch.Generator().manual_seed(7)).tolist()
    # fork copies the parent's generator: the child draws what the parent would have drawn next
    assert forked == f"parent {[seven[0]]!r} child {[seven[0]]!r}"
