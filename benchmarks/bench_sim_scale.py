"""Simulator scale: a parameter-server job with hundreds of simulated workers in one process.

``servers`` parameter servers each own one parameter vector; every other worker is a trainer that, for
``steps`` steps, forwards through every server (``rpc_sync``), runs a distributed backward in a
distributed autograd context and steps all servers with one ``DistributedOptimizer`` (plain SGD).
The loss is linear in the parameters, so each gradient is known in advance and the servers' final
parameters are exact whatever order the steps landed in: ``P0 - LR * sum of every trainer's inputs``.

Prints, for the trace on and off (and with ``--network FILE``, a fitted model, e.g. the one
benchmarks/bench_calibration.py writes): messages and scheduler events, wall time, virtual time,
messages per wall-clock second, the virtual/wall ratio and the process's peak RSS.

``--against M`` compares world sizes instead: the simulator's cost per message should not depend on
the size of the world. Each run is a process of its own (its peak RSS is its own): one with the
trace on per size counts the messages and scheduler events (both are the same in every run of a
seed), then ``--rounds`` rounds run each size with the trace off, in alternating order. Figures:
the message rate at M workers over the rate at ``--workers`` (the median of the rounds' ratios;
target >= 0.9), scheduler events per message (target: within 10%) and, with ``--memory W``, the
peak RSS of one run of W workers with the trace on (target: under 4 GB).

Run: ``nox -s bench`` or ``python benchmarks/bench_sim_scale.py [--workers 256] [--servers 4]
[--steps 3] [--network FILE] [--profile] [--against 2048 [--rounds 3] [--memory 8192] [--json FILE]]``.
tests/sim/test_sim_scale.py runs :func:`run_job` as a correctness test.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _cli  # benchmarks/_cli.py (the script's directory is on sys.path)
import _results
import torch
from twinrpc.simulator import NetworkModel, Simulation, WorkerOutcome

import twinrpc.autograd as dist_autograd
import twinrpc.rpc as rpc
from twinrpc.optim import DistributedOptimizer

DIM = 4
LR = 0.25
P0 = torch.tensor([1.0, -2.0, 0.5, 3.0])

# server name -> its parameter (every simulated worker runs in this process: keyed by name)
_PARAMS: dict[str, torch.Tensor] = {}


def server_name(k: int) -> str:
    return f"ps{k}"


def trainer_input(rank: int, step: int) -> torch.Tensor:
    """Trainer ``rank``'s input at ``step``: small integers, so every sum below is exact in float32."""
    return torch.tensor([float((rank + step + i) % 5 - 2) for i in range(DIM)])


def expected_parameter(world_size: int, servers: int, steps: int) -> torch.Tensor:
    """Each server's parameter after the job: the loss is ``sum_k (w_k * x).sum()``, so every step of
    every trainer subtracts ``LR * x`` from every server's parameter."""
    total = torch.zeros(DIM)
    for rank in range(servers, world_size):
        for step in range(steps):
            total += trainer_input(rank, step)
    return P0 - LR * total


# -- functions the trainers call on the servers ------------------------------------------------------
def _param_rref() -> Any:
    return rpc.RRef(_PARAMS[rpc.get_worker_info().name])


def _forward(x: torch.Tensor) -> torch.Tensor:
    return _PARAMS[rpc.get_worker_info().name] * x


def _gradient(cid: int) -> torch.Tensor:
    grads = dist_autograd.get_gradients(cid)
    return grads[_PARAMS[rpc.get_worker_info().name]].clone()


def worker(rank: int, world_size: int, servers: int, steps: int) -> Any:
    """One worker's program: a server (ranks below ``servers``) or a trainer.

    Returns a server's final parameter, or a trainer's gradient check (True when every server held
    exactly the expected gradient in the trainer's first context)."""
    is_server = rank < servers
    name = server_name(rank) if is_server else f"trainer{rank}"
    if is_server:
        _PARAMS[name] = P0.clone().requires_grad_()
    rpc.init_rpc(name, rank=rank, world_size=world_size)
    result: Any = None
    if not is_server:
        params = [rpc.rpc_sync(server_name(k), _param_rref) for k in range(servers)]
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
        result = True
        for step in range(steps):
            x = trainer_input(rank, step)
            with dist_autograd.context() as cid:
                outs = [rpc.rpc_sync(server_name(k), _forward, args=(x,)) for k in range(servers)]
                loss = torch.stack([o.sum() for o in outs]).sum()
                dist_autograd.backward(cid, [loss])
                if step == 0:
                    for k in range(servers):
                        grad = rpc.rpc_sync(server_name(k), _gradient, args=(cid,))
                        result = result and torch.equal(grad, x)
                opt.step(cid)
        del params, opt
    rpc.shutdown()
    if is_server:
        return _PARAMS.pop(name).detach().clone()
    return result


@dataclass(frozen=True)
class JobResult:
    outcomes: tuple[WorkerOutcome, ...]
    wall: float
    #: CPU time of the run (this process): less moved by other processes' load than ``wall``
    cpu: float
    virtual: float
    messages: int
    events: int
    digest: str

    @property
    def values(self) -> list[Any]:
        """Each worker's return value (None for one that failed: see ``outcomes``)."""
        return [o.value for o in self.outcomes]


def run_job(
    world_size: int = 256,
    servers: int = 4,
    steps: int = 3,
    *,
    seed: int = 0,
    trace: bool = True,
    network: NetworkModel | None = None,
) -> JobResult:
    """Run the job once; ``messages`` counts sends (known only with the trace on, else -1)."""
    sim = Simulation(world_size, seed=seed, network=network, trace=trace)
    t0, c0 = time.perf_counter(), time.process_time()
    result = sim.run(worker, world_size, servers, steps)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    messages = result.trace.count("send") if trace else -1
    return JobResult(
        result.outcomes,
        wall,
        cpu,
        result.virtual_time,
        messages,
        sim.sched.events_scheduled,
        result.digest if trace else "",
    )


def exact(result: JobResult, world_size: int, servers: int, steps: int) -> bool:
    """Whether every worker exited ok with the exact parameters and gradients."""
    expected = expected_parameter(world_size, servers, steps)
    return (
        all(o.error is None and not o.crashed for o in result.outcomes)
        and all(torch.equal(v, expected) for v in result.values[:servers])
        and all(v is True for v in result.values[servers:])
    )


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MB (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


#: the peak RSS a run of ``--memory`` workers must stay under
MEMORY_LIMIT_MB = 4096.0


def run_alone(world_size: int, servers: int, steps: int, seed: int, *, trace: bool) -> dict[str, Any]:
    """One run in a process of its own (``--one``): its figures, with the process's peak RSS."""
    command = [sys.executable, str(Path(__file__).resolve()), "--one", "--trace" if trace else "--no-trace"]
    command += ["--workers", str(world_size), "--servers", str(servers), "--steps", str(steps)]
    command += ["--seed", str(seed)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    got: dict[str, Any] = json.loads(out.splitlines()[-1])
    if not got["exact"]:
        raise SystemExit(f"bench_sim_scale: {world_size} workers: parameters or gradients WRONG")
    return got


def compare(args: Any) -> int:
    """``--against``: the cost per message at ``args.against`` workers against ``args.workers``."""
    machine = _results.machine()
    sizes = [args.workers, args.against]
    counted = {
        n: run_alone(n, args.servers, args.steps, args.seed, trace=True) for n in sizes
    }  # messages and events: the same in every run of the seed
    for n, got in counted.items():
        print(
            f"  {n:,} workers, trace on: {got['messages']:,} messages, {got['events']:,} events "
            f"({got['events'] / got['messages']:.3f} per message) in {got['wall']:.2f} s; "
            f"{got['messages'] / got['wall']:,.0f} messages/s; peak RSS {got['rss_mb']:,.0f} MB",
            flush=True,
        )
    rates: dict[int, list[float]] = {n: [] for n in sizes}
    cpu_rates: dict[int, list[float]] = {n: [] for n in sizes}
    rss: dict[int, list[float]] = {n: [] for n in sizes}
    ratios, cpu_ratios = [], []
    for round_ in range(args.rounds):
        for n in sizes if round_ % 2 == 0 else sizes[::-1]:
            got = run_alone(n, args.servers, args.steps, args.seed, trace=False)
            rates[n].append(counted[n]["messages"] / got["wall"])
            cpu_rates[n].append(counted[n]["messages"] / got["cpu"])
            rss[n].append(got["rss_mb"])
            print(
                f"  round {round_ + 1}: {n:,} workers, trace off: {got['wall']:.2f} s, "
                f"{rates[n][-1]:,.0f} messages/s ({cpu_rates[n][-1]:,.0f} per CPU second), "
                f"peak RSS {got['rss_mb']:,.0f} MB",
                flush=True,
            )
        ratios.append(rates[args.against][-1] / rates[args.workers][-1])
        cpu_ratios.append(cpu_rates[args.against][-1] / cpu_rates[args.workers][-1])
    small, large = (f"{n:,} workers" for n in sizes)
    per_message = {n: counted[n]["events"] / counted[n]["messages"] for n in sizes}
    figures = [
        _results.figure(
            "rate",
            f"simulated messages per second at {large} against {small} (trace off)",
            "messages/s",
            True,
            {large: statistics.median(rates[args.against]), small: statistics.median(rates[args.workers])},
            ratios,
            (">=", 0.9),
        ),
        _results.figure(
            "events",
            f"scheduler events per message at {large} against {small}",
            "events",
            False,
            {large: per_message[args.against], small: per_message[args.workers]},
            [per_message[args.against] / per_message[args.workers]],
            ("<=", 1.1),
        ),
    ]
    runs = [
        {
            "workers": n,
            "messages": counted[n]["messages"],
            "events": counted[n]["events"],
            "messages_per_s": statistics.median(rates[n]),
            "messages_per_cpu_s": statistics.median(cpu_rates[n]),
            "rss_mb": statistics.median(rss[n]),
            "rss_mb_trace_on": counted[n]["rss_mb"],
        }
        for n in sizes
    ]
    if args.memory:
        got = run_alone(args.memory, args.servers, args.steps, args.seed, trace=True)
        print(
            f"  {args.memory:,} workers, trace on: {got['messages']:,} messages, {got['events']:,} events "
            f"({got['events'] / got['messages']:.3f} per message) in {got['wall']:.2f} s; "
            f"peak RSS {got['rss_mb']:,.0f} MB",
            flush=True,
        )
        figures.append(
            _results.figure(
                "memory",
                f"peak RSS of {args.memory:,} simulated workers (trace on)",
                "MB",
                False,
                {f"{args.memory:,} workers": got["rss_mb"], "limit": MEMORY_LIMIT_MB},
                [got["rss_mb"] / MEMORY_LIMIT_MB],
                ("<=", 1.0),
            )
        )
        runs.append(
            {
                "workers": args.memory,
                "messages": got["messages"],
                "events": got["events"],
                "messages_per_s": got["messages"] / got["wall"],
                "rss_mb_trace_on": got["rss_mb"],
            }
        )
    for f in figures:
        print(_results.describe(f))
    print(
        f"  per CPU second (what other processes' load moves less): ratio {statistics.median(cpu_ratios):.2f} "
        f"(rounds {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f})"
    )
    if args.json:
        command = (
            f"python benchmarks/bench_sim_scale.py --workers {args.workers} --against {args.against} "
            f"--servers {args.servers} --steps {args.steps} --rounds {args.rounds}"
            + (f" --memory {args.memory}" if args.memory else "")
        )
        doc = _results.document(
            "bench_sim_scale",
            "The simulator's cost per message against the size of the world",
            command,
            figures,
            rounds=args.rounds,
            extra={"sim_scale": runs},
            machine_info=machine,
        )
        _results.write(args.json, doc)
        print(f"  written: {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile one run (trace off)")
    parser.add_argument(
        "--network",
        default=None,
        help="also run (trace off) with this NetworkModel file, e.g. the one bench_calibration.py fits",
    )
    parser.add_argument(
        "--against", type=int, default=0, help="compare with this many workers (0: no comparison)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --against: alternating rounds")
    parser.add_argument(
        "--memory", type=int, default=0, help="with --against: also the peak RSS of this many workers"
    )
    parser.add_argument("--json", default=None, help="with --against: write the figures here")
    parser.add_argument(
        "--one",
        action="store_true",
        help="run once (--trace or --no-trace) and print its figures as JSON (what --against runs)",
    )
    parser.add_argument(
        "--trace", action=argparse.BooleanOptionalAction, default=True, help="with --one: the trace on"
    )
    args = parser.parse_args(argv)
    if args.one:
        r = run_job(args.workers, args.servers, args.steps, seed=args.seed, trace=args.trace)
        figures = {
            "messages": r.messages,
            "events": r.events,
            "wall": r.wall,
            "cpu": r.cpu,
            "rss_mb": peak_rss_mb(),
            "exact": exact(r, args.workers, args.servers, args.steps),
        }
        print(json.dumps(figures))
        return 0
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        run_job(args.workers, args.servers, args.steps, seed=args.seed, trace=False)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return 0
    trainers = args.workers - args.servers
    print(
        f"simulator at scale: {args.workers} workers ({args.servers} parameter servers + {trainers} "
        f"trainers, {args.steps} steps each: rpc_sync forward per server, distributed backward, "
        "DistributedOptimizer step)"
    )
    if args.against:
        return compare(args)
    on = run_job(args.workers, args.servers, args.steps, seed=args.seed, trace=True)
    off = run_job(args.workers, args.servers, args.steps, seed=args.seed, trace=False)
    runs = [("trace on ", on), ("trace off", off)]
    if args.network is not None:
        model = NetworkModel.load(args.network)
        runs.append(
            (
                f"trace off, network of {args.network} (message_cost {model.message_cost * 1e6:.1f} us)",
                run_job(args.workers, args.servers, args.steps, seed=args.seed, trace=False, network=model),
            )
        )
    for label, r in runs:
        ok = exact(r, args.workers, args.servers, args.steps)
        print(
            f"  {label}: {on.messages:,} messages, {r.events:,} events "
            f"({r.events / on.messages:.3f} per message) in {r.wall:.2f} s wall; "
            f"{on.messages / r.wall:,.0f} messages/s; virtual time {r.virtual * 1e3:.2f} ms; "
            f"virtual/wall = {r.virtual / r.wall:.4f}; parameters and gradients "
            f"{'exact' if ok else 'WRONG'}"
        )
    print(f"  peak RSS of this process: {peak_rss_mb():,.0f} MB")
    print(
        "  virtual/wall < 1: simulating takes longer than the simulated time (every worker's Python runs "
        "in this one process, and with the default model handling and computing are free, so virtual "
        "time is network latency only); with a calibrated message_cost the servers' queues show in "
        "virtual time"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
