"""Two hosts: twinrpc between two network namespaces against the raw gloo floor measured there.

Two Linux network namespaces joined by a veth pair stand for two machines (the setup of
``tests/gloo/test_two_hosts.py``, in ``benchmarks/_netns.py``): every byte between the two workers crosses
the veth pair through the kernel's TCP stack, and the gloo world's same-host path (shared memory) is
off, as between hosts. Rank 0 of each pair runs in namespace A, rank 1 in B. Measured, in alternating
rounds as ``bench_gloo.py`` does: the round-trip latency of ``rpc_sync`` with a builtin and with a tiny
UDF, and identity round trips of 16 and 64 MiB (a UDF returning its tensor argument; GB/s = 2 x size /
round-trip time), for twinrpc and for raw gloo (``torch.distributed`` send/recv ping-pong with an
explicit source and reused buffers: the floor under twinrpc's transport). twinrpc runs twice, without
and with a job key (``auth_key``: every frame and every storage sent over gloo authenticated,
impl/_auth.py), and TensorPipe runs too, for reference. Each figure is a twinrpc world's ratio to the raw
gloo floor (the median over rounds of the ratio within a round).

A veth pair is not a wire: it has no bandwidth limit or propagation delay of its own, so these figures
measure what twinrpc adds to gloo's TCP path between hosts (copies, framing, Python), not a network.

Needs root and iproute2 (``ip netns``). Run: ``nox -s bench`` or
``python benchmarks/bench_two_hosts.py [--rounds R] [--calls N] [--json FILE]``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import tempfile

import _cli
import _netns
import _results
import bench_gloo
from bench_gloo import MiB, Pair, figures, make_plan, run_rounds

SIZES = (16 * MiB, 64 * MiB)
#: twinrpc / raw gloo, what each figure aims at: the big round trips move the same bytes over the same
#: TCP connections as the floor, so they should come within 10% of it; a small call's latency holds
#: twinrpc's whole protocol (pickling, dispatch, a thread hand-off each way) against two bare messages,
#: and is reported without a target
TARGETS = {
    "bw 16 MiB": (">=", 0.9),
    "bw 64 MiB": (">=", 0.9),
}
SYSTEMS = ("twinrpc", "twinrpc-keyed", "gloo", "tensorpipe")
#: the figures of the world with a job key carry this after their key and label
KEYED = (" keyed", " with a job key")


def _measures(system: str, what: str) -> bool:
    return what in ("builtin", "udf", "bw")


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300, help="latency samples per system per round")
    parser.add_argument("--no-tensorpipe", action="store_true", help="leave TensorPipe out")
    parser.add_argument(
        "--json", default="", help="write the figures to this file (the results page's input)"
    )
    args = parser.parse_args(argv)
    reason = _netns.why_not()
    if reason is not None:
        print(f"bench_two_hosts: skipped: {reason}")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    systems = tuple(s for s in SYSTEMS if not (args.no_tensorpipe and s == "tensorpipe"))
    plan = make_plan({"builtin", "udf", "bw"}, args.calls, SIZES)
    with _netns.two_hosts() as hosts, tempfile.TemporaryDirectory(prefix="bench_two_hosts-") as tmp:
        pairs = {s: Pair(ctx, s, tmp, hosts=hosts, port=29500 + i) for i, s in enumerate(systems)}
        try:
            for p in pairs.values():
                p.wait_ready(120)
            shm = pairs["twinrpc"].run("shm", 1)
            per_round, wall = run_rounds(pairs, plan, args.rounds, _measures)
        finally:
            for p in pairs.values():
                p.stop()
    print(
        f"two hosts (network namespaces {hosts[0].netns} and {hosts[1].netns}, veth pair): twinrpc vs raw "
        f"gloo vs TensorPipe; {args.rounds} interleaved rounds in {wall:.0f} s; {os.cpu_count()} CPUs"
    )
    print(f"  twinrpc's link between the namespaces uses shared memory: {shm}")
    for name, what, _n, size in plan:
        cells = []
        for s in systems:
            rounds = per_round.get((name, s))
            if rounds:
                value = statistics.median(bench_gloo.round_value(what, size, r) for r in rounds)
                cells.append(f"{s} {value:,.4g}")
        unit = "GB/s" if what == "bw" else "us (median)"
        print(f"  {name:<10} {unit:<12} " + ", ".join(cells))
    found = figures(per_round, plan, "twinrpc", "gloo", TARGETS)
    for f in figures(per_round, plan, "twinrpc-keyed", "gloo", TARGETS):
        f["key"] += KEYED[0]
        f["label"] += KEYED[1]
        found.append(f)
    print("figures (ratio = median over rounds of a twinrpc world / raw gloo within the round):")
    for f in found:
        print("  " + _results.describe(f))
    if args.json:
        reference = {}
        if "tensorpipe" in systems:
            reference = {
                name: statistics.median(
                    bench_gloo.round_value(what, size, r) for r in per_round[(name, "tensorpipe")]
                )
                for name, what, _n, size in plan
                if (name, "tensorpipe") in per_round
            }
        doc = _results.document(
            "bench_two_hosts",
            "twinrpc between two network namespaces (a veth pair) against the raw gloo floor there",
            f"python benchmarks/bench_two_hosts.py --rounds {args.rounds} --calls {args.calls}",
            found,
            rounds=args.rounds,
            extra={"tensorpipe": reference, "shared_memory": shm},
        )
        _results.write(args.json, doc)
        print(f"  written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
