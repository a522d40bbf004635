"""Property: DDP inside distributed autograd contexts gives, on every rank and every step, the gradient
of the average loss over all ranks' batches, as local DDP does (spec DAG-16), in the simulator.

The reference needs no process group at all: the mean over ranks of each rank's own local gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP
from twinrpc.simulator import Simulation

import twinrpc.autograd as dist_autograd
import twinrpc.rpc as rpc


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(1234)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 2))


def _batches(rank: int, steps: int, batch: int, width: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(batch, width, generator=g) for _ in range(steps)]


def _remote_offset(t: torch.Tensor) -> torch.Tensor:
    return t + 0.5


def _program(
    rank: int, world: int, width: int, depth: int, steps: int, batch: int, bucket_cap_mb: float
) -> list[list[torch.Tensor]]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
    model = _model(width, depth)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)  # tiny: one bucket per parameter
    out = []
    for x in _batches(rank, steps, batch, width):
        with dist_autograd.context() as cid:
            # the target comes through an RPC, so the graph holds a recv function beside DDP's leaves
            target = rpc.rpc_sync(f"w{(rank + 1) % world}", _remote_offset, args=(torch.zeros(batch, 2),))
            loss = (ddp(x) - target).pow(2).mean()
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
            out.append([grads[p].clone() for p in model.parameters()])
    rpc.shutdown()
    dist.destroy_process_group()
    return out


def _expected(world: int, width: int, depth: int, steps: int, batch: int) -> list[list[torch.Tensor]]:
    per_rank = []
    for rank in range(world):
        model = _model(width, depth)
        grads = []
        for x in _batches(rank, steps, batch, width):
            model.zero_grad(set_to_none=True)
            (model(x) - 0.5).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        per_rank.append(grads)
    return [
        [torch.stack([per_rank[r][s][i] for r in range(world)]).mean(0) for i in range(len(per_rank[0][s]))]
        for s in range(steps)
    ]


@settings(max_examples=12, deadline=None)
@given(
    world=st.integers(2, 3),
    bucket_cap_mb=st.sampled_from([25.0, 1e-5]),
    width=st.integers(1, 6),
    depth=st.integers(0, 2),
    steps=st.integers(1, 3),
    batch=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_ddp_gradients_in_contexts_are_the_average_of_every_ranks_local_gradient(
    world: int, bucket_cap_mb: float, width: int, depth: int, steps: int, batch: int, seed: int
) -> None:
    result = Simulation(world, seed=seed).run(_program, world, width, depth, steps, batch, bucket_cap_mb)
    expected = _expected(world, width, depth, steps, batch)
    for got in result.values():
        assert len(got) == steps
        for step_got, step_expected in zip(got, expected, strict=True):
            for g, e in zip(step_got, step_expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_init_process_group_without_rank_names_what_the_simulation_needs() -> None:
    result = Simulation(1).run(lambda rank: _error_of(lambda: dist.init_process_group("gloo")))
    assert "needs rank and world_size" in result.values()[0]


def _error_of(thunk: Any) -> str:
    try:
        thunk()
    except Exception as exc:
        return str(exc)
    return "no error"
