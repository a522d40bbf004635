"""Scale under torchrun: what a worker costs at 8 to 64 workers on one host, twinrpc against TensorPipe.

Each launch is ``torchrun --standalone --nproc-per-node N`` of this script (``--worker``) with one system.
Every worker times ``init_rpc``, then a first ``rpc_sync`` to each peer it talks to (every other worker,
or in the ``2 peers`` variant only its two neighbours, rank - 1 and rank + 1), then ``--calls`` more calls
to one peer (their median), waits at a barrier (a file per worker) until every worker is done calling,
reads its threads (``/proc/self/task``, by role; and the most it held from ``init_rpc`` until then,
sampled every 50 ms), and ``--settle`` seconds later its threads again (by role),
descriptors (``/proc/self/fd``) and resident memory (``VmRSS``); then it times ``rpc.shutdown()``, and
reads its threads and descriptors once more. The job's figures:
the slowest worker's times (the job waits for it) and the largest counts of any worker; the call to one
peer is the median over the workers.

The figures (``--json``) are twinrpc / TensorPipe per size and variant: init + first calls + shutdown
(target <= 1: faster than TensorPipe), and the threads per process (twinrpc's bound is an absolute one,
reported beside the ratio). Launches alternate between the systems, ``--repeat`` times, and each figure
is the median of the rounds' ratios. A launch that fails (TensorPipe's workers take 0.4-0.7 GB each, so
a job of 32 or more can run out of memory) is reported as failed and the rest runs;
``--tensorpipe-up-to N`` runs TensorPipe only at sizes up to N.

    python benchmarks/bench_scale.py [--sizes 8 16 32 64] [--variants all 2] [--repeat 1]
        [--only twinrpc|tensorpipe] [--tensorpipe-up-to N] [--json FILE]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _cli
import _results  # benchmarks/_results.py (the script's directory is on sys.path)

SYSTEMS = ("twinrpc", "tensorpipe")
NAMES = {"twinrpc": "twinrpc", "tensorpipe": "TensorPipe"}
#: who a worker calls: every other worker, or its two neighbours
VARIANTS = {"all": "every peer", "2": "2 peers"}
#: a launch that takes longer has hung
LAUNCH_TIMEOUT = 900.0


def peers_of(rank: int, world_size: int, variant: str) -> list[int]:
    """The ranks ``rank`` calls: every other one, or its two neighbours (rank - 1 and rank + 1)."""
    if variant == "all":
        return [p for p in range(world_size) if p != rank]
    return sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})


def process_counts() -> dict[str, float]:
    """This process's threads, open descriptors and resident memory (MB), from /proc."""
    rss_kb = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_mb": rss_kb / 1024,
    }


def _barrier(folder: Path, name: str, rank: int, world_size: int, timeout: float = 600.0) -> None:
    """Wait until every worker has reached this point (a file per worker in ``folder``)."""
    (folder / f"{name}-{rank}").touch()
    deadline = time.monotonic() + timeout
    while sum(1 for p in folder.glob(f"{name}-*")) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker{rank}: not every worker reached {name!r}")
        time.sleep(0.01)


def echo(x: int) -> int:
    return x


def links_held() -> int | None:
    """How many peers this twinrpc worker holds a link to (None: TensorPipe)."""
    try:
        from twinrpc._current import current_agent

        return len(current_agent().world.links)  # type: ignore[attr-defined]
    except Exception:
        return None


def thread_roles() -> dict[str, int]:
    """This process's threads by role: Python threads by name (their number stripped), the rest by
    their kernel name (gloo's event loop, TensorPipe's and PyTorch's own threads)."""
    import re
    import threading

    python = {t.native_id: t.name for t in threading.enumerate()}
    roles: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = python.get(int(tid)) or Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        role = re.sub(r"([-_]?\d+)+$", "", name)
        roles[role] = roles.get(role, 0) + 1
    return roles


class PeakThreads:
    """The most threads this process holds while it runs, sampled every ``PEAK_EVERY`` seconds by a
    thread of its own (not counted): a burst between the counts read at fixed points shows here."""

    def __init__(self) -> None:
        import threading

        self.peak = 0
        #: the threads by role at the peak
        self.roles: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-peak", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PEAK_EVERY):
            n = len(os.listdir("/proc/self/task")) - 1
            if n > self.peak:
                self.peak = n
                self.roles = thread_roles()
                self.roles.pop("bench-peak", None)  # this thread

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


#: seconds between two samples of PeakThreads
PEAK_EVERY = 0.05


def worker(system: str, variant: str, calls: int, settle: float, folder: Path) -> None:
    """One torchrun worker: init, calls, counts, shutdown; writes ``folder/<rank>.json``."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("twinrpc.impl").setLevel(logging.ERROR)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if system == "twinrpc":
        import twinrpc.rpc as rpc

        opts: Any = rpc.RpcBackendOptions(init_method="env://")
    else:
        import torch.distributed.rpc as rpc

        opts = rpc.TensorPipeRpcBackendOptions(init_method="env://")
    counts_before = process_counts()
    peak = PeakThreads()
    t0 = time.perf_counter()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    t_init = time.perf_counter() - t0
    peers = peers_of(rank, world_size, variant)
    t0 = time.perf_counter()
    for p in peers:
        rpc.rpc_sync(f"worker{p}", echo, args=(rank,))
    t_first = time.perf_counter() - t0
    one = f"worker{peers[0]}"
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        rpc.rpc_sync(one, echo, args=(rank,))
        times.append(time.perf_counter() - t0)
    _barrier(folder, "called", rank, world_size)
    peak_threads = peak.stop()
    during = process_counts()
    during["roles"] = thread_roles()
    links = links_held()
    time.sleep(settle)
    settled = process_counts()
    settled["roles"] = thread_roles()
    _barrier(folder, "settled", rank, world_size)
    t0 = time.perf_counter()
    rpc.shutdown()
    t_shutdown = time.perf_counter() - t0
    after = process_counts()
    out = {
        "links": links,
        "init_s": t_init,
        "first_calls_s": t_first,
        "call_us": statistics.median(times) * 1e6,
        "shutdown_s": t_shutdown,
        "threads_peak": peak_threads,
        "roles_peak": peak.roles,
        "before": counts_before,
        "during": during,
        "settled": settled,
        "after": after,
    }
    (folder / f"{rank}.json").write_text(json.dumps(out))


def first_failure(stderr: str) -> str:
    """Why a torchrun job failed, from its output: the first worker's exception, or the first worker
    killed by a signal (torchrun ends the others with SIGTERM once one fails, and with SIGKILL those
    that do not exit in time; the kernel's OOM killer sends SIGKILL too)."""
    import re

    error = re.search(r"^(?!torch\.distributed\.elastic)[\w.]*(?:Error|Exception): .*$", stderr, re.M)
    if error:
        return error.group(0)[:500]
    killed = re.search(r"exitcode\s*: (-\d+) \(pid: \d+\)", stderr)
    if killed:
        return f"a worker ended by signal {-int(killed.group(1))}"
    return "no worker error found in its output"


def launch(system: str, size: int, variant: str, calls: int, settle: float) -> dict[str, Any]:
    """One torchrun job of ``size`` workers of ``system``; the job's figures (see the module doc)."""
    with tempfile.TemporaryDirectory(prefix="bench_scale-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        args = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={size}",
            __file__,
            "--worker",
            system,
            variant,
            str(calls),
            str(settle),
            tmp,
        ]
        t0 = time.perf_counter()
        done = subprocess.run(
            args, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, check=False
        )
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(
                f"torchrun exited with {done.returncode}: {first_failure(done.stderr)}"
                f"\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        workers = [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(size)]

    def slowest(key: str) -> float:
        return max(w[key] for w in workers)

    def most(when: str, key: str) -> float:
        return max(w[when][key] for w in workers)

    return {
        "init_s": slowest("init_s"),
        "first_calls_s": slowest("first_calls_s"),
        "shutdown_s": slowest("shutdown_s"),
        "total_s": max(w["init_s"] + w["first_calls_s"] + w["shutdown_s"] for w in workers),
        "call_us": statistics.median(w["call_us"] for w in workers),
        "threads_after_calls": most("during", "threads"),
        "threads_peak": slowest("threads_peak"),
        "roles_peak": max(workers, key=lambda w: w["threads_peak"])["roles_peak"],
        "threads": most("settled", "threads"),
        "fds": most("settled", "fds"),
        "rss_mb": most("settled", "rss_mb"),
        "roles": max((w["settled"]["roles"] for w in workers), key=lambda r: sum(r.values())),
        "roles_after_calls": max((w["during"]["roles"] for w in workers), key=lambda r: sum(r.values())),
        "threads_before_init": most("before", "threads"),
        "threads_after_shutdown": most("after", "threads"),
        "fds_after_shutdown": most("after", "fds"),
        "launch_wall_s": wall,
        "workers": workers,
    }


#: the figures each job gives (key, label, unit, target of the ratio twinrpc / TensorPipe); the
#: results page's table has the rest (TABLE)
FIGURES = (
    ("total_s", "init + first call to each peer + shutdown (slowest worker)", "s", ("<=", 1.0)),
    ("call_us", "a call to one peer (median worker)", "us", None),
    ("threads", "threads per process (most of any worker)", "threads", None),
    ("fds", "descriptors per process (most of any worker)", "fds", None),
    ("rss_mb", "resident memory per process (most of any worker)", "MB", None),
)


def figures(rounds: dict[tuple[int, str], list[dict[str, dict[str, Any]]]]) -> list[dict[str, Any]]:
    out = []
    for (size, variant), runs in sorted(rounds.items()):
        for key, label, unit, target in FIGURES:
            both = [r for r in runs if "twinrpc" in r and "tensorpipe" in r]
            values = {
                s: statistics.median(r[s][key] for r in runs if s in r)
                for s in SYSTEMS
                if any(s in r for r in runs)
            }
            if len(values) < 2:
                continue
            out.append(
                _results.figure(
                    f"{key}_{size}_{variant}",
                    f"{size} workers, {VARIANTS[variant]}: {label}",
                    unit,
                    False,
                    values,
                    [r["twinrpc"][key] / r["tensorpipe"][key] for r in both],
                    target,
                )
            )
    return out


#: what the results page's table shows of each job (medians over the rounds)
TABLE = (
    "init_s",
    "first_calls_s",
    "call_us",
    "shutdown_s",
    "threads_after_calls",
    "threads_peak",
    "threads",
    "fds",
    "rss_mb",
    "threads_after_shutdown",
    "fds_after_shutdown",
)


def table(rounds: dict[tuple[int, str], list[dict[str, dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One row per size, variant and system: the medians over the rounds, and the threads by role of
    the first round's busiest worker."""
    rows = []
    for (size, variant), runs in sorted(rounds.items()):
        for system in SYSTEMS:
            jobs = [r[system] for r in runs if system in r]
            if not jobs:
                continue
            row: dict[str, Any] = {"workers": size, "peers": VARIANTS[variant], "system": system}
            row.update({k: statistics.median(j[k] for j in jobs) for k in TABLE})
            row["roles"] = jobs[0]["roles"]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        system, variant, calls, settle, folder = argv[1:6]
        worker(system, variant, int(calls), float(settle), Path(folder))
        return 0
    p = _cli.parser(__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--calls", type=int, default=20, help="calls to one peer, after the first calls")
    p.add_argument(
        "--settle", type=float, default=5.0, help="seconds after the calls before the counts are read"
    )
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--only", choices=SYSTEMS)
    p.add_argument(
        "--tensorpipe-up-to",
        type=int,
        metavar="N",
        help="run TensorPipe only at sizes up to N (its workers take 0.4-0.7 GB each: 32 of them "
        "need about 20 GB)",
    )
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    machine = _results.machine()
    systems = [args.only] if args.only else list(SYSTEMS)
    rounds: dict[tuple[int, str], list[dict[str, dict[str, Any]]]] = {}
    #: launches that failed, each on a line
    failed: list[str] = []
    for size in args.sizes:
        for variant in args.variants:
            for i in range(args.repeat):
                here = [
                    s
                    for s in systems
                    if s != "tensorpipe" or args.tensorpipe_up_to is None or size <= args.tensorpipe_up_to
                ]
                order = here if i % 2 == 0 else here[::-1]
                got = {}
                for s in order:
                    try:
                        got[s] = launch(s, size, variant, args.calls, args.settle)
                    except RuntimeError as exc:  # e.g. workers killed for want of memory: the rest runs
                        failed.append(
                            f"{NAMES[s]}, {size} workers, {VARIANTS[variant]}: {str(exc).splitlines()[0]}"
                        )
                        print(failed[-1], flush=True)
                rounds.setdefault((size, variant), []).append(got)
                for s in got:
                    g = got[s]
                    print(
                        f"{size:3d} workers, {VARIANTS[variant]:10s} {NAMES[s]:10s} init {g['init_s']:6.2f} s"
                        f"  first calls {g['first_calls_s']:6.2f} s  call {g['call_us']:7.0f} us"
                        f"  shutdown {g['shutdown_s']:5.2f} s  threads {g['threads']:4.0f}"
                        f"  fds {g['fds']:5.0f}  RSS {g['rss_mb']:5.0f} MB"
                        f" (right after the calls {g['threads_after_calls']:.0f},"
                        f" most during init and calls {g['threads_peak']:.0f})"
                        f"  | after shutdown: threads {g['threads_after_shutdown']:.0f}"
                        f" fds {g['fds_after_shutdown']:.0f}\n    threads by role: {g['roles']}"
                        f"\n    right after the calls: {g['roles_after_calls']}"
                        f"\n    at the most: {g['roles_peak']}",
                        flush=True,
                    )
    figs = figures(rounds)
    for f in figs:
        print(_results.describe(f))
    if args.json:
        doc = _results.document(
            "bench_scale",
            "Scale under torchrun: init, first calls, threads, descriptors and memory as the job grows",
            "python benchmarks/bench_scale.py " + " ".join(argv),
            figs,
            rounds=args.repeat,
            extra={"scale": table(rounds), "failed": failed},
            machine_info=machine,
        )
        _results.write(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
