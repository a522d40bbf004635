"""twinrpc's gloo world against upstream torch.distributed.rpc (TensorPipe), side by side in one run.

Three pairs of processes are spawned and initialised once: twinrpc (``twinrpc.rpc`` over its gloo
world), TensorPipe (``torch.distributed.rpc``) and raw gloo (``torch.distributed`` send/recv with an
explicit source, the floor under twinrpc's transport). The parent then runs rounds; in each round every
measurement runs on every system in turn (the order rotates each round), so all three share whatever
load the machine has at that moment. Reported: medians (and p99 for latency) over all rounds, and
each figure's ratio twinrpc / TensorPipe against its target in ``_TARGETS``: the median over rounds of
the ratio within a round (both systems measured back to back, under the same load).
``--json FILE`` also writes the figures for the results page (``benchmarks/render_results.py``).

With 64 calls in flight, twinrpc's links also count the messages per header frame each way (requests,
replies): several messages waiting for the same peer share a frame (``Sender`` in ``impl/_sender.py``).

Bandwidth is a round trip: a UDF that returns its argument; GB/s = 2 x size / round-trip time (bytes
moved both ways). The raw gloo floor is the same ping-pong with reused receive buffers.

Run: ``nox -s bench`` or ``python benchmarks/bench_gloo.py [--rounds R] [--quick] [--json FILE]``.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import _cli
import _results

KiB, MiB = 1024, 1024 * 1024
SIZES = (KiB, MiB, 16 * MiB, 64 * MiB)
SYSTEMS = ("twinrpc", "tensorpipe", "gloo")
WINDOW = 64


# -- the functions called remotely (module-level: RPC sends functions by reference) -------------------
def tiny_udf(a: Any, b: Any) -> Any:
    return a + b


def echo(t: Any) -> Any:
    return t


# -- worker processes ------------------------------------------------------------------------------
def _rpc_module(system: str) -> Any:
    if system.startswith("twinrpc"):
        import twinrpc.rpc as rpc
    else:
        import torch.distributed.rpc as rpc
    return rpc


def _init(system: str, rank: int, init_method: str) -> Any:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Pairs not being measured are SIGSTOPped (see Pair.pause): twinrpc's heartbeat notices that
    # its own process was stopped and says so; that is expected here.
    logging.getLogger("twinrpc.impl").setLevel(logging.ERROR)
    if system == "gloo":
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
        return None
    rpc = _rpc_module(system)
    if system.startswith("twinrpc"):
        # twinrpc-keyed: with a job key (bench_auth.py --two-hosts)
        key = b"bench job key" if system == "twinrpc-keyed" else None
        opts = rpc.RpcBackendOptions(init_method=init_method, auth_key=key)
    else:
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    return rpc


def _timed_calls(n: int, call: Any) -> list[float]:
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        call()
        out.append(clock() - t0)
    return out


def _throughput(rpc: Any, n: int, a: Any, b: Any, func: Any = tiny_udf) -> float:
    """Calls per second of ``func(a, b)`` with WINDOW calls in flight (a sliding window, not batches)."""
    slots = threading.Semaphore(WINDOW)
    done = threading.Semaphore(0)

    def release(_f: Any) -> None:
        slots.release()
        done.release()

    t0 = time.perf_counter()
    for _ in range(n):
        slots.acquire()
        rpc.rpc_async("worker1", func, args=(a, b)).add_done_callback(release)
    for _ in range(n):
        done.acquire()
    return n / (time.perf_counter() - t0)


def _link(peer: int) -> Any:
    """This twinrpc worker's link to ``peer``, made now if need be (links are made on first use; a
    tree from before that made them all in init_rpc)."""
    from twinrpc._current import current_agent

    world: Any = current_agent().world
    return world.link_to(peer, 60.0) if hasattr(world, "link_to") else world.links[peer]


def link_frames(peer: int) -> tuple[int, int]:
    """(header frames, messages) this twinrpc worker has sent to ``peer`` (a tree from before
    coalescing counts a message per frame)."""
    sender = _link(peer).sender
    return sender.headers_sent, getattr(sender, "messages_sent", sender.headers_sent)


def link_same_host(peer: int) -> list[bool] | None:
    """Whether this twinrpc worker's link to ``peer`` moves data through shared memory, each way
    ([ours to the peer, the peer's to us]); None: a tree without the same-host path."""
    link = _link(peer)
    same = getattr(link, "same_host", None)
    return None if same is None else [bool(x) for x in same]


def _messages_per_frame(rpc: Any, n: int, a: Any, b: Any) -> tuple[float, float]:
    """Messages per header frame (requests, replies) over ``n`` calls with WINDOW in flight."""
    mine, theirs = link_frames(1), rpc.rpc_sync("worker1", link_frames, args=(0,))
    _throughput(rpc, n, a, b)
    mine2, theirs2 = link_frames(1), rpc.rpc_sync("worker1", link_frames, args=(0,))
    return (
        (mine2[1] - mine[1]) / max(1, mine2[0] - mine[0]),
        (theirs2[1] - theirs[1]) / max(1, theirs2[0] - theirs[0]),
    )


def _rpc_measure(rpc: Any, what: str, n: int, size: int) -> Any:
    import torch

    a, b = torch.ones(1), torch.ones(1)
    if what == "builtin":
        return _timed_calls(n, lambda: rpc.rpc_sync("worker1", torch.add, args=(a, b)))
    if what == "udf":
        return _timed_calls(n, lambda: rpc.rpc_sync("worker1", tiny_udf, args=(a, b)))
    if what == "udf plain":
        return _timed_calls(n, lambda: rpc.rpc_sync("worker1", tiny_udf, args=(1, 1)))
    if what == "throughput":
        return _throughput(rpc, n, a, b)
    if what == "throughput builtin":
        return _throughput(rpc, n, a, b, torch.add)
    if what == "frames":
        return _messages_per_frame(rpc, n, a, b)
    if what == "shm":
        return link_same_host(1)
    if what == "remote":
        return _timed_calls(n, lambda: rpc.remote("worker1", tiny_udf, args=(a, b)).to_here())
    if what == "bw":
        t = torch.ones(size // 4, dtype=torch.float32)
        return _timed_calls(n, lambda: rpc.rpc_sync("worker1", echo, args=(t,)))
    raise ValueError(what)


def _gloo_measure(rank: int, what: str, n: int, size: int, bufs: dict[int, Any]) -> Any:
    """Raw ping-pong with an explicit source; buffers reused across calls (pre-faulted)."""
    import torch
    import torch.distributed as dist

    nbytes = 4 if what != "bw" else size
    if nbytes not in bufs:
        bufs[nbytes] = (torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8))
        bufs[nbytes][1].fill_(0)
    out, inp = bufs[nbytes]
    if rank == 1:
        for _ in range(n):
            dist.recv(inp, src=0)
            dist.send(inp, dst=1 - rank)
        return None

    def ping() -> None:
        dist.send(out, dst=1)
        dist.recv(inp, src=1)

    return _timed_calls(n, ping)


def worker(
    system: str, rank: int, init_method: str, conn: Any, path: str | None = None, host: Any = None
) -> None:
    if host is not None:  # bench_two_hosts.py: this rank runs in a network namespace of its own
        import _netns

        _netns.enter(host)
    if path:  # --baseline: twinrpc imported from another tree (a package directory containing twinrpc/)
        sys.path.insert(0, path)
    rpc = _init(system, rank, init_method)
    bufs: dict[int, Any] = {}
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, what, n, size = cmd
        try:
            if system == "gloo":
                result = _gloo_measure(rank, what, n, size, bufs)
            else:
                result = _rpc_measure(rpc, what, n, size)
        except BaseException as exc:  # report, don't hang the parent
            result = RuntimeError(f"{system} rank {rank} {what}: {exc!r}")
        conn.send(result)
    if rpc is not None:
        rpc.shutdown()
    else:
        import torch.distributed as dist

        dist.destroy_process_group()
    conn.send("stopped")


# -- the parent --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Pair:
    """Two worker processes of one system; with ``hosts`` (two :class:`_netns.Host`), rank r runs in
    ``hosts[r]``'s namespace and they meet at ``port`` on rank 0's address."""

    def __init__(
        self,
        ctx: Any,
        system: str,
        tmp: str,
        path: str | None = None,
        hosts: tuple[Any, Any] | None = None,
        port: int = 29500,
    ) -> None:
        self.system = system
        if hosts is not None:
            init_method = f"tcp://{hosts[0].address}:{port}"
        elif system.startswith("twinrpc"):
            init_method = f"file://{tmp}/{system}-rendezvous"
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            host = None if hosts is None else hosts[rank]
            p = ctx.Process(target=worker, args=(system, rank, init_method, child, path, host), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def wait_ready(self, timeout: float) -> None:
        for rank, c in enumerate(self.conns):
            try:
                if not c.poll(timeout):
                    raise RuntimeError(f"{self.system} workers did not start within {timeout} s")
                assert c.recv() == "ready"
            except EOFError:
                code = self.procs[rank].exitcode
                raise RuntimeError(
                    f"{self.system} rank {rank} died while starting (exit code {code})"
                ) from None

    def pause(self, paused: bool) -> None:
        """SIGSTOP/SIGCONT the pair: TensorPipe's shm reactor busy-polls even when idle, which would
        tax whichever system is being measured; so only the measured pair runs."""
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def run(self, what: str, n: int, size: int = 0) -> Any:
        cmd = ("run", what, n, size)
        active = self.conns if self.system == "gloo" else self.conns[:1]
        for c in active:
            c.send(cmd)
        results = [c.recv() for c in active]
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results[0]

    def stop(self) -> None:
        """Stop the workers (a worker that already died, e.g. failing to start, is just reaped)."""
        self.pause(False)
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:  # it is gone
                pass
        for c, p in zip(self.conns, self.procs, strict=True):
            try:
                if c.poll(60):
                    c.recv()
            except (OSError, EOFError):
                pass
            p.join(30)
            if p.is_alive():
                p.kill()


def _only(pairs: dict[str, Pair], system: str) -> None:
    for s, p in pairs.items():
        p.pause(s != system)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.2f}" if v >= 1 else f"{v:.3f}"


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def make_plan(
    wanted: set[str], calls: int, sizes: tuple[int, ...] = SIZES
) -> list[tuple[str, str, int, int]]:
    """The measurements of one round: (name, what, calls, size)."""
    plan: list[tuple[str, str, int, int]] = []
    if "builtin" in wanted:
        plan.append(("builtin", "builtin", calls, 0))
    if "udf" in wanted:
        plan.append(("udf", "udf", calls, 0))
        plan.append(("udf plain", "udf plain", calls, 0))
    if "remote" in wanted:
        plan.append(("remote", "remote", calls // 2, 0))
    if "throughput" in wanted:
        plan.append(("throughput", "throughput", calls * 4, 0))
        plan.append(("throughput builtin", "throughput builtin", calls * 4, 0))
        plan.append(("frames", "frames", calls * 2, 0))
    if "bw" in wanted:
        for size in sizes:
            reps = max(3, min(calls // 4, (256 * MiB) // size))
            plan.append((f"bw {_fmt_size(size)}", "bw", reps, size))
    return plan


#: (measurement name, system) -> each round's result: a list of latency samples, or one value
PerRound = dict[tuple[str, str], list[Any]]


def run_rounds(
    pairs: dict[str, Pair], plan: list[tuple[str, str, int, int]], rounds: int, measures: Any = None
) -> tuple[PerRound, float]:
    """A warm-up pass, then ``rounds`` rounds; in each, every measurement on every system in turn (the
    order rotates each round). Returns each round's results and the rounds' wall time."""
    measures = measures or _measures
    systems = tuple(pairs)
    for _name, what, n, size in plan:  # warm-up: one short pass of everything, not recorded
        for s, p in pairs.items():
            if measures(s, what):
                _only(pairs, s)
                p.run(what, max(2, n // 10), size)
    per_round: PerRound = {}
    t_start = time.perf_counter()
    for rnd in range(rounds):
        k = rnd % len(systems)
        order = systems[k:] + systems[:k]
        for name, what, n, size in plan:
            for s in order:
                if measures(s, what):
                    _only(pairs, s)
                    per_round.setdefault((name, s), []).append(pairs[s].run(what, n, size))
    return per_round, time.perf_counter() - t_start


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300, help="latency samples per system per round")
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--only", default="", help="comma list: builtin,udf,throughput,remote,bw")
    parser.add_argument(
        "--baseline",
        default="",
        help="also run twinrpc from this directory (it holds a twinrpc/ package, e.g. an older tree)",
    )
    parser.add_argument(
        "--json", default="", help="write the figures to this file (the results page's input)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.calls = 2, 60
    wanted = set(args.only.split(",")) if args.only else {"builtin", "udf", "throughput", "remote", "bw"}

    ctx = mp.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench_gloo-") as tmp:
        systems = SYSTEMS + (("twinrpc-base",) if args.baseline else ())
        pairs = {s: Pair(ctx, s, tmp) for s in SYSTEMS}
        if args.baseline:
            pairs["twinrpc-base"] = Pair(ctx, "twinrpc-base", tmp, args.baseline)
        for p in pairs.values():
            p.wait_ready(120)
        plan = make_plan(wanted, args.calls)
        shm = pairs["twinrpc"].run("shm", 1)
        per_round, wall = run_rounds(pairs, plan, args.rounds)
        for p in pairs.values():
            p.stop()

    samples = {
        key: [x for r in rounds for x in (r if isinstance(r, list) else [r])]
        for key, rounds in per_round.items()
    }
    _report(samples, plan, args.rounds, wall, systems)
    print(f"  twinrpc's link uses shared memory (to the peer, from it): {shm}")
    found = figures(per_round, plan, "twinrpc", "tensorpipe", _TARGETS)
    print("figures (ratio = median over rounds of twinrpc / TensorPipe within the round):")
    for f in found:
        print("  " + _results.describe(f))
    if args.json:
        doc = _results.document(
            "bench_gloo",
            "twinrpc against TensorPipe, two processes on this machine",
            f"python benchmarks/bench_gloo.py --rounds {args.rounds} --calls {args.calls}",
            found,
            rounds=args.rounds,
            extra={"frames": _frames_summary(samples), "shared_memory": shm},
        )
        _results.write(args.json, doc)
        print(f"  written: {args.json}")
    return 0


def _frames_summary(samples: dict[tuple[str, str], list[Any]]) -> dict[str, float] | None:
    got = samples.get(("frames", "twinrpc"))
    if not got:
        return None
    return {
        "requests_per_frame": statistics.median(x[0] for x in got),
        "replies_per_frame": statistics.median(x[1] for x in got),
    }


#: how each measurement becomes a figure: label, unit, whether higher is better
_FIGURES = {
    "builtin": ("rpc_sync of a builtin (torch.add), tiny tensors: latency", "us", False),
    "udf": ("rpc_sync of a tiny UDF: latency", "us", False),
    "udf plain": ("rpc_sync of a tiny UDF on two ints (no tensors): latency", "us", False),
    "remote": ("remote() + to_here(): latency", "us", False),
    "throughput": (f"rpc_async of a tiny UDF with {WINDOW} calls in flight", "calls/s", True),
    "throughput builtin": (
        f"rpc_async of a builtin (torch.add) with {WINDOW} calls in flight",
        "calls/s",
        True,
    ),
}


def round_value(what: str, size: int, result: Any) -> float:
    """One round's figure: a latency's median (us), a rate, or a round trip's GB/s (2 x size / median)."""
    if what in ("builtin", "udf", "udf plain", "remote"):
        return float(statistics.median(result)) * 1e6
    if what in ("throughput", "throughput builtin"):
        return float(result)
    if what == "bw":
        return 2 * size / statistics.median(result) / 1e9
    raise ValueError(what)


def figures(
    per_round: PerRound,
    plan: list[tuple[str, str, int, int]],
    system: str,
    against: str,
    targets: dict[str, tuple[str, float]],
) -> list[dict[str, Any]]:
    """Each measurement of ``plan`` as a figure of ``system`` against ``against``: both systems' values
    (medians over rounds), and the median over rounds of their ratio within each round."""
    out = []
    for name, what, _n, size in plan:
        if what == "frames":
            continue
        mine, theirs = per_round.get((name, system)), per_round.get((name, against))
        if not mine or not theirs:
            continue
        a = [round_value(what, size, r) for r in mine]
        b = [round_value(what, size, r) for r in theirs]
        if what == "bw":
            label, unit, higher = (
                f"identity round trip of {_fmt_size(size)} (rpc_sync, bytes both ways)",
                "GB/s",
                True,
            )
        else:
            label, unit, higher = _FIGURES[what]
        out.append(
            _results.figure(
                name,
                label,
                unit,
                higher,
                {system: statistics.median(a), against: statistics.median(b)},
                [x / y for x, y in zip(a, b, strict=False)],
                targets.get(name),
            )
        )
    return out


def _measures(system: str, what: str) -> bool:
    """Whether ``system`` takes part in measurement ``what`` (raw gloo: only its ping-pongs; frames
    per message: only twinrpc's links count them)."""
    if system == "gloo":
        return what in ("builtin", "bw")
    return what != "frames" or system.startswith("twinrpc")


_TARGETS = {
    "builtin": ("<=", 1.0),
    "udf": ("<=", 0.8),
    "udf plain": ("<=", 0.8),
    "remote": ("<=", 1.0),
    "throughput": (">=", 1.2),
    "throughput builtin": (">=", 0.8),
    "bw 16 MiB": (">=", 2.0),
    "bw 64 MiB": (">=", 2.0),
}


def _report(
    samples: dict[tuple[str, str], list[float]],
    plan: Any,
    rounds: int,
    wall: float,
    systems: tuple[str, ...] = SYSTEMS,
) -> None:
    """The table of medians over all rounds (ratio: of those medians)."""
    print(
        f"twinrpc (gloo world) vs torch.distributed.rpc (TensorPipe) vs raw gloo; {rounds} interleaved "
        f"rounds in {wall:.0f} s; {os.cpu_count()} CPUs"
    )
    print(
        "ratio = twinrpc / TensorPipe of the medians over all rounds (latency: lower is better; rates: "
        "higher is better); the figures below take the median of the ratios within each round"
    )
    extra = "".join(f"{s:>14}" for s in systems[3:])
    print(
        f"  {'measurement':<34}{'twinrpc':>12}{'TensorPipe':>12}{'raw gloo':>12}{'ratio':>8}  {'target':<18}"
        + extra
    )

    def line(label: str, unit: str, vals: dict[str, float | None], key: str) -> None:
        tw, tp = vals.get("twinrpc"), vals.get("tensorpipe")
        ratio = tw / tp if tw is not None and tp else float("nan")
        cells = "".join(f"{_num(vals.get(s)):>12}" for s in SYSTEMS)
        extra = "".join(f"{_num(vals.get(s)):>14}" for s in systems[3:])
        target = ""
        if key in _TARGETS:
            op, bound = _TARGETS[key]
            ok = ratio <= bound if op == "<=" else ratio >= bound
            target = f"{op} {bound}  {'met' if ok else 'MISSED'}"
        print(f"  {label + ' (' + unit + ')':<34}{cells}{ratio:>8.2f}  {target:<18}{extra}")

    for name, what, _n, size in plan:
        got = {s: samples.get((name, s)) for s in systems}
        if what in ("builtin", "udf", "udf plain", "remote"):
            label = {
                "builtin": "rpc_sync torch.add",
                "udf": "rpc_sync tiny UDF",
                "udf plain": "rpc_sync UDF, ints",
                "remote": "remote()+to_here()",
            }[what]
            med = {s: statistics.median(v) * 1e6 if v else None for s, v in got.items()}
            p99 = {s: _pct(v, 0.99) * 1e6 if v else None for s, v in got.items()}
            line(f"{label} median", "us", med, what)
            line(f"{label} p99", "us", p99, "")
        elif what in ("throughput", "throughput builtin"):
            med = {s: statistics.median(v) if v else None for s, v in got.items()}
            line(f"{WINDOW} in flight, {'UDF' if what == 'throughput' else 'add'}", "calls/s", med, what)
        elif what == "frames":
            for i, way in enumerate(("requests", "replies")):
                per = {s: statistics.median(x[i] for x in v) if v else None for s, v in got.items()}
                line(f"  {way} per header frame", "msgs", per, "")
        else:
            rate = {s: 2 * size / statistics.median(v) / 1e9 if v else None for s, v in got.items()}
            line(f"round trip {_fmt_size(size)}", "GB/s", rate, name)
    print("  raw gloo column: latency rows = 1-element send/recv ping-pong with an explicit source;")
    print("  round-trip rows = the same ping-pong of that size with reused (pre-faulted) receive buffers")


if __name__ == "__main__":
    sys.exit(main())
