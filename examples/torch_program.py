"""A small torch.distributed.rpc program, written for PyTorch, that runs on twinrpc unchanged but for
its imports.

It is a parameter server in miniature: worker0 drives, worker1 owns a ``ParameterServer`` behind an
RRef. It uses ``rpc_sync`` (a builtin on tensors and a Python function), ``rpc_async`` with ``then``,
``remote`` and RRef proxies, a nested call back to the caller, a remote exception, and a graceful
``shutdown``. Only rank 0 prints, so the output is the same on every run.

Run it on PyTorch, either way::

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/torch_program.py
    python examples/torch_program.py            # torch.multiprocessing.spawn, MASTER_PORT=29500

Run it on twinrpc's gloo world: make a copy with the imports changed (``import torch.distributed.rpc
as rpc`` becomes ``import twinrpc.rpc as rpc``), by hand or with ``python examples/port_imports.py
examples/torch_program.py /tmp/twin_program.py``, and launch the copy the same way.
tests/gloo/test_gloo_launch.py does exactly this and compares the two outputs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

WORLD_SIZE = 2


class ParameterServer:
    """Holds a weight vector; workers pull it and push gradients."""

    def __init__(self, size: int) -> None:
        self.weights = torch.zeros(size)
        self.updates = 0

    def pull(self) -> torch.Tensor:
        return self.weights.clone()

    def push(self, grad: torch.Tensor, lr: float) -> int:
        self.weights -= lr * grad
        self.updates += 1
        return self.updates


def square(t: torch.Tensor) -> torch.Tensor:
    return t * t


def whoami() -> str:
    return rpc.get_worker_info().name


def ask_back(caller: str) -> str:
    """Runs on worker1 and calls back into the caller while the caller waits (a nested RPC)."""
    return f"{whoami()} asked {caller}, who says {rpc.rpc_sync(caller, whoami)}"


def fail(msg: str) -> None:
    raise ValueError(msg)


def drive() -> None:
    peer = "worker1"
    x = torch.arange(4, dtype=torch.float32)
    print("rpc_sync torch.add:", rpc.rpc_sync(peer, torch.add, args=(x, 1)).tolist())
    print("rpc_sync square:", rpc.rpc_sync(peer, square, args=(x,)).tolist())

    futs = [rpc.rpc_async(peer, torch.mul, args=(x, k)) for k in range(3)]
    print("rpc_async sums:", [f.wait().sum().item() for f in futs])
    doubled = rpc.rpc_async(peer, square, args=(x,)).then(lambda f: f.value() * 2)
    print("rpc_async then:", doubled.wait().tolist())

    ps = rpc.remote(peer, ParameterServer, args=(4,))
    print("remote owner:", ps.owner().name, "is_owner:", ps.is_owner())
    for step in range(3):
        w = ps.rpc_sync().pull()
        grad = w - torch.ones(4)
        updates = ps.rpc_sync().push(grad, 0.5)
        print(f"step {step}: updates={updates} weights={ps.rpc_sync().pull().tolist()}")
    big = rpc.remote(peer, torch.ones, args=([1000, 1000],))
    print("remote to_here sum:", big.to_here().sum().item())

    print("nested:", rpc.rpc_sync(peer, ask_back, args=(rpc.get_worker_info().name,)))

    try:
        rpc.rpc_sync(peer, fail, args=("bad input",))
    except ValueError as exc:
        print("remote error:", type(exc).__name__, "mentions the message:", "bad input" in str(exc))


def run(rank: int, world_size: int) -> None:
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        drive()
    rpc.shutdown()  # graceful: waits until every worker is done
    if rank == 0:
        print("shut down cleanly")


def main() -> None:
    if "RANK" in os.environ:  # started by torchrun: one process per worker
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        mp.spawn(run, args=(WORLD_SIZE,), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
