"""RRef memory soak: N create / to_here / delete cycles, owner-side state counted before and after.

    python benchmarks/bench_rref_soak.py --world sim --cycles 100000
    python benchmarks/bench_rref_soak.py --world gloo --cycles 100000   # two spawned processes

Worker 0 runs ``rpc.remote(worker1, make) ; rref.to_here() ; del rref`` N times; before and after,
worker 1 (the owner) reports its RRef state (``_get_debug_info()``: owner RRefs, forks, pending
users/children, unacked control messages, deferred deletes) and the number of live owner-side values.
Any growth is printed and fails the run (exit status 1). ``--world gloo`` runs the same driver in two
spawned processes over twinrpc's gloo world; ``nox -s bench`` runs it with fewer cycles (see noxfile.py),
since a gloo cycle is three real round trips.
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from typing import Any

import _cli  # benchmarks/_cli.py (the script's directory is on sys.path)

_COUNTED = (
    "num_owner_rrefs",
    "num_forks",
    "num_pending_users",
    "num_pending_children",
    "num_pending_futures",
    "num_deferred_deletes",
    "num_control_unacked",
)


class Payload:
    """The owner-side value; instances are counted through a WeakSet."""

    __slots__ = ("__weakref__", "n")

    def __init__(self, n: int) -> None:
        self.n = n


_LIVE: weakref.WeakSet[Payload] = weakref.WeakSet()


def make(n: int) -> Payload:
    p = Payload(n)
    _LIVE.add(p)
    return p


def owner_state() -> dict[str, int]:
    import twinrpc.rpc as rpc

    gc.collect()
    info = rpc._get_debug_info()
    counts = {k: int(info[k]) for k in _COUNTED}
    counts["live_values"] = len(_LIVE)
    return counts


def _settle(seconds: float) -> None:
    from twinrpc.simulator import sleep

    sleep(seconds)


def driver(cycles: int, settle: Any = _settle) -> dict[str, Any]:
    import twinrpc.rpc as rpc

    before = rpc.rpc_sync("worker1", owner_state)
    t0 = time.perf_counter()
    for i in range(cycles):
        rref = rpc.remote("worker1", make, args=(i,))
        value = rref.to_here()
        assert value.n == i
        del rref, value
    wall = time.perf_counter() - t0
    settle(1.0)  # the last deletes (sent from tasks after a seeded delay) reach the owner
    after = rpc.rpc_sync("worker1", owner_state)
    return {"before": before, "after": after, "wall": wall}


def run_sim(cycles: int, seed: int) -> dict[str, Any]:
    from twinrpc.simulator import Simulation

    import twinrpc.rpc as rpc

    def program(rank: int) -> Any:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        try:
            return driver(cycles) if rank == 0 else None
        finally:
            rpc.shutdown()

    # No trace (it would grow with N by design) and no monitors (they keep per-fork history).
    sim = Simulation(2, seed=seed, trace=False, monitors=False)
    return dict(sim.run(program).values()[0])


def _gloo_worker(rank: int, init_method: str, cycles: int, conn: Any) -> None:
    import twinrpc.rpc as rpc

    opts = rpc.RpcBackendOptions(init_method=init_method)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out = None
    try:
        if rank == 0:
            out = driver(cycles, settle=time.sleep)
    finally:
        rpc.shutdown()
    conn.send(out)


def run_gloo(cycles: int) -> dict[str, Any]:
    """Two spawned processes over twinrpc's gloo world (rendezvous through a file)."""
    from _two_workers import run_two

    return dict(run_two(_gloo_worker, cycles, prefix="rref_soak-")[0])


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--world", choices=["sim", "gloo"], default="sim")
    parser.add_argument("--cycles", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error("--cycles must be at least 1")
    out = run_gloo(args.cycles) if args.world == "gloo" else run_sim(args.cycles, args.seed)
    before, after = out["before"], out["after"]
    print(
        f"RRef soak on {args.world}: {args.cycles} create/to_here/delete cycles in {out['wall']:.1f} s wall"
    )
    print(f"  {'owner-side state':<22} {'before':>8} {'after':>8}")
    grew = []
    for key in (*_COUNTED, "live_values"):
        print(f"  {key:<22} {before[key]:>8} {after[key]:>8}")
        if after[key] > before[key]:
            grew.append(key)
    if grew:
        print(f"GROWTH in {', '.join(grew)}: owner-side RRef state leaks")
        return 1
    print("no growth of owner-side state")
    return 0


if __name__ == "__main__":
    sys.exit(main())
