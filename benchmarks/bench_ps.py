"""Parameter-server training samples per second, twinrpc (gloo world) vs PyTorch (TensorPipe).

The job of ``examples/parameter_server.py`` (its model, data and batch size): one parameter server
process owns the ``Net`` and two trainer processes each run forward (on the server, through an RPC),
loss, distributed backward and a ``DistributedOptimizer`` step (SGD, momentum 0.9), concurrently.
After ``--warmup`` batches per trainer and a barrier, each trainer runs ``--batches`` batches; the
rate is both trainers' samples over the time from the barrier to the last trainer's end. Runs
alternate between the systems (``--repeat`` rounds) and the medians are compared.

    python benchmarks/bench_ps.py [--batches 150] [--warmup 20] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import _cli  # benchmarks/_cli.py (the script's directory is on sys.path)
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn, optim

SYSTEMS = {
    "twinrpc": ("twinrpc.rpc", "twinrpc.autograd", "twinrpc.optim", "twinrpc.futures"),
    "torch": (
        "torch.distributed.rpc",
        "torch.distributed.autograd",
        "torch.distributed.optim",
        "torch.futures",
    ),
}
SERVER = "parameter_server"
TRAINERS = 2
_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "parameter_server.py"


def _example() -> Any:
    """examples/parameter_server.py as a module (its Net and load_data)."""
    mod = sys.modules.get("_ps_example")
    if mod is None:
        spec = importlib.util.spec_from_file_location("_ps_example", _EXAMPLE)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_ps_example"] = mod
        spec.loader.exec_module(mod)
    return mod


def _modules(system: str) -> list[Any]:
    return [importlib.import_module(m) for m in SYSTEMS[system]]


# -- the server side (as the example's ParameterServer, for either system) ----------------------------
class Server(nn.Module):
    def __init__(self, side: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _example().Net(side)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        snapshot = {name: p.clone() for name, p in self.model.named_parameters()}
        return self.model(inp, snapshot)  # type: ignore[no-any-return]


_STATE: dict[str, Any] = {"lock": threading.Lock()}


def _get_server(side: int) -> Server:
    with _STATE["lock"]:
        if "server" not in _STATE:
            _STATE["server"] = Server(side)
        return _STATE["server"]  # type: ignore[no-any-return]


def _param_rrefs(system: str, rref: Any) -> list[Any]:
    rpc = _modules(system)[0]
    return [rpc.RRef(p) for p in rref.local_value().model.parameters()]


def _forward(rref: Any, x: torch.Tensor) -> torch.Tensor:
    return rref.local_value()(x)  # type: ignore[no-any-return]


def _barrier(system: str, n: int) -> Any:
    """A Future completed when ``n`` trainers arrived (one barrier per run: each run is fresh processes)."""
    futures = _modules(system)[3]
    with _STATE["lock"]:
        fut = _STATE.setdefault("barrier", futures.Future())
        _STATE["arrived"] = _STATE.get("arrived", 0) + 1
        if _STATE["arrived"] == n:
            fut.set_result(time.perf_counter())
    return fut


for _suffix, _name in (("torch", "torch.distributed.rpc"), ("twinrpc", "twinrpc.rpc")):
    _wrapped = importlib.import_module(_name).functions.async_execution(_barrier)
    _wrapped.__name__ = _wrapped.__qualname__ = f"_barrier_{_suffix}"
    globals()[_wrapped.__name__] = _wrapped


# -- one process --------------------------------------------------------------------------------------
def _worker(rank: int, system: str, init: str, warmup: int, batches: int, batch_size: int, out: Any) -> None:
    # torch's DistributedOptimizer warns that TorchScript functional optimizers are deprecated
    warnings.simplefilter("ignore", DeprecationWarning)
    torch.set_num_threads(1)
    rpc, dist_autograd, dist_optim, _ = _modules(system)
    world = TRAINERS + 1
    if system == "torch":
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, num_worker_threads=16, rpc_timeout=120)
    else:
        opts = rpc.RpcBackendOptions(init_method=init, rpc_timeout=120)
    name = SERVER if rank == 0 else f"trainer_{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    if rank != 0:
        x_train, y_train, _, _ = _example().load_data(None)
        mine = torch.arange(rank - 1, len(y_train), TRAINERS)
        x_train, y_train = x_train[mine], y_train[mine]
        server = rpc.remote(SERVER, _get_server, args=(x_train.shape[-1],))
        params = rpc.rpc_sync(SERVER, _param_rrefs, args=(system, server))
        opt = dist_optim.DistributedOptimizer(optim.SGD, params, lr=0.03, momentum=0.9)
        gen = torch.Generator().manual_seed(rank)
        order = torch.randperm(len(y_train), generator=gen)
        per_epoch = len(y_train) // batch_size

        def step(b: int) -> None:
            k = b % per_epoch
            idx = order[k * batch_size : (k + 1) * batch_size]
            with dist_autograd.context() as cid:
                out_ = rpc.rpc_sync(SERVER, _forward, args=(server, x_train[idx]))
                loss = F.nll_loss(out_, y_train[idx])
                dist_autograd.backward(cid, [loss])
                opt.step(cid)

        for b in range(warmup):
            step(b)
        start = rpc.rpc_sync(SERVER, globals()[f"_barrier_{system}"], args=(system, TRAINERS))
        for b in range(warmup, warmup + batches):
            step(b)
        out.put((rank, start, time.perf_counter(), batches * batch_size))
        del server, params, opt
    rpc.shutdown()


def _run_once(system: str, args: argparse.Namespace) -> float:
    q = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _worker,
            args=(system, f"file://{d}/rdv", args.warmup, args.batches, args.batch_size, q),
            nprocs=TRAINERS + 1,
            start_method="spawn",
        )
    results = [q.get() for _ in range(TRAINERS)]
    start = min(r[1] for r in results)
    end = max(r[2] for r in results)
    return sum(r[3] for r in results) / (end - start)


def main() -> None:
    parser = _cli.parser(__doc__)
    parser.add_argument("--batches", type=int, default=150, help="measured batches per trainer")
    parser.add_argument("--warmup", type=int, default=20, help="batches per trainer before the barrier")
    parser.add_argument("--batch-size", type=int, default=32, help="as examples/parameter_server.py")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each runs both systems once")
    parser.add_argument("--only", choices=list(SYSTEMS), help="run one system (e.g. under a profiler)")
    args = parser.parse_args()
    systems = [args.only] if args.only else list(SYSTEMS)
    rates: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(args.repeat):
        for system in systems if r % 2 == 0 else reversed(systems):
            rates[system].append(_run_once(system, args))
    print(
        f"parameter-server training, 1 server + {TRAINERS} trainers, batch {args.batch_size}, "
        f"{args.batches} batches per trainer after {args.warmup} warm-up (samples/s)"
    )
    for name, values in rates.items():
        print(
            f"  {name:<8} median {statistics.median(values):8.1f}  "
            f"(min {min(values):.1f}, max {max(values):.1f})"
        )
    if args.only:
        return
    ratio = statistics.median(rates["twinrpc"]) / statistics.median(rates["torch"])
    print(f"  twinrpc / torch: {ratio:.2f}x (target >= 0.8x)")


if __name__ == "__main__":
    main()
