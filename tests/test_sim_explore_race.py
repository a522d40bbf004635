"""The parameter-server tutorial's race, found by exploration and shrunk (issue 6, point 7).

The program is the seeds' parameter server (PyTorch's rpc_param_server_tutorial) as written: a
``ParameterServer`` module behind an RRef, ``TrainerNet`` forwarding through it with
``remote_method``, a distributed backward and a ``DistributedOptimizer`` step per batch, two trainers.
The model and the data are small (a two-layer MLP, five batches of random data) so a run takes
milliseconds. The race: a trainer's optimizer step updates the server's parameters in place; landing
between another trainer's forward and its backward, it makes that backward fail with "one of the
variables needed for gradient computation has been modified by an inplace operation" (PyTorch too).
``FIXED = True`` applies the fix of examples/parameter_server.py: the forward pass runs on a snapshot
of the parameters.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn, optim
from twinrpc.simulator import Failure, explore, replay
from twinrpc.simulator._explore import fault_count

import twinrpc.autograd as dist_autograd
import twinrpc.rpc as rpc
from twinrpc.optim import DistributedOptimizer

FIXED = False
BATCHES = 5
RACE = "modified by an inplace operation"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        p = dict(self.named_parameters()) if params is None else params
        x = F.relu(F.linear(x, p["fc1.weight"], p["fc1.bias"]))
        return F.log_softmax(F.linear(x, p["fc2.weight"], p["fc2.bias"]), dim=1)


def call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return rpc.rpc_sync(rref.owner(), call_method, args=[method, rref, *args], kwargs=kwargs)


class ParameterServer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if FIXED:  # the fix: autograd saves clones, which the other trainer's step leaves alone
            return self.model(inp, {name: p.clone() for name, p in self.model.named_parameters()})  # type: ignore[no-any-return]
        return self.model(inp)  # type: ignore[no-any-return]

    def get_param_rrefs(self) -> list[Any]:
        return [rpc.RRef(param) for param in self.model.parameters()]


_servers: dict[str, ParameterServer] = {}  # one per simulated worker (all share this process)


def get_parameter_server() -> ParameterServer:
    name = rpc.get_worker_info().name
    if name not in _servers:
        _servers[name] = ParameterServer()
    return _servers[name]


class TrainerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server)

    def get_global_param_rrefs(self) -> list[Any]:
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remote_method(ParameterServer.forward, self.param_server_rref, x)  # type: ignore[no-any-return]


def run_training_loop(rank: int) -> None:
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


def run_worker(rank: int) -> None:
    """The tutorial's run_worker: rank 0 is the parameter server, the others train."""
    name = "parameter_server" if rank == 0 else f"trainer_{rank}"
    rpc.init_rpc(name, rank=rank, world_size=3)
    try:
        if rank != 0:
            run_training_loop(rank)
        rpc.shutdown()
    finally:
        _servers.pop(name, None)


def _check_race(failure: Failure) -> None:
    assert failure.runs <= 200
    assert fault_count(failure.faults) <= 3, failure.faults.describe()
    assert failure.exception_type == "builtins.RuntimeError"
    assert RACE in str(failure.error) and RACE in str(failure.minimal_error)
    assert failure.rank in (1, 2)  # a trainer's backward fails, on the server
    with pytest.raises(RuntimeError, match=failure.pattern):
        replay(run_worker, 3, seed=failure.seed, faults=failure.faults)


def test_exploration_finds_the_inplace_race_within_200_runs_and_shrinks_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(Failure) as info:
        explore(run_worker, 3, runs=200, max_shrink_runs=100)
    failure = info.value
    print(failure)
    _check_race(failure)
    monkeypatch.setattr(sys.modules[__name__], "FIXED", True)  # the fix passes the run that failed
    replay(run_worker, 3, seed=failure.seed, faults=failure.faults)


def test_faults_alone_find_the_race_under_one_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Failure) as info:
        explore(run_worker, 3, runs=200, seeds=st.just(0), max_shrink_runs=60)
    failure = info.value
    print(failure)
    _check_race(failure)
    assert failure.seed == 0 and fault_count(failure.faults) >= 1  # seed 0 alone passes
    monkeypatch.setattr(sys.modules[__name__], "FIXED", True)
    replay(run_worker, 3, seed=0, faults=failure.faults)
