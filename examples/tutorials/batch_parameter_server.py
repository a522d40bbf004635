"""PyTorch's RPC example "batch-updating parameter server" (``@rpc.functions.async_execution``), as written for PyTorch.

Each trainer sends its gradients to the server and waits for the updated model. The server's
``update_and_fetch_model`` is an ``async_execution`` static method: it adds the gradients, and returns
the future of the next model, which completes once ``batch_update_size`` trainers have reported and the
optimizer has stepped. The processes start with ``torch.multiprocessing.spawn``, after a gloo process
group of their own (``dist.init_process_group``), as in the example.

Run it on PyTorch: ``python examples/tutorials/batch_parameter_server.py``; unchanged under twinrpc's
simulator: ``python -m twinrpc.simulator run --nproc-per-node 1 examples/tutorials/batch_parameter_server.py``.

What differs from the example: a small convolutional network on 16x16 images instead of torchvision's
ResNet-50 on 64x64 (torchvision is not a dependency), the CPU instead of CUDA, two trainers and three
batches, ``MASTER_PORT`` from the environment when set, and one line printed at the end: a checksum
of the server's final parameters. The server averages each round's gradients, so the order in which
trainers report does not matter and every world prints the same checksum.
"""

import os
import threading

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch import optim

batch_size = 8
image_w = 16
image_h = 16
num_classes = 5
batch_update_size = 2
num_batches = 3


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d((4, 4)),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, num_classes),
    )


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size=batch_update_size):
        self.model = make_model()
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.001, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        for p, g in zip(self.model.parameters(), grads, strict=True):
            p.grad += g
        with self.lock:
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


class Trainer:
    def __init__(self, ps_rref):
        self.ps_rref = ps_rref
        self.loss_fn = nn.MSELoss()
        self.rank = rpc.get_worker_info().id
        generator = torch.Generator().manual_seed(self.rank)
        self.one_hot_indices = torch.randint(0, num_classes, (batch_size, 1), generator=generator)
        self.generator = generator

    def get_next_batch(self):
        for _ in range(num_batches):
            inputs = torch.randn(batch_size, 3, image_w, image_h, generator=self.generator)
            labels = torch.zeros(batch_size, num_classes).scatter_(1, self.one_hot_indices, 1)
            yield inputs, labels

    def train(self):
        m = self.ps_rref.rpc_sync().get_model()
        for inputs, labels in self.get_next_batch():
            self.loss_fn(m(inputs), labels).backward()
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.parameters()]),
            )


def run_trainer(ps_rref):
    Trainer(ps_rref).train()


def run_ps(trainers):
    ps = BatchUpdateParameterServer()
    ps_rref = rpc.RRef(ps)
    futs = [rpc.rpc_async(trainer, run_trainer, args=(ps_rref,)) for trainer in trainers]
    torch.futures.wait_all(futs)
    checksum = sum(p.detach().double().sum().item() for p in ps.model.parameters())
    print(f"Finish training: parameter checksum {checksum:.6f}")


def run(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = os.environ.get("EXAMPLE_PORT", "29500")
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    if rank != 0:
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        run_ps([f"trainer{r}" for r in range(1, world_size)])
    rpc.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = batch_update_size + 1
    mp.spawn(run, args=(world_size,), nprocs=world_size, join=True)
