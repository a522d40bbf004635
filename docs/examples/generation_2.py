"""PyTorch 2.x's parameter-server tutorial (rpc_param_server_tutorial), small, in both worlds.

PyTorch 2.x's forms: ``init_rpc`` with the TensorPipe defaults, ``dist_autograd.backward(context_id,
roots)``, ``DistributedOptimizer.step(context_id)``, RRefs to the server's parameters. The tutorial's
``ParameterServer``, ``get_parameter_server`` singleton, ``remote_method`` helper, ``TrainerNet`` and
training loop are kept; a linear model on random data replaces the ConvNet on MNIST, and one trainer
runs so that the output is the same on every run. Only the imports differ from the tutorial.

Run it: ``python docs/examples/generation_2.py --world sim`` or ``--world gloo``.
"""

from __future__ import annotations

from threading import Lock

import torch
import torch.nn.functional as F
from _two_worlds import chosen_world, run_processes, run_simulated
from torch import nn, optim

# -- imports --
import twinrpc.autograd as dist_autograd  # was: import torch.distributed.autograd as dist_autograd
import twinrpc.rpc as rpc  # was: import torch.distributed.rpc as rpc
from twinrpc.optim import DistributedOptimizer  # was: from torch.distributed.optim import ...

# -- end imports --

BATCHES = 20


# -- program --
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)


# On the local node, call a method with first arg as the value held by the RRef.
def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Given an RRef, return the result of calling the passed in method on the value held by the RRef.
def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)  # noqa: RUF005 (as the tutorial writes it)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


class ParameterServer(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Net()

    def forward(self, inp):
        return self.model(inp)

    # Use dist autograd to retrieve gradients accumulated for this model.
    def get_dist_gradients(self, cid):
        return dist_autograd.get_gradients(cid)

    # Wrap local parameters in a RRef. Needed for building the DistributedOptimizer.
    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]

    def weights(self):
        return [round(v, 3) for v in self.model.fc.weight.detach().flatten().tolist()]


param_server = None
global_lock = Lock()


def get_parameter_server():
    global param_server
    # Ensure that we get only one handle to the ParameterServer.
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
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    true_w = torch.tensor([[2.0], [-1.0], [0.5], [3.0]])
    for _ in range(BATCHES):
        data = torch.randn(16, 4, generator=gen)
        target = data @ true_w
        with dist_autograd.context() as cid:
            model_output = net(data)
            loss = F.mse_loss(model_output, target)
            dist_autograd.backward(cid, [loss])
            # Ensure that dist autograd ran successfully and gradients were returned.
            assert remote_method(ParameterServer.get_dist_gradients, net.param_server_rref, cid) != {}
            opt.step(cid)
    return {
        "last loss": round(loss.item(), 3),
        "weights": remote_method(ParameterServer.weights, net.param_server_rref),
    }


def run_worker(rank, world_size):
    if rank == 0:
        rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size)
        result = None
    else:
        rpc.init_rpc(name=f"trainer_{rank}", rank=rank, world_size=world_size)
        result = run_training_loop(rank)
    rpc.shutdown()
    return result


# -- end program --


if __name__ == "__main__":
    world = chosen_world()
    run = run_simulated if world == "sim" else run_processes
    for key, value in run(run_worker, 2, 1).items():
        print(f"{key}: {value}")
