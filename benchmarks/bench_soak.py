"""Soak of the gloo world: resident memory, threads and file descriptors stay flat under long loads.

    python benchmarks/bench_soak.py                       # 1,000,000 / 100,000 / 10,000 (~20 min)
    python benchmarks/bench_soak.py --calls 20000 --rrefs 2000 --contexts 500 --json out.json

Two spawned processes over twinrpc's gloo world. Worker 0 runs three loads against worker 1, one after
the other:

* ``calls``: tiny ``rpc_sync(worker1, operator.add, args=(i, 1))`` calls;
* ``rrefs``: RRef cycles: ``rpc.remote(worker1, ...)`` creates one, a call shares it with its owner (the
  RRef is pickled and forked), then the last reference is dropped (the delete travels to the owner);
* ``contexts``: distributed autograd contexts: a call on a tensor that requires grad inside
  ``dist_autograd.context()``, the distributed backward, ``get_gradients``, the context released.

Every ``ops // --samples`` operations it samples both processes: resident set size (``/proc/self/statm``),
threads outside the request pool (``thr``: every native thread in ``/proc/self/task``, gloo's included,
less the pool's), the request pool's threads (``pool``) and open file descriptors (``/proc/self/fd``).
It prints each load's curves, one row per sample, and a verdict.

**Flat after warm-up**, per load, process and resource: the first ``WARMUP`` of the samples are the
warm-up (pools and allocator arenas reach their working size, lazily created threads start); after it,

* file descriptors never exceed the warm-up's maximum (counted exactly, and nothing in twinrpc opens
  one per operation: there is no noise to tolerate), but for those of the process's doorbell watcher
  (``LAZY_FDS``, told apart by kind: an epoll set and an eventfd, impl/_door_watch.py), which starts
  when a same-host link of the process first parks, and when that is depends on the timing of the
  link's first calls (seen in CI: about 1 s into the calls load, after its warm-up);
* threads outside the request pool exceed the warm-up's maximum by at most ``LAZY_THREADS``: the
  threads started on demand are a link's outbox (impl/_sender.py, on the first send from a thread that
  must not block, which a sequential load may reach only late), one per link, so here one, and the
  doorbell watcher's;
* the request pool's threads stay within its bound, ``num_worker_threads`` plus the receive loops of
  each link (impl/_pool.py: the pool keeps every thread it starts until shutdown and starts one only
  when all of its threads are busy at once, so its size is the high-water mark of concurrency, which a
  rare coincidence of a hand-off and a reply still raises by one now and then, even late in a
  sequential load: bounded, not a leak);
* resident memory at the end (median of the last ``TAIL`` of the samples, which ignores one-off
  spikes) exceeds the warm-up's maximum by at most ``RSS_SLACK_BYTES``: the allocator's fragmentation and
  arena growth move RSS by a few MiB without any leak (the contexts load below climbs 8-10 MiB before
  it levels off), while a leak of ``b`` bytes per operation adds ``b x ops`` (64 B per call over the
  full soak's 1,000,000 calls is 61 MiB). The slope after warm-up is printed too, in bytes per
  operation.

The contexts load warms up longest: each process's RSS climbs by about 350 B per context and then stops,
after 25,000-30,000 contexts, 8-10 MiB higher (measured to 40,000; upstream PyTorch over TensorPipe climbs
by about 2 KiB per context over the first 5,000). Its 10,000 contexts end inside that climb, which the
slack covers; ``--contexts 40000`` shows the plateau.

Also checked at the end of the RRef load: worker 1 owns no RRef and no fork any more (the deletes have
arrived). The exit status is 1 if any check fails. ``--json`` writes the samples and verdicts (the
bounded CI test, tests/gloo/test_soak_gloo.py, runs a short soak through it).
"""

from __future__ import annotations

import gc
import json
import operator
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import _cli  # benchmarks/_cli.py (the script's directory is on sys.path)

#: fraction of a load's samples that count as its warm-up
WARMUP = 0.2
#: fraction of a load's samples whose median is its final resident size
TAIL = 0.2
#: resident memory a load may gain after its warm-up without counting as growth (see the docstring)
RSS_SLACK_BYTES = 8 << 20
RESOURCES = ("rss", "threads", "fds", "pool")
#: threads outside the pool started on demand after the warm-up at most: the one link's outbox and
#: the process's doorbell watcher
LAZY_THREADS = 2
#: file descriptors by kind (see fd_kinds) that may open after the warm-up: the doorbell watcher's
#: epoll set and its nudge eventfd (impl/_door_watch.py), one per process
LAZY_FDS = {"anon_inode:[eventpoll]": 1, "anon_inode:[eventfd]": 1}
#: the request pool's bound in these two-worker worlds: num_worker_threads (the default, 16) plus the
#: receive loops of the one link (RECEIVERS in impl/_receiver.py)
POOL_BOUND = 16 + 2
LOADS = ("calls", "rrefs", "contexts")
PAGE = os.sysconf("SC_PAGE_SIZE")


def thread_kinds() -> dict[str, int]:
    """This process's Python threads by name, numbers dropped (which kinds of thread there are)."""
    import threading

    kinds: dict[str, int] = {}
    for t in threading.enumerate():
        name = re.sub(r"[-_ ]?\d+", "", t.name) or t.name
        kinds[name] = kinds.get(name, 0) + 1
    return dict(sorted(kinds.items()))


def sample() -> tuple[int, int, int, int]:
    """This process's resident bytes, native threads outside the request pool, open file descriptors
    and the request pool's threads."""
    import threading

    pool = sum(1 for t in threading.enumerate() if t.name.startswith("twinrpc-pool"))
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * PAGE
    return rss, len(os.listdir("/proc/self/task")) - pool, len(os.listdir("/proc/self/fd")), pool


def fd_kinds() -> dict[str, int]:
    """This process's open file descriptors by kind (``socket``, ``anon_inode:[eventfd]``, a file's
    path...): what a growing count is made of."""
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        kind = re.sub(r":\[\d+\]$", "", target)
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


class Payload:
    """An RRef's value on its owner."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


def make(n: int) -> Payload:
    return Payload(n)


def read(rref: Any) -> int:
    """On the owner: the value of an RRef shared with it."""
    value: Payload = rref.local_value()
    return value.n


def owned() -> tuple[int, int]:
    """On worker 1: the owner RRefs and forks it still keeps."""
    import twinrpc.rpc as rpc

    gc.collect()
    info = rpc._get_debug_info()
    return int(info["num_owner_rrefs"]), int(info["num_forks"])


@dataclass
class Curve:
    """One load's samples: after ``ops[i]`` operations, each process's resources."""

    load: str
    ops: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    #: per process (0, 1): per sample (rss, threads outside the pool, fds, pool threads)
    procs: list[list[tuple[int, int, int, int]]] = field(default_factory=lambda: [[], []])
    #: load-specific checks at the end (name -> passed), with what was seen
    extra: dict[str, Any] = field(default_factory=dict)
    #: per process: its Python threads by kind at the end of the load (see thread_kinds)
    extra_threads: list[dict[str, int]] = field(default_factory=list)
    #: per process, per sample: its file descriptors by kind (see fd_kinds)
    fd_kinds: list[list[dict[str, int]]] = field(default_factory=lambda: [[], []])


def _loads(rpc: Any, dist_autograd: Any) -> dict[str, Any]:
    import torch

    x = torch.ones(2, requires_grad=True)

    def call(i: int) -> None:
        assert rpc.rpc_sync("worker1", operator.add, args=(i, 1)) == i + 1

    def rref_cycle(i: int) -> None:
        rref = rpc.remote("worker1", make, args=(i,))
        assert rpc.rpc_sync("worker1", read, args=(rref,)) == i
        del rref

    def context(i: int) -> None:
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2.0))
            dist_autograd.backward(cid, [y.sum()])
            assert dist_autograd.get_gradients(cid)[x].tolist() == [2.0, 2.0]

    return {"calls": call, "rrefs": rref_cycle, "contexts": context}


def drive(counts: dict[str, int], samples: int) -> list[Curve]:
    """On worker 0: run each load, sampling both processes every ``ops // samples`` operations."""
    import twinrpc.autograd as dist_autograd
    import twinrpc.rpc as rpc

    ops_of = _loads(rpc, dist_autograd)
    curves = []
    for load in LOADS:
        n = counts[load]
        if n <= 0:
            continue
        one = ops_of[load]
        every = max(1, n // samples)
        curve = Curve(load)

        def take(done: int, t0: float, curve: Curve = curve) -> None:
            curve.ops.append(done)
            curve.seconds.append(time.perf_counter() - t0)
            curve.procs[0].append(sample())
            curve.fd_kinds[0].append(fd_kinds())
            rss, threads, fds, pool = rpc.rpc_sync("worker1", sample)
            curve.procs[1].append((rss, threads, fds, pool))
            curve.fd_kinds[1].append(rpc.rpc_sync("worker1", fd_kinds))

        t0 = time.perf_counter()
        take(0, t0)
        for i in range(n):
            one(i)
            if (i + 1) % every == 0 or i + 1 == n:
                take(i + 1, t0)
        curve.extra_threads = [thread_kinds(), rpc.rpc_sync("worker1", thread_kinds)]
        if load == "rrefs":
            deadline = time.monotonic() + 10.0
            left = rpc.rpc_sync("worker1", owned)
            while left != (0, 0) and time.monotonic() < deadline:  # the last deletes are in flight
                time.sleep(0.05)
                left = rpc.rpc_sync("worker1", owned)
            curve.extra["owner RRefs and forks left on worker1"] = {"seen": list(left), "ok": left == (0, 0)}
        curves.append(curve)
    return curves


def _worker(rank: int, init_method: str, counts: dict[str, int], samples: int, conn: Any) -> None:
    import torch

    import twinrpc.rpc as rpc

    torch.set_num_threads(1)
    opts = rpc.RpcBackendOptions(init_method=init_method)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out: Any = None
    try:
        if rank == 0:
            out = [asdict(c) for c in drive(counts, samples)]
    except BaseException as exc:
        out = f"{type(exc).__name__}: {exc}"
    finally:
        rpc.shutdown()
    conn.send(out)


def run(counts: dict[str, int], samples: int) -> list[Curve]:
    """Two spawned processes (rendezvous through a file); worker 0's curves."""
    from _two_workers import run_two  # benchmarks/ (the script's directory)

    results = run_two(_worker, counts, samples, prefix="soak-")
    if isinstance(results[0], str):
        raise RuntimeError(f"the soak failed on worker0: {results[0]}")
    curves = []
    for d in results[0]:
        d["procs"] = [[tuple(s) for s in proc] for proc in d["procs"]]
        curves.append(Curve(**d))
    return curves


def verdict(curve: Curve) -> dict[str, Any]:
    """Whether each process's resources stayed flat after warm-up (see the module docstring)."""
    n = len(curve.ops)
    warm = max(1, round(n * WARMUP))
    tail = max(1, round(n * TAIL))
    out: dict[str, Any] = {}
    for proc, rows in enumerate(curve.procs):
        for r, name in enumerate(RESOURCES):
            values = [row[r] for row in rows]
            peak = max(values[:warm])
            after = values[warm:] or values[-1:]
            if name == "rss":
                end = statistics.median(values[-tail:])
                ops = curve.ops[warm:]
                slope = _slope(ops, after) if len(ops) >= 2 else 0.0
                ok = end - peak <= RSS_SLACK_BYTES
                out[f"worker{proc} {name}"] = {
                    "warmup_max": peak,
                    "end": end,
                    "growth": end - peak,
                    "bytes_per_op": slope,
                    "ok": ok,
                }
            elif name == "pool":
                out[f"worker{proc} {name}"] = {
                    "bound": POOL_BOUND,
                    "max": max(values),
                    "ok": max(values) <= POOL_BOUND,
                }
            else:
                slack = LAZY_THREADS if name == "threads" else 0
                out[f"worker{proc} {name}"] = d = {
                    "warmup_max": peak,
                    "max_after": max(after),
                    "ok": max(after) <= peak + slack,
                }
                kinds = curve.fd_kinds[proc] if proc < len(curve.fd_kinds) else []
                if name == "fds" and not d["ok"] and len(kinds) == n:
                    # told apart by kind: only the doorbell watcher's may be new
                    d["new"] = new = _new_kinds(
                        kinds[values.index(peak)], kinds[values.index(max(after), warm)]
                    )
                    d["ok"] = all(k in LAZY_FDS and more <= LAZY_FDS[k] for k, more in new.items())
    for name, seen in curve.extra.items():
        out[name] = seen
    return out


def _new_kinds(before: dict[str, int], later: dict[str, int]) -> dict[str, int]:
    """The kinds of descriptor ``later`` holds more of than ``before``, and how many more."""
    return {k: n - before.get(k, 0) for k, n in later.items() if n > before.get(k, 0)}


def _slope(xs: list[int], ys: list[int]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def report(curves: list[Curve]) -> tuple[bool, dict[str, Any]]:
    """Print each load's curves and verdict; whether all are flat, and the verdicts."""
    verdicts: dict[str, Any] = {}
    ok = True
    for curve in curves:
        n = curve.ops[-1]
        rate = n / curve.seconds[-1] if curve.seconds[-1] else 0.0
        print(f"\n== {curve.load}: {n} operations in {curve.seconds[-1]:.1f} s ({rate:.0f}/s)")
        head = f"{'RSS MiB':>8} {'thr':>4} {'pool':>4} {'fds':>4}"
        print(f"  {'ops':>9} {'s':>7} | worker0 {head} | worker1 {head}")
        warm = max(1, round(len(curve.ops) * WARMUP))
        for i, done in enumerate(curve.ops):
            cells = [
                f"{_mib(r):>8} {t:>4} {p:>4} {f:>4}" for r, t, f, p in (curve.procs[0][i], curve.procs[1][i])
            ]
            mark = "  <- end of warm-up" if i == warm - 1 else ""
            print(f"  {done:>9} {curve.seconds[i]:>7.1f} |         {cells[0]} |         {cells[1]}{mark}")
        for proc, kinds in enumerate(curve.extra_threads):
            print(f"  worker{proc} Python threads at the end: {kinds}")
        v = verdict(curve)
        verdicts[curve.load] = v
        for what, d in v.items():
            ok = ok and bool(d["ok"])
            flag = "flat" if d["ok"] else "GROWS"
            if "bytes_per_op" in d:
                print(
                    f"  {what:<16} {flag}: warm-up max {_mib(d['warmup_max'])} MiB, end {_mib(d['end'])} MiB "
                    f"({d['growth'] / 2**20:+.1f} MiB, slack {_mib(RSS_SLACK_BYTES)}), slope after warm-up "
                    f"{d['bytes_per_op']:+.1f} B/op"
                )
            elif "max_after" in d:
                new = f", new: {d['new']}" if d.get("new") else ""
                if d["ok"] and new:
                    new += " (the doorbell watcher's, started late)"
                print(f"  {what:<16} {flag}: warm-up max {d['warmup_max']}, max after {d['max_after']}{new}")
            elif "bound" in d:
                print(
                    f"  {what:<16} {'bounded' if d['ok'] else 'OVER ITS BOUND'}: max {d['max']} (bound {d['bound']})"
                )
            else:
                print(f"  {what}: {d['seen']} ({'ok' if d['ok'] else 'LEFT OVER'})")
    print("\nverdict: " + ("flat after warm-up" if ok else "GROWTH after warm-up (see above)"))
    return ok, verdicts


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--rrefs", type=int, default=100_000)
    parser.add_argument("--contexts", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=50, help="samples per load (after the first)")
    parser.add_argument("--json", help="write the curves and verdicts here")
    args = parser.parse_args(argv)
    if args.samples < 5:
        parser.error("--samples must be at least 5 (warm-up and tail need some)")
    counts = {"calls": args.calls, "rrefs": args.rrefs, "contexts": args.contexts}
    print(f"gloo soak, two processes: {counts}, {args.samples} samples per load")
    curves = run(counts, args.samples)
    ok, verdicts = report(curves)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": ok, "curves": [asdict(c) for c in curves], "verdicts": verdicts}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
