"""Calibrate the simulator's network model against the gloo world, and check it on the training job.

In one run:

1. Two twinrpc workers over gloo (real processes) measure ``rpc_sync`` round trips of a small
   argument and of float32 tensors from 1 KiB to 16 MiB, and small calls with 64 in flight
   (:func:`twinrpc.simulator.calibration.measure`), twice: on this host (the gloo world's
   shared-memory path, unless ``TWINRPC_SHM=0``), and between two hosts: two network namespaces
   joined by a veth pair (``benchmarks/_netns.py``, the setup of ``tests/gloo/test_two_hosts.py``; needs
   root). Where namespaces cannot be made, the loopback gloo path with ``TWINRPC_SHM=0`` stands for
   the link between hosts, and the output says so. A raw gloo pair measures the transport's own
   ping-pong floor on this host for reference.
2. :func:`~twinrpc.simulator.calibration.fit_network_model` fits ``latency``, ``jitter`` and
   ``bandwidth`` (between hosts), ``same_host_latency``, ``same_host_jitter`` and
   ``same_host_bandwidth`` (on one host) and ``message_cost`` (both) by least squares; the
   parameters and the residuals are printed, and the model is saved as TOML (``--out``;
   ``python -m twinrpc.simulator run --network FILE``; place workers on hosts with
   ``NetworkModel.with_hosts`` for its same-host parameters to apply).
3. The parameter-server job (examples/parameter_server.py, 1 server + 2 trainers, ``--batches``
   batches each) runs on gloo for real (all on this host) and in the simulator with the default
   and the calibrated model, its workers placed on one host; the training phase's real wall time is
   compared with its simulated virtual time.
4. Computation: on its own the simulator charges nothing for it (forward and backward passes,
   optimizer steps). A :class:`~twinrpc.simulator.ComputeModel` (a cost per torch operator and per
   FLOP) is fitted to the job's computation timed alone in this process at three batch sizes, and
   the job is simulated again with it. For comparison, the computation's measured time is also
   simply added to the calibrated network row (arithmetic outside the simulator).

Run: ``nox -s bench`` or ``python benchmarks/bench_calibration.py [--quick] [--out FILE] [--compute-out FILE]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import _cli  # noqa: E402
import _netns  # noqa: E402
import _results  # noqa: E402
import parameter_server as ps  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from twinrpc.simulator import ComputeModel, NetworkModel, Simulation, now  # noqa: E402
from twinrpc.simulator.calibration import (  # noqa: E402
    DEFAULT_SIZES,
    ComputeSample,
    Pipelined,
    RoundTrip,
    count_operations,
    fit_compute_model,
    fit_network_model,
    measure,
)

import twinrpc.rpc as rpc  # noqa: E402

# The job's data is loaded once per process, before the timed phase (reading it is not the job).
ps.load_data = functools.lru_cache(maxsize=None)(ps.load_data)


class _Quiet:
    """A progress bar that shows nothing (the job's tqdm bars would interleave with the report)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


# -- what runs on the workers (either world) -------------------------------------------------------------
def calibration_worker(rank: int, how: tuple[bool, bool], options: Any = None) -> Any:
    """Rank 0 measures its link to rank 1; ``how`` = (quick, the two run on one host)."""
    quick, same_host = how
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out = None
    if rank == 0:
        if quick:
            out = measure(
                "worker1",
                calls=40,
                max_bytes_per_size=32 * 1024 * 1024,
                pipelined_calls=400,
                same_host=same_host,
            )
        else:
            out = measure("worker1", calls=300, pipelined_calls=3000, same_host=same_host)
    rpc.shutdown()
    return out


def job_args(world_size: int, batches: int) -> argparse.Namespace:
    return argparse.Namespace(
        world_size=world_size,
        epochs=1,
        batch_size=32,
        lr=0.03,
        data_dir=None,
        max_batches=batches,
        world="bench",
    )


def job_worker(rank: int, args: argparse.Namespace, options: Any = None) -> tuple[float, float]:
    """The training phase of examples/parameter_server.py; returns when it started and ended on this
    worker (virtual seconds in a simulation, monotonic wall-clock seconds on gloo)."""
    ps.load_data(args.data_dir)
    name = ps.SERVER if rank == 0 else f"trainer_{rank}"
    rpc.init_rpc(name, rank=rank, world_size=args.world_size, rpc_backend_options=options)
    t0 = now()
    if rank != 0:
        ps.run_training_loop(rank, args, _Quiet)
    t1 = now()
    rpc.shutdown()
    ps._servers.pop(ps.SERVER, None)
    return t0, t1


def job_time(spans: list[tuple[float, float]]) -> float:
    """From the first trainer's start to the last trainer's end (rank 0 is the server)."""
    trainers = spans[1:]
    return max(t1 for _, t1 in trainers) - min(t0 for t0, _ in trainers)


# -- real processes ------------------------------------------------------------------------------------
def _child(target: str, rank: int, init_method: str, conn: Any, args: Any, host: Any = None) -> None:
    if host is not None:  # this rank stands on a host of its own: a network namespace
        _netns.enter(host)
    torch.set_num_threads(1)
    logging.getLogger("twinrpc.impl").setLevel(logging.ERROR)
    try:
        if target == "raw":
            result: Any = _raw_gloo(rank, init_method, args)
        else:
            options = rpc.RpcBackendOptions(init_method=init_method, rpc_timeout=120)
            fn = calibration_worker if target == "calibrate" else job_worker
            result = fn(rank, args, options)
    except BaseException as exc:  # report, don't hang the parent
        result = RuntimeError(f"{target} rank {rank}: {exc!r}")
    conn.send(result)


def _raw_gloo(rank: int, init_method: str, calls: int) -> Any:
    """torch.distributed send/recv ping-pong with an explicit source: the transport's floor."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    out: dict[int, float] = {}
    for nbytes in (4, 16 * 1024 * 1024):
        buf = torch.ones(nbytes, dtype=torch.uint8)
        n = calls if nbytes < 1024 else max(5, calls // 10)
        samples = []
        for _ in range(n + 2):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, dst=1)
                dist.recv(buf, src=1)
            else:
                dist.recv(buf, src=0)
                dist.send(buf, dst=0)
            samples.append(time.perf_counter() - t0)
        out[nbytes] = statistics.median(samples[2:])
    dist.destroy_process_group()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(
    target: str, world_size: int, args: Any, timeout: float = 600.0, hosts: Any = None
) -> list[Any]:
    """Run ``target`` as ``world_size`` real processes; returns each rank's result. With ``hosts``
    (two :class:`_netns.Host`), rank r runs in ``hosts[r]``'s network namespace."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench_calibration-") as tmp:
        if hosts is not None:
            init = f"tcp://{hosts[0].address}:29500"
        elif target == "raw":
            init = f"tcp://127.0.0.1:{_free_port()}"
        else:
            init = f"file://{tmp}/rendezvous"
        conns, procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            host = None if hosts is None else hosts[rank]
            p = ctx.Process(target=_child, args=(target, rank, init, child, args, host), daemon=True)
            p.start()
            conns.append(parent)
            procs.append(p)
        results = []
        deadline = time.monotonic() + timeout
        for c in conns:
            if not c.poll(max(0.0, deadline - time.monotonic())):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{target}: workers did not finish within {timeout:.0f} s")
            results.append(c.recv())
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


# -- computation, on its own -------------------------------------------------------------------------------
def local_compute(args: argparse.Namespace) -> float:
    """Wall seconds of the job's computation without RPC: every trainer's batches through the server's
    model (its snapshot forward), the loss, a local backward and an SGD step, in one process."""
    x_train, y_train, _, _ = ps.load_data(args.data_dir)
    server = ps.ParameterServer(x_train.shape[-1])
    opt = torch.optim.SGD(server.model.parameters(), lr=args.lr, momentum=0.9)
    trainers = args.world_size - 1
    t0 = time.perf_counter()
    for rank in range(1, trainers + 1):
        mine = torch.arange(rank - 1, len(y_train), trainers)
        x, y = x_train[mine], y_train[mine]
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(rank))
        for b in range(min((len(y) + args.batch_size - 1) // args.batch_size, args.max_batches)):
            idx = order[b * args.batch_size : (b + 1) * args.batch_size]
            loss = F.nll_loss(server(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return time.perf_counter() - t0


def compute_samples(args: argparse.Namespace, repeat: int) -> list[ComputeSample]:
    """The job's computation at three batch sizes (different FLOPs per operator): operators and FLOPs
    counted once (counting slows torch down), wall time the median of ``repeat`` uncounted runs taken
    in interleaved rounds, so that every size sees the same load from the rest of the machine."""
    sizes = (8, 32, 128)
    variants = [argparse.Namespace(**{**vars(args), "batch_size": b}) for b in sizes]
    counts = []
    for a in variants:
        local_compute(a)  # warm-up
        _, ops, flops = count_operations(local_compute, a)
        counts.append((ops, flops))
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeat):
        for i, a in enumerate(variants):
            times[i].append(local_compute(a))
    return [
        ComputeSample(ops, flops, statistics.median(t), f"batch {b}: {ops:,} ops, {flops / 1e9:.2f} GFLOP")
        for b, (ops, flops), t in zip(sizes, counts, times, strict=True)
    ]


def simulate_job(
    args: argparse.Namespace, model: NetworkModel, seed: int, compute: ComputeModel | None = None
) -> tuple[float, float, dict[str, int]]:
    """(virtual job time, wall seconds the simulation took, message counts) of one simulated run."""
    sim = Simulation(args.world_size, seed=seed, network=model, compute=compute)
    t0 = time.perf_counter()
    result = sim.run(job_worker, args)
    wall = time.perf_counter() - t0
    events = result.trace.events()
    counts = {
        "messages": sum(1 for e in events if e.event == "send"),
        "server": sum(1 for e in events if e.worker == 0 and e.event in ("send", "deliver")),
    }
    return job_time(result.values()), wall, counts


# -- report ------------------------------------------------------------------------------------------------
def _us(x: float) -> str:
    return f"{x * 1e6:,.1f} us"


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--batches", type=int, default=20, help="batches per trainer in the job")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="build/bench/network-calibrated.toml")
    parser.add_argument("--compute-out", default="build/bench/compute-calibrated.toml")
    parser.add_argument(
        "--json", default="", help="write the fitted model to this file (the results page's input)"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    print(
        f"calibration: the simulator's network model fitted to the gloo world on this machine ({os.cpu_count()} CPUs)"
    )

    # 1. measure: on this host, then between two hosts (namespaces), or loopback without shared memory
    same = run_processes("calibrate", 2, (args.quick, True))[0]
    reason = _netns.why_not()
    if reason is None:
        with _netns.two_hosts() as hosts:
            cross = run_processes("calibrate", 2, (args.quick, False), hosts=hosts)[0]
        between = "two network namespaces joined by a veth pair"
    else:
        previous = os.environ.get("TWINRPC_SHM")
        os.environ["TWINRPC_SHM"] = "0"
        try:
            cross = run_processes("calibrate", 2, (args.quick, False))[0]
        finally:
            if previous is None:
                os.environ.pop("TWINRPC_SHM")
            else:
                os.environ["TWINRPC_SHM"] = previous
        between = f"no second host ({reason}): loopback gloo with TWINRPC_SHM=0 stands for it"
    floor = run_processes("raw", 2, 60 if args.quick else 300)[0]
    samples = [*same, *cross]
    trips = [s for s in samples if isinstance(s, RoundTrip)]
    pipes = [s for s in samples if isinstance(s, Pipelined)]
    for title, group in (("on this host", same), (f"between hosts ({between})", cross)):
        print(f"  measured on gloo, {title} (two twinrpc processes; median of each size):")
        for size, s in zip(DEFAULT_SIZES, [x for x in group if isinstance(x, RoundTrip)], strict=True):
            what = "small argument" if size == 0 else f"{size // 1024:,} KiB tensor"
            print(f"    rpc_sync {what:<20} {_us(s.seconds):>14}  (10-90% spread {_us(s.spread)})")
        for p in group:
            if isinstance(p, Pipelined):
                print(f"    rpc_async, {p.in_flight} in flight    {_us(p.seconds_per_call):>14} per call")
    print(
        f"    raw gloo ping-pong on this host (reference): 4 B {_us(floor[4])}, 16 MiB "
        f"{floor[16 * 1024 * 1024] * 1e3:.2f} ms"
    )

    # 2. fit
    fit = fit_network_model(trips, pipes)
    model = fit.model
    print("  fitted (weighted least squares on relative error; residual = model vs measured):")
    print("    " + fit.describe().replace("\n", "\n    "))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.dump(out)
    print(
        f"  saved: {out}  (python -m twinrpc.simulator run --network {out} ...; its same-host parameters "
        "apply to workers placed on one host: NetworkModel.with_hosts)"
    )
    small_rtt = min(s.seconds for s in trips if s.same_host)
    same_pipes = [p for p in pipes if p.same_host]
    if same_pipes and same_pipes[0].seconds_per_call > small_rtt / 2:
        print(
            f"  note: with {same_pipes[0].in_flight} calls in flight a call took "
            f"{_us(same_pipes[0].seconds_per_call)}, more than half a small round trip ({_us(small_rtt / 2)}), "
            "the most the model allows (a round trip holds 4 message costs, a pipelined call 2 per worker): "
            "here concurrency costs more per message than a lone call (cores shared with other load, thread "
            "hand-offs), which the model does not have; the fit compromises (see the residuals)"
        )
    print(
        f"  of a small round trip on this host ({_us(small_rtt)}), the model puts {_us(4 * model.message_cost)} "
        f"in message handling (4 x message_cost: pickling, framing, dispatch at both ends) and "
        f"{_us(2 * model.same_host_latency + model.same_host_jitter)} on the link; raw gloo's round trip is "
        f"{_us(floor[4])}"
    )
    if args.json:
        doc = _results.document(
            "bench_calibration",
            "the simulator's network model fitted to the gloo world",
            "python benchmarks/bench_calibration.py" + (" --quick" if args.quick else ""),
            [],
            rounds=1,
            extra={
                "model": (
                    f"between hosts ({between}): latency {model.latency * 1e6:.1f} us, jitter "
                    f"{model.jitter * 1e6:.1f} us, bandwidth {model.bandwidth / 1e9:.2f} GB/s; on one host: "
                    f"latency {model.same_host_latency * 1e6:.1f} us, jitter {model.same_host_jitter * 1e6:.1f} us, "
                    f"bandwidth {model.same_host_bandwidth / 1e9:.2f} GB/s; message_cost "
                    f"{model.message_cost * 1e6:.1f} us; rms relative error {fit.rms_relative_error:.1%}"
                )
            },
        )
        _results.write(args.json, doc)
        print(f"  written: {args.json}")
    # the real job runs on this host: simulate it with its workers on one host
    model = model.with_hosts(workers_per_host=args.trainers + 1)

    # 3. the training job
    jargs = job_args(args.trainers + 1, args.batches)
    print(
        f"  parameter-server job (examples/parameter_server.py): 1 server + {args.trainers} trainers, "
        f"{args.batches} batches of {jargs.batch_size} each; training phase only"
    )
    real = job_time(run_processes("job", jargs.world_size, jargs))
    compute_fit = fit_compute_model(compute_samples(jargs, 2 if args.quick else 5))
    print("  compute model fitted to the job's computation timed alone (one process, local autograd):")
    print("    " + compute_fit.describe().replace("\n", "\n    "))
    compute_out = Path(args.compute_out)
    compute_out.parent.mkdir(parents=True, exist_ok=True)
    compute_fit.model.dump(compute_out)
    print(f"    saved: {compute_out}  (python -m twinrpc.simulator run --compute {compute_out} ...)")
    calibrated, sim_wall, counts = simulate_job(jargs, model, args.seed)
    default, _, _ = simulate_job(jargs, NetworkModel(), args.seed)
    with_compute, compute_wall, _ = simulate_job(jargs, model, args.seed, compute_fit.model)
    compute = local_compute(jargs)
    busy = counts["server"] * model.message_cost
    rows = [
        ("gloo, real processes (wall)", real),
        ("simulator, default network model (virtual)", default),
        ("simulator, calibrated network model (virtual)", calibrated),
        ("simulator, calibrated network + compute model (virtual)", with_compute),
        ("calibrated network + computation timed alone (arithmetic)", calibrated + compute),
    ]
    for label, t in rows:
        print(f"    {label:<60} {t * 1e3:>9.1f} ms   {t / real:>6.2f} x real")
    print(
        f"    {counts['messages']:,} messages in the simulated job, every one with the server at one end: "
        f"{busy * 1e3:.1f} ms of the server's time at message_cost"
    )
    print(
        f"    the job's computation alone (forward, loss, backward, SGD step; one process): {compute * 1e3:.1f} ms"
    )
    print(
        f"    simulating the job took {sim_wall:.2f} s of wall time ({compute_wall:.2f} s counting operators "
        "for the compute model)"
    )
    print(
        "  what the models cover: link latency and jitter, bandwidth, a fixed handling cost per message, "
        "and (compute model) a cost per torch operator and per FLOP, all queued per worker, all "
        "deterministic. Not covered: per-byte CPU work beyond the bandwidth term, Python work that runs no "
        "torch operator (twinrpc's protocol and autograd bookkeeping beyond message_cost, the user's own "
        "Python), thread scheduling inside a process, the OS scheduler and other load on this machine. "
        "Without the compute model the simulator charges nothing for computation; that is most of the gap "
        "between the calibrated network row and real time."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
