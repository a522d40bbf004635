"""PyTorch's parameter-server tutorial (rpc_param_server_tutorial), on twinrpc, unchanged between worlds.

One parameter server owns the model (a ``ParameterServer`` module behind an RRef); every trainer runs a
``TrainerNet`` whose forward pass runs on the server, computes its loss locally, runs a distributed
backward in a distributed autograd context, and steps the server's parameters with a
``DistributedOptimizer``. Trainers run concurrently against the one server.

    python examples/parameter_server.py                      # simulator: 1 server + 2 trainers
    python examples/parameter_server.py --world gloo         # real processes on this machine
    torchrun --nproc-per-node 3 examples/parameter_server.py --world gloo   # one process per rank
    python examples/parameter_server.py --data-dir ~/mnist   # MNIST IDX files instead of the digits

Data: scikit-learn's bundled 8x8 digits by default (no download); ``--data-dir`` reads MNIST IDX files
(``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, optionally ``.gz``). Prints the test accuracy and writes a loss curve PNG.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn, optim

import twinrpc.autograd as dist_autograd
import twinrpc.rpc as rpc
from twinrpc.optim import DistributedOptimizer

SERVER = "parameter_server"


# --------- data --------------------------------------------------------------------------------
def _read_idx(path: Path) -> np.ndarray:
    """One IDX file (the MNIST format): magic, dims, then big-endian data."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (magic {data[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(data_dir: Path, stem: str) -> Path:
    for name in (stem, stem.replace("-idx", ".idx"), stem + ".gz", stem.replace("-idx", ".idx") + ".gz"):
        if (data_dir / name).exists():
            return data_dir / name
    raise FileNotFoundError(f"no {stem}[.gz] in {data_dir}")


def load_data(data_dir: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images N x 1 x H x W in [0, 1], train labels, test images, test labels)."""
    if data_dir is None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(digits.target, dtype=torch.int64)
        idx_train, idx_test = train_test_split(
            np.arange(len(y)), test_size=0.2, random_state=0, stratify=digits.target
        )
        return x[idx_train], y[idx_train], x[idx_test], y[idx_test]
    d = Path(data_dir).expanduser()
    parts = []
    for split in ("train", "t10k"):
        images = _read_idx(_find(d, f"{split}-images-idx3-ubyte"))
        labels = _read_idx(_find(d, f"{split}-labels-idx1-ubyte"))
        parts.append(torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 255.0)
        parts.append(torch.tensor(labels, dtype=torch.int64))
    return parts[0], parts[1], parts[2], parts[3]


# --------- the model (a small ConvNet, as the tutorial's, sized for the input) ---------------------
class Net(nn.Module):
    def __init__(self, side: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1, padding=1)
        self.pool = 2 if side >= 16 else 1
        flat = 32 * (side // (2 * self.pool)) ** 2
        self.fc1 = nn.Linear(flat, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The network on ``params`` (default: its own parameters), written with functional ops so
        concurrent callers can each pass their own tensors."""
        p = dict(self.named_parameters()) if params is None else params
        if self.pool > 1:
            x = F.max_pool2d(x, self.pool)
        x = F.relu(F.conv2d(x, p["conv1.weight"], p["conv1.bias"], padding=1))
        x = F.relu(F.conv2d(x, p["conv2.weight"], p["conv2.bias"], padding=1))
        x = F.dropout(torch.flatten(F.max_pool2d(x, 2), 1), 0.25, self.training)
        x = F.relu(F.linear(x, p["fc1.weight"], p["fc1.bias"]))
        return F.log_softmax(F.linear(x, p["fc2.weight"], p["fc2.bias"]), dim=1)


# --------- helpers: call a method on the object an RRef holds, on its owner ------------------------
def call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return rpc.rpc_sync(rref.owner(), call_method, args=(method, rref, *args), kwargs=kwargs)


# --------- the parameter server ----------------------------------------------------------------------
class ParameterServer(nn.Module):
    def __init__(self, side: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net(side)
        self.losses: dict[int, list[float]] = {}

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        # Trainers step these parameters in place while another trainer's backward pass still needs
        # the values its forward pass saw (autograd would fail with "modified by an inplace
        # operation", a race the simulator finds in the tutorial's code). Run on a snapshot: the
        # clones are what autograd saves, and gradients still flow to the parameters through them.
        snapshot = {name: p.clone() for name, p in self.model.named_parameters()}
        return self.model(inp, snapshot)  # type: ignore[no-any-return]

    def get_dist_gradients(self, cid: int) -> dict[torch.Tensor, torch.Tensor]:
        grads = dist_autograd.get_gradients(cid)
        return {k: v.clone() for k, v in grads.items()}

    def get_param_rrefs(self) -> list[Any]:
        return [rpc.RRef(param) for param in self.model.parameters()]

    def report(self, trainer: int, losses: list[float]) -> None:
        self.losses[trainer] = losses


# One server per worker process; the simulator runs all workers in one process, so keep one per
# (simulated) worker, keyed by the worker's name.
_servers: dict[str, ParameterServer] = {}
_server_lock = threading.Lock()


def get_parameter_server(side: int) -> ParameterServer:
    with _server_lock:
        me = rpc.get_worker_info().name
        if me not in _servers:
            _servers[me] = ParameterServer(side)
        return _servers[me]


# --------- the trainer ---------------------------------------------------------------------------------
class TrainerNet(nn.Module):
    def __init__(self, side: int) -> None:
        super().__init__()
        self.param_server_rref = rpc.remote(SERVER, get_parameter_server, args=(side,))

    def get_global_param_rrefs(self) -> list[Any]:
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remote_method(ParameterServer.forward, self.param_server_rref, x)  # type: ignore[no-any-return]


def run_training_loop(rank: int, args: argparse.Namespace, progress: Any) -> None:
    x_train, y_train, _, _ = load_data(args.data_dir)
    n_trainers = args.world_size - 1
    mine = torch.arange(rank - 1, len(y_train), n_trainers)  # trainer k takes every n-th sample
    x_train, y_train = x_train[mine], y_train[mine]
    net = TrainerNet(x_train.shape[-1])
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    losses: list[float] = []
    batches = (len(y_train) + args.batch_size - 1) // args.batch_size
    if args.max_batches is not None:  # a short run (benchmarks/bench_calibration.py)
        batches = min(batches, args.max_batches)
    # bars on a terminal only: in a log file they are lines of escape codes
    bar = progress(
        total=args.epochs * batches,
        desc=f"trainer {rank}",
        position=rank - 1,
        leave=True,
        disable=not sys.stderr.isatty(),
    )
    for _ in range(args.epochs):
        order = torch.randperm(len(y_train), generator=gen)
        for b in range(batches):
            idx = order[b * args.batch_size : (b + 1) * args.batch_size]
            data, target = x_train[idx], y_train[idx]
            with dist_autograd.context() as cid:
                model_output = net(data)
                loss = F.nll_loss(model_output, target)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            bar.update(1)
    bar.close()
    remote_method(ParameterServer.report, net.param_server_rref, rank, losses)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(dim=1)
    return float((pred == y).float().mean())


def run_tag(args: argparse.Namespace) -> str:
    """What a run's files are named after: its world, and the seed on the simulator."""
    return f"{args.world}-seed{args.seed}" if args.world == "sim" else args.world


def save_curve(losses: dict[int, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for trainer, values in sorted(losses.items()):
        ax.plot(values, label=f"trainer {trainer}", linewidth=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (NLL)")
    ax.set_title(title)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# --------- one worker --------------------------------------------------------------------------------
def run_worker(rank: int, args: argparse.Namespace, options: Any = None) -> dict[str, Any] | None:
    from tqdm import tqdm

    name = SERVER if rank == 0 else f"trainer_{rank}"
    rpc.init_rpc(name, rank=rank, world_size=args.world_size, rpc_backend_options=options)
    if rank != 0:
        run_training_loop(rank, args, tqdm)
    rpc.shutdown()  # a barrier: the server leaves once every trainer has finished
    if rank != 0:
        return None
    server = _servers.pop(SERVER)
    _, _, x_test, y_test = load_data(args.data_dir)
    acc = accuracy(server.model, x_test, y_test)
    out = Path(args.out_dir)
    tag = run_tag(args)
    world = f"simulator, seed {args.seed}" if args.world == "sim" else "gloo world"
    png = out / f"loss-{tag}.png"
    save_curve(server.losses, png, f"parameter server on twinrpc ({world}): test accuracy {acc:.1%}")
    result = {
        "test_accuracy": acc,
        "final_loss": {k: sum(v[-10:]) / len(v[-10:]) for k, v in server.losses.items()},
        "world": args.world,
        "seed": args.seed if args.world == "sim" else None,
        "loss_png": str(png),
    }
    (out / f"result-{tag}.json").write_text(json.dumps(result, indent=2))
    print(f"\ntest accuracy: {acc:.2%} on {len(y_test)} test images ({args.world})")
    print(f"loss curve: {png}")
    return result


def _gloo_child(rank: int, args: argparse.Namespace, init_method: str) -> None:
    options = rpc.RpcBackendOptions(init_method=init_method, rpc_timeout=120)
    run_worker(rank, args, options)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", choices=["sim", "gloo"], default="sim", help="simulator or real processes")
    parser.add_argument("--world-size", type=int, default=3, help="1 server + (world size - 1) trainers")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--max-batches", type=int, default=None, help="per trainer and epoch (a short run)")
    parser.add_argument("--data-dir", default=None, help="MNIST IDX files (default: scikit-learn digits)")
    parser.add_argument("--out-dir", default="build/train")
    parser.add_argument("--seed", type=int, default=0, help="the simulation's seed")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2 (one server and one trainer)")
    torch.set_num_threads(1)
    if args.world == "sim":
        from twinrpc.simulator import Simulation

        print(f"simulator: 1 parameter server + {args.world_size - 1} trainers (seed {args.seed})")
        result = Simulation(args.world_size, seed=args.seed).run(lambda r: run_worker(r, args))
        return result.values()[0]  # type: ignore[no-any-return]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun: one rank here
        args.world_size = int(os.environ["WORLD_SIZE"])
        return run_worker(int(os.environ["RANK"]), args, rpc.RpcBackendOptions(init_method="env://"))
    import tempfile

    import torch.multiprocessing as mp

    print(f"gloo: 1 parameter server + {args.world_size - 1} trainers, one process each")
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/rendezvous"
        mp.spawn(_gloo_child, args=(args, init_method), nprocs=args.world_size, join=True)
    return json.loads((Path(args.out_dir) / f"result-{run_tag(args)}.json").read_text())  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
