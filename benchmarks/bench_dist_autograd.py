"""Distributed autograd per second, twinrpc (gloo world) vs PyTorch (TensorPipe): two loops.

``step`` (forward + backward + optimizer step): worker1 owns a 256x256 weight (held in an RRef);
worker0 sends a 256x256 input, worker1 multiplies (the matmul crosses the boundary both ways: input
out, result back), worker0 takes the loss, runs the distributed backward (gradients return to
worker1) and steps a DistributedOptimizer (SGD).

``iteration`` (a distributed-autograd iteration): worker0 calls ``rpc_sync(torch.matmul)`` on two
256x256 tensors that both require grad, runs the distributed backward of the result's sum (the
gradient goes to worker1 and both input gradients come back) and reads them with ``get_gradients``.

The third row, ``raw gloo``, is the floor under twinrpc: the same messages (a 4 KiB header frame per
message, the 256 KiB tensors, the gradient, the step, the context cleanup, each answered) and the same
two matmuls and SGD update, sent with ``torch.distributed`` send/recv from Python, with no RPC layer.
twinrpc's rate against it shows what the RPC layer itself costs.

Each launch of a system (two fresh processes) runs one warm-up round and ``--rounds`` measured rounds
of ``--iters`` iterations. Launches alternate between the systems (``--repeat`` of each), because one
system's rate moves by up to 30% from one launch to the next on a small machine (TensorPipe's most);
each system's median is over all its measured rounds, and the ratio twinrpc / TensorPipe is the median
over the repeats of the ratio of the two launches of a repeat (back to back, under the same load).
``--json FILE`` writes the loops' figures for the results page (``benchmarks/render_results.py``). Each system's CPU time per iteration (user and
system, every thread of each worker process) is printed too: TensorPipe's threads poll while they
wait, so it buys latency with CPU that a busy machine does not have.

    python benchmarks/bench_dist_autograd.py [--loop step|iteration] [--iters 300] [--rounds 2]
        [--repeat 3] [--only twinrpc] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib
import resource
import statistics
import tempfile
import time
from typing import Any

import _cli
import _results  # benchmarks/_results.py (the script's directory is on sys.path)
import torch
import torch.multiprocessing as mp

SYSTEMS = {
    "twinrpc": ("twinrpc.rpc", "twinrpc.autograd", "twinrpc.optim"),
    "torch": ("torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim"),
}
#: what one run launches: the two RPC systems, and the floor under twinrpc (see the module docstring)
RUNS = [*SYSTEMS, "raw gloo"]
LOOPS = ("step", "iteration")
#: the ratio to TensorPipe each loop aims at
TARGETS = {"step": 1.0, "iteration": 0.8}


def _weight() -> torch.Tensor:
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).requires_grad_()


def _mm(w: Any, x: torch.Tensor) -> torch.Tensor:
    return x @ w.local_value()


def _cpu_seconds() -> float:
    """CPU time (user and system, all threads) this process has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


#: what a launch reports: its system, then per measured round the rate (it/s) and each worker's CPU
#: seconds per iteration
Rounds = list[tuple[float, float, float]]


def _worker(rank: int, system: str, loop: str, init: str, iters: int, rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    rpc, dist_autograd, optim = (importlib.import_module(m) for m in SYSTEMS[system])
    if system == "torch":
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, num_worker_threads=8)
    else:
        opts = rpc.RpcBackendOptions(init_method=init)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        if loop == "step":
            w = rpc.remote("worker1", _weight)
            opt = optim.DistributedOptimizer(torch.optim.SGD, [w], lr=1e-6)
            x = torch.randn(256, 256)

            def one() -> None:
                with dist_autograd.context() as cid:
                    loss = rpc.rpc_sync("worker1", _mm, args=(w, x)).sum()
                    dist_autograd.backward(cid, [loss])
                    opt.step(cid)
        else:
            a, b = _weight(), _weight()

            def one() -> None:
                with dist_autograd.context() as cid:
                    y = rpc.rpc_sync("worker1", torch.matmul, args=(a, b))
                    dist_autograd.backward(cid, [y.sum()])
                    grads = dist_autograd.get_gradients(cid)
                    assert len(grads) == 2

        measured: Rounds = []
        for r in range(rounds + 1):
            start0, start1 = _cpu_seconds(), rpc.rpc_sync("worker1", _cpu_seconds)
            t0 = time.perf_counter()
            for _ in range(iters):
                one()
            elapsed = time.perf_counter() - t0
            spent0 = _cpu_seconds() - start0
            spent1 = rpc.rpc_sync("worker1", _cpu_seconds) - start1
            if r:  # the first round warms up
                measured.append((iters / elapsed, spent0 / iters, spent1 / iters))
        out.put((system, measured))
    rpc.shutdown()


def _raw_worker(rank: int, init: str, iters: int, rounds: int, out: Any) -> None:
    """The benchmark's messages and computation over raw gloo (see the module docstring)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    peer = 1 - rank
    header = torch.zeros(4096, dtype=torch.uint8)
    x = torch.randn(256, 256)
    w = _weight()
    buf = torch.empty(256, 256)

    def exchange(*frames: torch.Tensor, receive: tuple[torch.Tensor, ...] = ()) -> None:
        for t in frames:
            dist.send(t, peer)
        for t in receive:
            dist.recv(t, peer)

    measured: Rounds = []
    for r in range(rounds + 1):
        start = _cpu_seconds()
        t0 = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                exchange(header, x, receive=(header, buf))  # forward
                loss = buf.sum()
                exchange(header, torch.ones_like(loss).expand(256, 256).contiguous(), receive=(header,))
                exchange(header, receive=(header,))  # step
                exchange(header, receive=(header,))  # context cleanup
            else:
                exchange(receive=(header, buf))
                y = buf @ w.detach()
                exchange(header, y, receive=(header, buf))
                grad = x.t() @ buf
                exchange(header, receive=(header,))
                with torch.no_grad():
                    w.add_(grad, alpha=-1e-6)
                exchange(header, receive=(header,))
                exchange(header)
        elapsed = time.perf_counter() - t0
        spent = torch.tensor([(_cpu_seconds() - start) / iters], dtype=torch.float64)
        if rank == 1:
            dist.send(spent, 0)
        else:
            theirs = torch.empty(1, dtype=torch.float64)
            dist.recv(theirs, 1)
            if r:
                measured.append((iters / elapsed, spent.item(), theirs.item()))
    if rank == 0:
        out.put(("raw gloo", measured))
    dist.destroy_process_group()


def _launch(system: str, loop: str, iters: int, rounds: int) -> Rounds:
    q = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as d:
        worker, args = (
            (_raw_worker, (f"file://{d}/rdv", iters, rounds, q))
            if system == "raw gloo"
            else (_worker, (system, loop, f"file://{d}/rdv", iters, rounds, q))
        )
        mp.start_processes(
            worker,
            args=args,
            nprocs=2,
            start_method="spawn",
        )
    name, measured = q.get()
    assert name == system
    return list(measured)


def main() -> None:
    parser = _cli.parser(__doc__)
    parser.add_argument("--iters", type=int, default=300, help="iterations per round")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per launch")
    parser.add_argument("--repeat", type=int, default=3, help="launches of each system, alternating")
    parser.add_argument("--only", choices=RUNS, help="run one system (e.g. under a profiler)")
    parser.add_argument("--loop", choices=LOOPS, action="append", help="the loops to run (default: both)")
    parser.add_argument(
        "--json", default="", help="write the loops' figures to this file (the results page's input)"
    )
    args = parser.parse_args()
    found = [f for loop in args.loop or LOOPS if (f := _measure(loop, args)) is not None]
    if args.json and found:
        loops = " ".join(f"--loop {loop}" for loop in args.loop or ())
        doc = _results.document(
            "bench_dist_autograd",
            "distributed autograd, twinrpc against TensorPipe, two processes on this machine",
            f"python benchmarks/bench_dist_autograd.py --iters {args.iters} --rounds {args.rounds} "
            f"--repeat {args.repeat}" + (f" {loops}" if loops else ""),
            found,
            rounds=args.repeat,
        )
        _results.write(args.json, doc)
        print(f"written: {args.json}")


_LABELS = {
    "step": "distributed forward + backward + DistributedOptimizer step (256x256 matmul)",
    "iteration": "distributed-autograd iteration (rpc_sync(torch.matmul), backward, get_gradients)",
}


def _measure(loop: str, args: argparse.Namespace) -> dict[str, object] | None:
    # the raw gloo floor is the step loop's messages and computation
    systems = [args.only] if args.only else [s for s in RUNS if loop == "step" or s != "raw gloo"]
    results: dict[str, Rounds] = {s: [] for s in systems}
    #: per repeat, twinrpc's rate / TensorPipe's (medians of the two launches, back to back)
    repeat_ratios: list[float] = []
    for r in range(args.repeat):
        launched: dict[str, Rounds] = {}
        for system in systems if r % 2 == 0 else reversed(systems):
            launched[system] = _launch(system, loop, args.iters, args.rounds)
            results[system] += launched[system]
        if "twinrpc" in launched and "torch" in launched:
            repeat_ratios.append(
                statistics.median(x for x, _, _ in launched["twinrpc"])
                / statistics.median(x for x, _, _ in launched["torch"])
            )
    if loop == "step":
        print("distributed forward+backward+step, 2 workers, 256x256 matmul across the boundary (it/s)")
    else:
        print(
            "distributed-autograd iteration: rpc_sync(torch.matmul) of two 256x256 tensors requiring grad, "
        )
        print("backward, get_gradients; 2 workers (it/s)")
    medians: dict[str, float] = {}
    for name, measured in results.items():
        rates = [rate for rate, _, _ in measured]
        medians[name] = statistics.median(rates)
        cpu0 = statistics.median(c for _, c, _ in measured) * 1e3
        cpu1 = statistics.median(c for _, _, c in measured) * 1e3
        print(
            f"  {name:<8} median {medians[name]:8.1f}  (min {min(rates):.1f}, max {max(rates):.1f})"
            f"  CPU per iteration: worker0 {cpu0:.2f} ms, worker1 {cpu1:.2f} ms"
        )
    if args.only:
        return None
    twinrpc = medians["twinrpc"]
    found = _results.figure(
        loop,
        _LABELS[loop],
        "it/s",
        True,
        {"twinrpc": twinrpc, "tensorpipe": medians["torch"]},
        repeat_ratios,
        (">=", TARGETS[loop]),
    )
    print(
        f"  twinrpc / torch: {found['ratio']:.2f}x, median over {len(repeat_ratios)} alternating repeats "
        f"(target >= {TARGETS[loop]}x)"
    )
    if "raw gloo" in medians:
        floor = 1 / medians["raw gloo"]
        print(
            f"  twinrpc's RPC layer: {(1 / twinrpc - floor) * 1e6:.0f} us per iteration above raw gloo "
            f"({1 / twinrpc * 1e6:.0f} us against {floor * 1e6:.0f} us)"
        )
    return found


if __name__ == "__main__":
    main()
