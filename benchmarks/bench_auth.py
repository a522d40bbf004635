"""What a job key costs the gloo world: the same calls with and without ``auth_key``, side by side.

Two pairs of twinrpc workers are spawned and initialised once, one with a key (every frame sealed and
checked, impl/_auth.py) and one without. The parent then runs rounds; in each round both pairs run the
same measurements, in alternating order (the order flips each round), so both share whatever load the
machine has at that moment: a tiny ``rpc_sync`` round trip (median latency) and 64 tiny calls in
flight (calls/s). Each measurement also reads both processes' CPU time (``/proc/<pid>/stat``), which
says what the key costs a call even when other programs share the machine and wall-clock rates
wander. Reported: medians over all rounds and the keyed / unkeyed ratios.

``--mac`` first times the two MAC constructions the design chose between on header frames (keyed
BLAKE2b and HMAC-SHA256): a typical header's used bytes and a full 4 KiB frame; and, for tensor data,
keyed BLAKE2b against Poly1305 over 64 MiB.

``--two-hosts`` measures large tensors instead, where the key MACs every byte: identity round trips
of 1, 16 and 64 MiB between two network namespaces (``bench_two_hosts.py``'s setup, same-host path
off), a pair with the key against a pair without, in alternating rounds; ``--json`` writes them for
the results page. Needs root and iproute2.

Run: ``nox -s bench`` or ``python benchmarks/bench_auth.py [--rounds R] [--calls N] [--mac]
[--two-hosts [--json FILE]]``.
"""

from __future__ import annotations

import hashlib
import hmac
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import timeit
from typing import Any

import _cli  # benchmarks/_cli.py (the script's directory is on sys.path)

# the same calls as bench_gloo's (the script's directory, benchmarks/, is on the path)
from bench_gloo import WINDOW, _throughput, tiny_udf

KEY = b"bench_auth job key"


def _latency(rpc: Any, n: int) -> float:
    """Median seconds of one tiny rpc_sync round trip."""
    clock = time.perf_counter
    out = []
    for i in range(n):
        t0 = clock()
        rpc.rpc_sync("worker1", tiny_udf, args=(i, 1))
        out.append(clock() - t0)
    return statistics.median(out)


def worker(keyed: bool, rank: int, init_method: str, conn: Any) -> None:
    import torch

    import twinrpc.rpc as rpc

    torch.set_num_threads(1)
    os.environ.pop("TWINRPC_AUTH_KEY", None)  # the pair's own setting decides, not the caller's
    options = rpc.RpcBackendOptions(init_method=init_method, auth_key=KEY if keyed else None)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    conn.send("ready")
    if rank == 0:
        _latency(rpc, 200)  # warm up
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            what, n = cmd
            conn.send(_latency(rpc, n) if what == "latency" else _throughput(rpc, n, 1, 1))
    rpc.shutdown()
    conn.send("done")


class Pair:
    """A 2-worker twinrpc world, with or without a key; rank 0 measures on request."""

    def __init__(self, ctx: Any, keyed: bool, tmp: str) -> None:
        self.keyed = keyed
        init_method = f"file://{tmp}/{'keyed' if keyed else 'plain'}-rendezvous"
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker, args=(keyed, rank, init_method, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(120):
                raise RuntimeError("the workers did not start within 120 s")
            assert c.recv() == "ready"

    def run(self, what: str, n: int) -> tuple[float, float]:
        """The measurement's result, and the CPU seconds both processes spent per call meanwhile."""
        before = self.cpu()
        self.conns[0].send((what, n))
        result = float(self.conns[0].recv())
        return result, (self.cpu() - before) / n

    def cpu(self) -> float:
        """CPU seconds (user + system, every thread) both processes have used so far (Linux)."""
        total = 0
        for p in self.procs:
            with open(f"/proc/{p.pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.conns[0].send(None)
        for c, p in zip(self.conns, self.procs, strict=True):
            if c.poll(60):
                c.recv()
            p.join(30)
            if p.is_alive():
                p.kill()


def _mac_costs() -> None:
    """Microseconds per header frame for each MAC construction (one tag, as the sender computes it)."""
    key = b"k" * 32
    frame = memoryview(bytearray(4096))
    blake = hashlib.blake2b(key=key, digest_size=16)
    sha = hmac.new(key, digestmod="sha256")
    print("MAC per header frame (us; min of 5 x 20,000):")
    for used in (200, 4096):
        row = []
        for name, base in (("keyed BLAKE2b-128", blake), ("HMAC-SHA256", sha)):

            def tag(base: Any = base, used: int = used) -> bytes:
                h = base.copy()
                h.update(b"direction+seq...")
                h.update(frame[:used])
                return bytes(h.digest())

            us = min(timeit.repeat(tag, number=20_000, repeat=5)) / 20_000 * 1e6
            row.append(f"{name} {us:.2f}")
        print(f"  {used:>5} B used: " + ", ".join(row))
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    data = bytes(64 << 20)
    print("MAC over 64 MiB of tensor data (ms; min of 3):")
    row = []
    for name, make in (
        ("keyed BLAKE2b-128", lambda: hashlib.blake2b(data, key=key, digest_size=16).digest()),
        ("HMAC-SHA256", lambda: hmac.new(key, data, "sha256").digest()),
        ("Poly1305", lambda: Poly1305.generate_tag(key, data)),
    ):
        row.append(f"{name} {min(timeit.repeat(make, number=1, repeat=3)) * 1e3:.0f}")
    print("  " + ", ".join(row))


def _two_hosts(rounds: int, calls: int, json_path: str) -> int:
    """Identity round trips of TWO_HOSTS_SIZES between two network namespaces, with and without a key."""
    import _netns
    import _results
    from bench_gloo import Pair as SystemPair
    from bench_gloo import figures, make_plan, run_rounds

    reason = _netns.why_not()
    if reason is not None:
        print(f"bench_auth --two-hosts: skipped: {reason}")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    plan = make_plan({"bw"}, calls, TWO_HOSTS_SIZES)
    systems = ("twinrpc-keyed", "twinrpc")
    with _netns.two_hosts() as hosts, tempfile.TemporaryDirectory(prefix="bench_auth-") as tmp:
        pairs = {s: SystemPair(ctx, s, tmp, hosts=hosts, port=29600 + i) for i, s in enumerate(systems)}
        try:
            for p in pairs.values():
                p.wait_ready(120)
            shm = pairs["twinrpc-keyed"].run("shm", 1)  # the same for both pairs
            per_round, wall = run_rounds(pairs, plan, rounds)
        finally:
            for p in pairs.values():
                p.stop()
    print(
        f"job key cost on large tensors between network namespaces {hosts[0].netns} and "
        f"{hosts[1].netns}: {rounds} alternating rounds in {wall:.0f} s; same-host path {shm}"
    )
    found = figures(per_round, plan, "twinrpc-keyed", "twinrpc", {})
    for f in found:
        print("  " + _results.describe(f))
    if json_path:
        doc = _results.document(
            "bench_auth",
            "twinrpc with a job key against twinrpc without one, between two network namespaces",
            f"python benchmarks/bench_auth.py --two-hosts --rounds {rounds} --calls {calls}",
            found,
            rounds=rounds,
            extra={"shared_memory": shm},
        )
        _results.write(json_path, doc)
        print(f"  written: {json_path}")
    return 0


#: the tensor sizes of --two-hosts
TWO_HOSTS_SIZES = (1 << 20, 16 << 20, 64 << 20)


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="calls per measurement")
    parser.add_argument("--mac", action="store_true", help="also time the MAC constructions alone")
    parser.add_argument(
        "--two-hosts", action="store_true", help="large tensors between two network namespaces instead"
    )
    parser.add_argument("--json", default="", help="with --two-hosts: write the figures to this file")
    args = parser.parse_args(argv)
    if args.mac:
        _mac_costs()
    if args.two_hosts:
        return _two_hosts(args.rounds, args.calls, args.json)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        pairs = [Pair(ctx, False, tmp), Pair(ctx, True, tmp)]
        results: dict[tuple[bool, str], list[float]] = {}
        cpu: dict[tuple[bool, str], list[float]] = {}
        try:
            for r in range(args.rounds):
                order = pairs if r % 2 == 0 else pairs[::-1]
                for what in ("latency", "throughput"):
                    for pair in order:
                        value, per_call = pair.run(what, args.calls)
                        results.setdefault((pair.keyed, what), []).append(value)
                        cpu.setdefault((pair.keyed, what), []).append(per_call)
        finally:
            for pair in pairs:
                pair.stop()
    lat = {k: statistics.median(results[(k, "latency")]) * 1e6 for k in (False, True)}
    thr = {k: statistics.median(results[(k, "throughput")]) for k in (False, True)}
    print(f"job key cost ({args.rounds} rounds x {args.calls} calls, alternating; medians):")
    print(
        f"  rpc_sync latency: no key {lat[False]:.0f} us, key {lat[True]:.0f} us ({lat[True] / lat[False]:.3f}x)"
    )
    print(
        f"  {WINDOW} in flight: no key {thr[False]:.0f} calls/s, key {thr[True]:.0f} calls/s "
        f"({thr[True] / thr[False]:.3f}x)"
    )
    for what in ("latency", "throughput"):
        use = {k: statistics.median(cpu[(k, what)]) * 1e6 for k in (False, True)}
        print(
            f"  CPU per call ({what}), both processes: no key {use[False]:.0f} us, key {use[True]:.0f} us "
            f"({use[True] - use[False]:+.0f} us, {use[True] / use[False]:.3f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
