"""The parameter server of PyTorch's RPC tutorial, small, with its race (the race tutorial's program).

Written for ``torch.distributed.rpc`` and launched the ``torchrun`` way (rank and world size from the
environment): 1 parameter server (rank 0) and 2 trainers::

    python -m twinrpc.simulator run --nproc-per-node 3 docs/examples/ps_race.py   # the simulator
    torchrun --nproc-per-node 3 docs/examples/ps_race.py                         # upstream PyTorch

It is the seeds' program (examples/torch_parameter_server.py, PyTorch's rpc_param_server_tutorial)
with its ``ParameterServer``, ``get_parameter_server`` singleton, ``remote_method`` helper,
``TrainerNet`` and training loop kept, and three changes so that a run takes milliseconds: a
two-layer MLP (written with functional ops, so that the fix can pass it other tensors) instead of the
ConvNet, five batches of random data per trainer instead of MNIST, and the rank from ``torchrun``'s
environment instead of an argument and ``mp.Process``.

Kept as written: the race. A trainer's ``opt.step`` updates the server's parameters in place; when it
lands between the other trainer's forward pass and its backward pass, that backward pass fails with
"one of the variables needed for gradient computation has been modified by an inplace operation".
``--fixed`` turns the fix on (``ParameterServer.forward``), so that the docs can run both versions.
"""

import argparse
import os
from threading import Lock

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn, optim
from torch.distributed.optim import DistributedOptimizer

BATCHES = 5
FIXED = False  # --fixed: ParameterServer.forward runs on a snapshot of the parameters


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x, params=None):
        p = dict(self.named_parameters()) if params is None else params
        x = F.relu(F.linear(x, p["fc1.weight"], p["fc1.bias"]))
        return F.log_softmax(F.linear(x, p["fc2.weight"], p["fc2.bias"]), dim=1)


# The tutorial's helpers: call a method on the value an RRef holds, on the RRef's owner.
def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), call_method, args=[method, rref, *args], kwargs=kwargs)


class ParameterServer(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Net()

    def forward(self, inp):
        if not FIXED:
            # As written: autograd saves the live parameters, which a step may change before backward.
            return self.model(inp)
        # The fix: run on a snapshot. Autograd saves the clones, which no step touches, and the
        # gradients still reach the parameters through them.
        snapshot = {name: p.clone() for name, p in self.model.named_parameters()}
        return self.model(inp, snapshot)

    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]


# The global parameter server instance, and a lock to ensure there is only one.
param_server = None
global_lock = Lock()


def get_parameter_server():
    global param_server
    with global_lock:
        if not param_server:
            param_server = ParameterServer()
        return param_server


class TrainerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server)

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


def run_training_loop(rank):
    net = TrainerNet()
    opt = DistributedOptimizer(optim.SGD, net.get_global_param_rrefs(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(BATCHES):
        data = torch.randn(8, 16, generator=gen)
        target = torch.randint(0, 4, (8,), generator=gen)
        with dist_autograd.context() as cid:
            model_output = net(data)
            loss = F.nll_loss(model_output, target)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
    print(f"Trainer {rank}: {BATCHES} batches, last loss {loss.item():.4f}")


def run_worker(rank, world_size):
    if rank == 0:
        rpc.init_rpc("parameter_server", rank=rank, world_size=world_size)
    else:
        rpc.init_rpc(f"trainer_{rank}", rank=rank, world_size=world_size)
        run_training_loop(rank)
    rpc.shutdown()  # waits for every worker: the server leaves once both trainers are done


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The race tutorial's parameter server")
    parser.add_argument("--fixed", action="store_true", help="run the forward pass on a snapshot")
    FIXED = parser.parse_args().fixed
    run_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
