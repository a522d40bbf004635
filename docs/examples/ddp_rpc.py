"""PyTorch's "Combining Distributed DataParallel with Distributed RPC Framework" example, in both worlds.

Four workers: a master creates an ``nn.EmbeddingBag`` on a parameter server and drives the training
loops of two trainers; each trainer's ``HybridModel`` looks embeddings up on the server through an
RPC and runs its dense part, an ``nn.Linear`` replicated with ``DistributedDataParallel`` (a gloo
process group of the two trainers). Forward, distributed backward and a ``DistributedOptimizer`` step
run in one distributed autograd context per batch. As the example written for PyTorch 1.6 did, the
embedding table is an RRef made with ``rpc.remote`` (not ``RemoteModule``). It runs on the CPU with
fewer batches, seeded (random draws from generators of their own, so that both worlds print the same);
besides the imports, the one addition is a check per batch: the dense part's gradients in the context
equal what local DDP computes from the same embeddings.

Run it: ``python docs/examples/ddp_rpc.py --world sim`` or ``--world gloo``.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from _two_worlds import chosen_world, free_port, run_processes, run_simulated
from torch import optim
from torch.nn.parallel import DistributedDataParallel as DDP

# -- imports --
import twinrpc.autograd as dist_autograd  # was: import torch.distributed.autograd as dist_autograd
import twinrpc.rpc as rpc  # was: import torch.distributed.rpc as rpc
from twinrpc.optim import DistributedOptimizer  # was: from torch.distributed.optim import ...
from twinrpc.rpc import RRef  # was: from torch.distributed.rpc import RRef

# -- end imports --

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
EPOCHS = 3


# -- program --
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)  # noqa: RUF005 (as the example writes it)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class HybridModel(torch.nn.Module):
    """The sparse part, an nn.EmbeddingBag on the parameter server, is looked up through an RPC;
    the dense part, an nn.Linear, is replicated across the trainers with DistributedDataParallel."""

    def __init__(self, emb_rref):
        super().__init__()
        self.emb_rref = emb_rref
        torch.manual_seed(0)
        self.fc = DDP(torch.nn.Linear(16, 8))

    def forward(self, indices, offsets):
        emb_lookup = _remote_method(torch.nn.EmbeddingBag.forward, self.emb_rref, indices, offsets)
        return self.fc(emb_lookup), emb_lookup


def _embedding_bag(num_embeddings, embedding_dim, mode):
    torch.manual_seed(1)
    return torch.nn.EmbeddingBag(num_embeddings, embedding_dim, mode=mode)


def _retrieve_embedding_parameters(emb_rref):
    return [RRef(p) for p in emb_rref.local_value().parameters()]


def _get_next_batch(rank):
    random.seed(rank)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        num_indices = random.randint(20, 50)
        indices = torch.LongTensor(num_indices).random_(0, NUM_EMBEDDINGS, generator=gen)
        offsets = []
        start = 0
        batch_size = 0
        while start < num_indices:
            offsets.append(start)
            start += random.randint(1, 10)
            batch_size += 1
        offsets_tensor = torch.LongTensor(offsets)
        target = torch.LongTensor(batch_size).random_(8, generator=gen)
        yield indices, offsets_tensor, target


def _run_trainer(emb_rref, rank):
    """Each trainer runs forward, distributed backward and the optimizer step in a context per batch,
    and checks the DDP part's gradients in the context against local DDP on the same embeddings."""
    model = HybridModel(emb_rref)
    reference = torch.nn.Linear(16, 8)
    reference_ddp = DDP(reference)
    model_parameter_rrefs = rpc.rpc_sync("ps", _retrieve_embedding_parameters, args=(emb_rref,))
    for param in model.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    checks = []
    for _epoch in range(EPOCHS):
        for indices, offsets, target in _get_next_batch(rank):
            with dist_autograd.context() as context_id:
                output, emb_lookup = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                grads = dist_autograd.get_gradients(context_id)
                # local DDP from the same weights and embeddings, for the check
                reference.load_state_dict(model.fc.module.state_dict())
                reference_ddp.zero_grad(set_to_none=True)
                criterion(reference_ddp(emb_lookup.detach()), target).backward()
                checks.append(
                    all(
                        torch.allclose(grads[p], q.grad)
                        for p, q in zip(model.fc.parameters(), reference.parameters(), strict=True)
                    )
                )
                opt.step(context_id)
    return {"fc gradients equal local DDP": all(checks), "last loss": round(loss.item(), 4)}


def run_worker(rank, world_size, ddp_init):
    # Rank 2 is the master, 3 the parameter server, 0 and 1 the trainers.
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size)
        emb_rref = rpc.remote(
            "ps", _embedding_bag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"}
        )
        futs = [rpc.rpc_async(f"trainer{t}", _run_trainer, args=(emb_rref, t)) for t in range(2)]
        results = [fut.wait() for fut in futs]
    elif rank <= 1:
        # DDP's process group: the two trainers
        dist.init_process_group(backend="gloo", rank=rank, world_size=2, init_method=ddp_init)
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size)
        results = None
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size)
        results = None
    rpc.shutdown()
    if rank <= 1:
        dist.destroy_process_group()
    return results


# -- end program --


if __name__ == "__main__":
    if chosen_world() == "sim":
        results = run_simulated(run_worker, 4, 2, "tcp://127.0.0.1:29501")
    else:
        results = run_processes(run_worker, 4, 2, f"tcp://127.0.0.1:{free_port()}")
    for trainer, result in enumerate(results):
        print(f"trainer {trainer}: {result}")
