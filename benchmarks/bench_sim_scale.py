"""Simulator scale: a parameter-server job with hundreds of simulated workers in one process.

``servers`` parameter servers each own one parameter vector; every other worker is a trainer that, for
``steps`` steps, forwards through every server (``rpc_sync``), runs a distributed backward in a
distributed autograd context and steps all servers with one ``DistributedOptimizer`` (plain SGD).
The loss is linear in the parameters, so each gradient is known in advance and the servers' final
parameters are exact whatever order the steps landed in: ``P0 - LR * sum of every trainer's inputs``.

Prints, for the trace on and off (and with ``--network FILE``, a fitted model, e.g. the one
benchmarks/bench_calibration.py writes): messages and scheduler events, wall time, virtual time,
messages per wall-clock second and the virtual/wall ratio.

Run: ``nox -s bench`` or ``python benchmarks/bench_sim_scale.py [--workers 256] [--servers 4]
[--steps 3] [--network FILE] [--profile]``. tests/sim/test_sim_scale.py runs :func:`run_job` as a correctness test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import _cli  # benchmarks/_cli.py (the script's directory is on sys.path)
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
    t0 = time.perf_counter()
    result = sim.run(worker, world_size, servers, steps)
    wall = time.perf_counter() - t0
    messages = result.trace.count("send") if trace else -1
    return JobResult(
        result.outcomes,
        wall,
        result.virtual_time,
        messages,
        sim.sched.events_scheduled,
        result.digest if trace else "",
    )


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
    args = parser.parse_args(argv)
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
    expected = expected_parameter(args.workers, args.servers, args.steps)
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
        ok = (
            all(o.error is None and not o.crashed for o in r.outcomes)
            and all(torch.equal(v, expected) for v in r.values[: args.servers])
            and all(v is True for v in r.values[args.servers :])
        )
        print(
            f"  {label}: {on.messages:,} messages, {r.events:,} events in {r.wall:.2f} s wall; "
            f"{on.messages / r.wall:,.0f} messages/s; virtual time {r.virtual * 1e3:.2f} ms; "
            f"virtual/wall = {r.virtual / r.wall:.4f}; parameters and gradients "
            f"{'exact' if ok else 'WRONG'}"
        )
    print(
        "  virtual/wall < 1: simulating takes longer than the simulated time (every worker's Python runs "
        "in this one process, and with the default model handling and computing are free, so virtual "
        "time is network latency only); with a calibrated message_cost the servers' queues show in "
        "virtual time"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
