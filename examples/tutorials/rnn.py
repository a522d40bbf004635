"""PyTorch's RPC example "distributed RNN with remote embeddings", as a PyTorch user writes it.

A trainer builds an :class:`rnn_model.RNNModel` whose embedding table and decoder live on a parameter
server (``rpc.remote``), trains it with distributed autograd and a ``DistributedOptimizer``, and prints
the loss of each epoch. The processes are started the way the example starts them, with
``torch.multiprocessing.spawn``.

Run it on PyTorch: ``python examples/tutorials/rnn.py``. Unchanged under twinrpc's simulator:
``python -m twinrpc.simulator run --nproc-per-node 1 examples/tutorials/rnn.py``. On twinrpc's gloo
world: the same file with its imports ported (``examples/port_imports.py``).

What differs from the example: the sizes (fewer epochs), seeded random data and initial weights so
that every world prints the same numbers, the trainer waiting for the embedding table to exist before
it asks for the decoder (both draw from the parameter server's random generator; see
``rnn_model.RNNModel``), and ``MASTER_PORT`` taken from the environment when set.
"""

import os

import rnn_model
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

EPOCHS = 3
BATCHES = 4


def _run_trainer():
    batch, ntoken, ninp, nhid, nindices, nlayers = 5, 7, 2, 3, 6, 4
    hidden = (torch.randn(nlayers, nindices, nhid), torch.randn(nlayers, nindices, nhid))
    model = rnn_model.RNNModel("ps", ntoken, ninp, nhid, nlayers)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():
        for _ in range(BATCHES):
            data = torch.randint(0, ntoken, (batch, nindices))
            target = torch.randint(0, nindices, (batch, ntoken))
            yield data, target

    for epoch in range(EPOCHS):
        total = 0.0
        for data, target in get_next_batch():
            with dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
                total += loss.item()
        print(f"Training epoch {epoch} loss {total / BATCHES:.4f}")


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = os.environ.get("EXAMPLE_PORT", "29500")
    torch.manual_seed(rank)
    if rank == 1:
        rpc.init_rpc("trainer", rank=rank, world_size=world_size)
        _run_trainer()
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(2,), nprocs=2, join=True)
