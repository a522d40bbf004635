"""PyTorch's RPC example "distributed pipeline parallelism", as written for PyTorch.

A model is split into two shards held by two workers (``rpc.remote``). The master splits every batch
into micro-batches; each micro-batch goes to shard 1 as an RRef (``p1_rref.remote().forward(x_rref)``)
and its output, still an RRef, to shard 2 (``p2_rref.rpc_async().forward(y_rref)``), so the shards
work on different micro-batches at once. ``torch.futures.wait_all`` gathers the outputs, and
distributed autograd with a ``DistributedOptimizer`` trains both shards. The processes start with
``torch.multiprocessing.spawn``, once per number of micro-batches.

Run it on PyTorch: ``python examples/tutorials/pipeline.py``; unchanged under twinrpc's simulator:
``python -m twinrpc.simulator run --nproc-per-node 1 examples/tutorials/pipeline.py``.

What differs from the example: two small convolutional shards on 16x16 images instead of ResNet-50's
(torchvision's ``Bottleneck`` is not a dependency), the CPU instead of CUDA, smaller batches, seeded
weights and data, ``MASTER_PORT`` from the environment when set, and the loss printed per batch.
"""

import os
import threading

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

num_classes = 10
num_batches = 2
batch_size = 12
image_w = 16
image_h = 16


class ShardBase(nn.Module):
    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


class Shard1(ShardBase):
    """The first part of the model."""

    def __init__(self, device):
        super().__init__()
        torch.manual_seed(1)
        self.device = device
        self.seq = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        ).to(self.device)

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.seq(x)
        return out.cpu()


class Shard2(ShardBase):
    """The second part of the model."""

    def __init__(self, device):
        super().__init__()
        torch.manual_seed(2)
        self.device = device
        self.seq = nn.Sequential(
            nn.Conv2d(8, 16, kernel_size=3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1))
        ).to(self.device)
        self.fc = nn.Linear(16, num_classes).to(self.device)

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.fc(torch.flatten(self.seq(x), 1))
        return out.cpu()


class DistNet(nn.Module):
    """Two shards on two workers, with the pipelining loop."""

    def __init__(self, split_size, workers):
        super().__init__()
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], Shard1, args=("cpu",))
        self.p2_rref = rpc.remote(workers[1], Shard2, args=("cpu",))

    def forward(self, xs):
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params


def run_master(split_size):
    model = DistNet(split_size, ["worker1", "worker2"])
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
    generator = torch.Generator().manual_seed(0)
    one_hot_indices = torch.randint(0, num_classes, (batch_size, 1), generator=generator)
    for i in range(num_batches):
        inputs = torch.randn(batch_size, 3, image_w, image_h, generator=generator)
        labels = torch.zeros(batch_size, num_classes).scatter_(1, one_hot_indices, 1)
        with dist_autograd.context() as context_id:
            loss = loss_fn(model(inputs), labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        print(f"splits of {split_size}: batch {i} loss {loss.item():.5f}")


def run_worker(rank, world_size, split_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = os.environ.get("EXAMPLE_PORT", "29500")
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=256, rpc_timeout=300)
    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)
        run_master(split_size)
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    rpc.shutdown()


if __name__ == "__main__":
    world_size = 3
    for split_size in [12, 4]:
        mp.spawn(run_worker, args=(world_size, split_size), nprocs=world_size, join=True)
