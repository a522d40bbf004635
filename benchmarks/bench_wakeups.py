"""Wake-ups, CPU and messages per operation: twinrpc (gloo world) against PyTorch RPC (TensorPipe).

Latency alone does not say where an operation's time goes. This profile counts, per operation and per
worker, what each system spends on it: wall time, CPU time of all threads, voluntary context switches
(each one a thread that blocked and had to be woken again), split by thread role (twinrpc's main
thread, receivers, request pool, timer, gloo's event loop; TensorPipe's threads grouped by name), and
for twinrpc the header frames and messages each worker sends.

Two loops, run on worker0 against worker1:

``remote``: ``rpc.remote("worker1", tiny_udf, args=(a, b)).to_here()`` with 1-element tensors.

``iteration``: a distributed-autograd iteration as in ``bench_dist_autograd.py``: ``rpc_sync`` of
``torch.matmul`` on two 256x256 tensors requiring grad, the distributed backward of the result's sum,
``get_gradients``.

The counters come from ``/proc/self/task/<tid>/`` (``status``: voluntary_ctxt_switches;
``schedstat``: CPU nanoseconds, or ``stat``'s utime+stime where schedstat is missing), read in each
worker before and after the measured operations; a thread that exited in between is covered by the
process's totals (``getrusage``), whose rest is reported as the role ``exited threads``.

Only one pair of processes is alive at a time (TensorPipe's reactor busy-polls a core even when idle),
so each launch starts a fresh pair of one system, runs ``--warmup`` operations and then ``--remote-ops``
(``--iterations``) measured ones of each loop; launches alternate between the systems ``--repeat``
times. Reported: medians over the launches; the figures are ratios twinrpc / TensorPipe (per repeat,
of its two back-to-back launches, then the median) of the wake-ups and of the CPU per operation, both
workers together. ``--json FILE`` writes them, and the detail tables, for the results page.

    python benchmarks/bench_wakeups.py [--remote-ops 2000] [--iterations 300] [--repeat 2]
        [--loop remote|iteration] [--only twinrpc|tensorpipe] [--json FILE]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import _cli
import _results  # benchmarks/_results.py (the script's directory is on sys.path)
from bench_gloo import _free_port, _init, link_frames, tiny_udf

SYSTEMS = ("twinrpc", "tensorpipe")
LOOPS = ("remote", "iteration")
LABELS = {
    "remote": 'rpc.remote("worker1", tiny_udf, args=(a, b)).to_here(), 1-element tensors',
    "iteration": "distributed-autograd iteration (rpc_sync(torch.matmul) of two 256x256 tensors "
    "requiring grad, backward, get_gradients)",
}
#: the loops as the figures name them
SHORT = {"remote": "remote() + to_here() of a tiny UDF", "iteration": "distributed-autograd iteration"}
NAMES = {"twinrpc": "twinrpc", "tensorpipe": "TensorPipe"}

#: a thread's counters: (name, CPU seconds, voluntary context switches)
ThreadCounters = tuple[str, float, int]
#: one reading of a process: its threads by id, and the process's totals (all threads, also those that
#: exited): (CPU seconds, voluntary context switches). Plain data: it crosses processes by pickle.
Snapshot = dict[str, Any]


# -- reading the counters (pure parts first: tests/bench/test_bench_wakeups.py) ------------------------------
def parse_wakeups(status: str) -> int:
    """``voluntary_ctxt_switches`` of a ``/proc/.../status`` text."""
    for line in status.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split(":", 1)[1])
    raise ValueError("no voluntary_ctxt_switches line in the status text")


def parse_stat_cpu(stat: str, ticks_per_second: int) -> float:
    """CPU seconds (utime + stime) of a ``/proc/.../stat`` text; the name in brackets may hold spaces
    and brackets, so the fields are counted after its last ``)``."""
    fields = stat.rsplit(")", 1)[1].split()
    # after the name: state is field 3 of proc(5), utime 14 and stime 15
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def parse_schedstat_cpu(schedstat: str) -> float:
    """CPU seconds of a ``/proc/.../schedstat`` text (its first field: nanoseconds on a CPU)."""
    return int(schedstat.split()[0]) / 1e9


_TWINRPC_ROLES = {"recv": "receiver", "send": "sender", "ring": "same-host ring"}


def role(name: str) -> str:
    """The role a thread of ``name`` plays: twinrpc's threads by what they do, gloo's event loop, the
    main thread; any other thread by its name without a trailing number (TensorPipe's ``TP_*``, torch's
    pools, threads left unnamed, which carry the process's name)."""
    if name == "MainThread":
        return "main"
    if name == "gloo_tcp_loop":
        return "gloo loop"
    twin = re.fullmatch(r"twinrpc-([a-z]+)(?:-.*)?", name)
    if twin:
        return _TWINRPC_ROLES.get(twin[1], twin[1])
    if re.fullmatch(r"Thread-\d+.*", name):  # Python's default names: Thread-N (target)
        return "Thread"
    return re.sub(r"[-_ #:.]*\d+$", "", name) or name


def snapshot() -> Snapshot:
    """This process's counters now: per living thread, and the process's totals."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    threads: dict[int, ThreadCounters] = {}
    for entry in os.listdir("/proc/self/task"):
        tid, base = int(entry), Path("/proc/self/task") / entry
        try:
            status = (base / "status").read_text()
            try:
                cpu = parse_schedstat_cpu((base / "schedstat").read_text())
            except (OSError, IndexError, ValueError):
                cpu = parse_stat_cpu((base / "stat").read_text(), tick)
            comm = (base / "comm").read_text().strip()
        except OSError:  # it exited meanwhile: the process's totals hold it
            continue
        threads[tid] = (names.get(tid, comm), cpu, parse_wakeups(status))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"threads": threads, "process": (usage.ru_utime + usage.ru_stime, usage.ru_nvcsw)}


EXITED = "exited threads"


def per_op(before: Snapshot, after: Snapshot, ops: int) -> dict[str, Any]:
    """CPU (us) and wake-ups per operation between two snapshots of one process: in total (the process's
    counters) and by role, and how many threads started (alive in ``after`` only) and exited (alive in
    ``before`` only) in between, over all ``ops``. A thread that appeared in between counts from zero;
    what the living threads do not account for (threads that exited in between, also one that came and
    went between the snapshots) is the role ``exited threads``."""
    roles: dict[str, list[float]] = {}
    for tid, (name, cpu, woken) in after["threads"].items():
        _, cpu0, woken0 = before["threads"].get(tid, (name, 0.0, 0))
        got = roles.setdefault(role(name), [0.0, 0.0])
        got[0] += cpu - cpu0
        got[1] += woken - woken0
    cpu_total = after["process"][0] - before["process"][0]
    woken_total = after["process"][1] - before["process"][1]
    rest_cpu = cpu_total - sum(c for c, _ in roles.values())
    rest_woken = woken_total - sum(w for _, w in roles.values())
    # the totals' CPU is rounded to microseconds and the threads' to clock ticks where schedstat is
    # missing: a rest within that is no thread
    if rest_woken > 0 or rest_cpu > 0.011:
        roles[EXITED] = [max(0.0, rest_cpu), max(0.0, rest_woken)]
    return {
        "cpu_us": cpu_total / ops * 1e6,
        "wakeups": woken_total / ops,
        "threads_started": len(after["threads"].keys() - before["threads"].keys()),
        "threads_exited": len(before["threads"].keys() - after["threads"].keys()),
        "roles": {r: {"cpu_us": c / ops * 1e6, "wakeups": w / ops} for r, (c, w) in roles.items()},
    }


def sample(peer: int) -> tuple[Snapshot, tuple[int, int] | None]:
    """This worker's counters, and twinrpc's (header frames, messages) sent to ``peer`` (None: not a
    twinrpc world). Runs on worker1 through RPC, so module-level."""
    try:
        frames = link_frames(peer)
    except Exception:  # torch.distributed.rpc: no twinrpc agent
        frames = None
    return snapshot(), frames


# -- the workers --------------------------------------------------------------------------------------
def _loop(rpc: Any, dist_autograd: Any, loop: str) -> Any:
    import torch

    if loop == "remote":
        a, b = torch.ones(1), torch.ones(1)
        return lambda: rpc.remote("worker1", tiny_udf, args=(a, b)).to_here()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g, requires_grad=True)
    y = torch.randn(256, 256, generator=g, requires_grad=True)

    def one() -> None:
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync("worker1", torch.matmul, args=(x, y))
            dist_autograd.backward(cid, [out.sum()])
            dist_autograd.get_gradients(cid)

    return one


def _measure(rpc: Any, one: Any, ops: int, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        one()
    theirs0, mine0 = rpc.rpc_sync("worker1", sample, args=(0,)), sample(1)
    t0 = time.perf_counter()
    for _ in range(ops):
        one()
    wall = time.perf_counter() - t0
    mine1 = sample(1)
    theirs1 = rpc.rpc_sync("worker1", sample, args=(0,))
    workers = {}
    for worker, (s0, f0), (s1, f1) in (("worker0", mine0, mine1), ("worker1", theirs0, theirs1)):
        got = per_op(s0, s1, ops)
        if f0 is not None and f1 is not None:
            got["frames"] = (f1[0] - f0[0]) / ops
            got["messages"] = (f1[1] - f0[1]) / ops
        workers[worker] = got
    return {"wall_us": wall / ops * 1e6, "workers": workers}


def _worker(rank: int, system: str, init: str, plan: list[tuple[str, int, int]], out: Any) -> None:
    # torch warns, once per process, that twinrpc's world uses a gloo backend object as a group
    warnings.filterwarnings("ignore", message="You are using a Backend")
    rpc = _init(system, rank, init)  # torch.set_num_threads(1), quiet twinrpc logs
    if system == "twinrpc":
        import twinrpc.autograd as dist_autograd
    else:
        import torch.distributed.autograd as dist_autograd
    if rank == 0:
        try:
            out.put({loop: _measure(rpc, _loop(rpc, dist_autograd, loop), n, w) for loop, n, w in plan})
        except BaseException as exc:  # report, don't leave the parent waiting
            out.put(RuntimeError(f"{system} worker0: {exc!r}"))
    rpc.shutdown()


def launch(system: str, plan: list[tuple[str, int, int]]) -> dict[str, Any]:
    """A fresh pair of ``system``'s workers runs ``plan`` ((loop, ops, warm-up ops) each) and exits."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench_wakeups-") as tmp:
        init = f"file://{tmp}/rendezvous" if system == "twinrpc" else f"tcp://127.0.0.1:{_free_port()}"
        procs = [ctx.Process(target=_worker, args=(r, system, init, plan, q)) for r in range(2)]
        for p in procs:
            p.start()
        result = _result(system, q, procs)
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    if isinstance(result, BaseException):
        raise result
    return dict(result)


def _result(system: str, q: Any, procs: list[Any]) -> Any:
    """worker0's result; an error naming the worker if one of them dies first."""
    while True:
        try:
            return q.get(timeout=2)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                rank, code = dead[0]
                raise RuntimeError(
                    f"{system} worker{rank} exited with code {code} before reporting"
                ) from None


# -- summing up -----------------------------------------------------------------------------------
def combine(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """One loop's medians over launches of one system; each worker's roles as a list, most wake-ups
    first (a role missing from a launch counts as 0)."""
    workers: dict[str, Any] = {}
    for worker in launches[0]["workers"]:
        each = [got["workers"][worker] for got in launches]
        roles = [
            {
                "role": r,
                **{
                    k: statistics.median(e["roles"].get(r, {}).get(k, 0.0) for e in each)
                    for k in ("cpu_us", "wakeups")
                },
            }
            for r in {r for e in each for r in e["roles"]}
        ]
        med: dict[str, Any] = {
            "cpu_us": statistics.median(e["cpu_us"] for e in each),
            "wakeups": statistics.median(e["wakeups"] for e in each),
            "roles": sorted(roles, key=lambda v: (-v["wakeups"], -v["cpu_us"], v["role"])),
        }
        for k in ("threads_started", "threads_exited", "frames", "messages"):
            if all(k in e for e in each):
                med[k] = statistics.median(e[k] for e in each)
        workers[worker] = med
    return {"wall_us": statistics.median(got["wall_us"] for got in launches), "workers": workers}


def summarize(
    per_loop: dict[str, dict[str, list[dict[str, Any]]]], plan: list[tuple[str, int, int]], repeat: int
) -> list[dict[str, Any]]:
    """The tables, as the results page reads them (lists keep their order through the JSON's sorted
    keys): per loop, per system, the medians of :func:`combine`."""
    return [
        {
            "loop": loop,
            "label": LABELS[loop],
            "ops": ops,
            "warmup": warmup,
            "launches": repeat,
            "systems": [{"system": s, **combine(got)} for s, got in per_loop[loop].items()],
        }
        for loop, ops, warmup in plan
    ]


def _both(got: dict[str, Any], key: str) -> float:
    return float(sum(w[key] for w in got["workers"].values()))


def figures(per_loop: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Target-less figures: per loop, twinrpc / TensorPipe of wake-ups and of CPU per operation (both
    workers together), the median over repeats of the ratio of each repeat's two launches."""
    out = []
    for loop, runs in per_loop.items():
        mine, theirs = runs.get("twinrpc"), runs.get("tensorpipe")
        if not mine or not theirs:
            continue
        for key, what, unit in (("wakeups", "wake-ups", "wake-ups"), ("cpu_us", "CPU time", "us")):
            a, b = [_both(g, key) for g in mine], [_both(g, key) for g in theirs]
            out.append(
                _results.figure(
                    f"{loop} {what}",
                    f"{SHORT[loop]}: {what} per operation, both workers",
                    unit,
                    False,
                    {"twinrpc": statistics.median(a), "tensorpipe": statistics.median(b)},
                    [x / y for x, y in zip(a, b, strict=False) if y],
                    None,
                )
            )
    return out


def _roles_text(roles: list[dict[str, Any]]) -> str:
    shown = [v for v in roles if v["wakeups"] >= 0.01 or v["cpu_us"] >= 1]
    return ", ".join(f"{v['role']} {v['wakeups']:.2f} ({v['cpu_us']:.0f} us)" for v in shown) or "-"


def report(loops: list[dict[str, Any]]) -> None:
    """The table: per loop and system, each worker's figures and its wake-ups by role."""
    for got in loops:
        print(f"{got['loop']}: {got['label']}")
        print(f"  {got['ops']} ops after {got['warmup']} warm-up ops; medians of {got['launches']} launches")
        print(
            f"  {'system':<11}{'worker':<9}{'wall/op':>10}{'CPU/op':>10}{'wake-ups/op':>13}"
            f"{'frames/op':>11}{'msgs/op':>9}  threads started/exited"
        )
        for s in got["systems"]:
            for worker, w in s["workers"].items():
                frames = f"{w['frames']:.2f}" if "frames" in w else "-"
                msgs = f"{w['messages']:.2f}" if "messages" in w else "-"
                print(
                    f"  {NAMES[s['system']]:<11}{worker:<9}{s['wall_us']:>7.0f} us{w['cpu_us']:>7.0f} us"
                    f"{w['wakeups']:>13.2f}{frames:>11}{msgs:>9}  "
                    f"{w['threads_started']:g}/{w['threads_exited']:g}"
                )
        print("  wake-ups per op by thread role (CPU per op):")
        for s in got["systems"]:
            for worker, w in s["workers"].items():
                print(f"    {NAMES[s['system']]:<11}{worker:<9}{_roles_text(w['roles'])}")
        print()


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--remote-ops", type=int, default=2000, help="measured remote()+to_here() ops")
    parser.add_argument("--iterations", type=int, default=300, help="measured autograd iterations")
    parser.add_argument("--warmup", type=int, default=200, help="warm-up ops of each loop per launch")
    parser.add_argument("--repeat", type=int, default=2, help="launches of each system, alternating")
    parser.add_argument("--loop", choices=LOOPS, action="append", help="the loops to run (default: both)")
    parser.add_argument("--only", choices=SYSTEMS, help="run one system")
    parser.add_argument("--json", default="", help="write the figures and tables to this file")
    args = parser.parse_args(argv)
    loops = args.loop or list(LOOPS)
    ops = {"remote": args.remote_ops, "iteration": args.iterations}
    if min(args.repeat, args.warmup + 1, *(ops[loop] for loop in loops)) < 1:
        parser.error("--repeat and the ops must be at least 1, --warmup at least 0")
    plan = [(loop, ops[loop], args.warmup) for loop in loops]
    systems = [args.only] if args.only else list(SYSTEMS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    per_loop: dict[str, dict[str, list[dict[str, Any]]]] = {loop: {s: [] for s in systems} for loop in loops}
    t0 = time.perf_counter()
    for r in range(args.repeat):
        for system in systems if r % 2 == 0 else systems[::-1]:
            got = launch(system, plan)
            for loop in loops:
                per_loop[loop][system].append(got[loop])
    summary = summarize(per_loop, plan, args.repeat)
    print(
        f"wake-ups, CPU and messages per operation, twinrpc (gloo world) vs TensorPipe; "
        f"{args.repeat} alternating launches of each in {time.perf_counter() - t0:.0f} s; "
        f"{os.cpu_count()} CPUs\n"
    )
    report(summary)
    found = figures(per_loop)
    for f in found:
        print("  " + _results.describe(f))
    if args.json:
        command = (
            f"python benchmarks/bench_wakeups.py --remote-ops {args.remote_ops} --iterations "
            f"{args.iterations} --warmup {args.warmup} --repeat {args.repeat}"
            + "".join(f" --loop {loop}" for loop in args.loop or ())
            + (f" --only {args.only}" if args.only else "")
        )
        doc = _results.document(
            "bench_wakeups",
            "wake-ups, CPU and messages per operation, twinrpc against TensorPipe, two processes",
            command,
            found,
            rounds=args.repeat,
            extra={"wakeups": {"loops": summary}},
        )
        _results.write(args.json, doc)
        print(f"  written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
