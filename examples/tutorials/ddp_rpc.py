"""PyTorch's RPC example "DistributedDataParallel with the distributed RPC framework", as written for PyTorch.

Two trainers each hold a replica of a dense ``nn.Linear`` inside ``DistributedDataParallel`` (their own
gloo process group); the sparse part, an ``nn.EmbeddingBag``, lives on a parameter server as a
``RemoteModule``. The master creates the ``RemoteModule`` and sends it to both trainers over RPC; each
trainer's forward pass looks embeddings up remotely, and a ``DistributedOptimizer`` steps the remote
embedding and the local replica from one distributed autograd context. Processes start with
``torch.multiprocessing.spawn``.

Run it on PyTorch: ``python examples/tutorials/ddp_rpc.py``; unchanged under twinrpc's simulator:
``python -m twinrpc.simulator run --nproc-per-node 1 examples/tutorials/ddp_rpc.py``.

What differs from the example: the CPU instead of CUDA (its GPU check is gone; the process group is
gloo), fewer epochs and batches, batches drawn from generators of their own, seeded weights,
``MASTER_PORT`` (and the port after it) from the environment when set, and each trainer prints the
sum of its dense layer's weights after training. DDP keeps the two replicas equal, so both trainers
print the same sum, in every world.
"""

import os
import random

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
EPOCHS = 2


class HybridModel(torch.nn.Module):
    """A remote sparse part (an EmbeddingBag on the server) and a replicated dense part (DDP)."""

    def __init__(self, remote_emb_module, rank):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        torch.manual_seed(0)
        self.fc = DDP(torch.nn.Linear(16, 8))
        self.rank = rank

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


def _run_trainer(remote_emb_module, rank):
    model = HybridModel(remote_emb_module, rank)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch(rank, epoch):
        rng = random.Random(rank * 100 + epoch)
        generator = torch.Generator().manual_seed(rank * 100 + epoch)
        for _ in range(4):
            num_indices = rng.randint(20, 50)
            indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,), generator=generator)
            offsets = []
            start = 0
            batch_size = 0
            while start < num_indices:
                offsets.append(start)
                start += rng.randint(1, 10)
                batch_size += 1
            offsets_tensor = torch.LongTensor(offsets)
            target = torch.randint(0, 8, (batch_size,), generator=generator)
            yield indices, offsets_tensor, target

    for epoch in range(EPOCHS):
        for indices, offsets, target in get_next_batch(rank, epoch):
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
        print(f"Training done for epoch {epoch}")
    return sum(p.detach().double().sum().item() for p in model.fc.parameters())


def run_worker(rank, world_size):
    port = int(os.environ.get("EXAMPLE_PORT", "29500"))
    rpc_backend_options = TensorPipeRpcBackendOptions()
    rpc_backend_options.init_method = f"tcp://localhost:{port + 1}"
    # Rank 2 is the master, 3 the parameter server, 0 and 1 the trainers.
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)
        remote_emb_module = RemoteModule(
            "ps", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"}
        )
        futs = [
            rpc.rpc_async(f"trainer{trainer_rank}", _run_trainer, args=(remote_emb_module, trainer_rank))
            for trainer_rank in [0, 1]
        ]
        sums = [fut.wait() for fut in futs]
        print(f"dense weights' sums: {sums[0]:.6f} {sums[1]:.6f}")
    elif rank <= 1:
        dist.init_process_group(
            backend="gloo", rank=rank, world_size=2, init_method=f"tcp://localhost:{port}"
        )
        rpc.init_rpc(
            f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options
        )
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)
    rpc.shutdown()
    if rank <= 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 4
    mp.spawn(run_worker, args=(world_size,), nprocs=world_size, join=True)
