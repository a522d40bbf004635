"""Property: wherever DistributedDataParallel sits around RPC (around the whole model, around its
local head only, or nowhere) and whatever the model does over RPC, the gradients in every trainer's
context equal local autograd with DDP's average, and equal what upstream PyTorch computes for the same
program (spec DAG-16, DAG-19).

A drawn program is plain data (:class:`Program`): two trainers (ranks 0 and 1, one gloo group for DDP)
run a model of stages, each a local ``Linear``, a ``Linear`` on rank 2 called through an RRef, or a
stateless builtin call on rank 2, then a local head, for their own number of steps (unequal counts
run under ``join()``), with or without ``find_unused_parameters``. The reference is local autograd on copies of the same modules: a DDP parameter's
gradient is the sum over the trainers that ran the step divided by two, every other parameter's (the
remote modules' included, read from their owner's context) the trainer's own. With
``find_unused_parameters=True``, a DDP parameter used only before an RPC fails the pass instead, in
PyTorch as in twinrpc (``Program.fails``).

The program runs through the conformance harness's backends: many examples on the simulator, and a
few on upstream ``torch.distributed.rpc`` in real processes, which must give the same gradients.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

from conformance._support import dist_autograd_module
from conformance.harness import BackendConfig, World
from conformance.harness._sim import SimBackend
from conformance.harness._torch import TorchBackend

TRAINERS = 2
OWNER = 2


@dataclass(frozen=True)
class Program:
    placement: str  # "outside" (DDP around the whole model), "inside" (around its head), "none"
    stages: tuple[str, ...]  # each "local", "remote_module" or "remote_builtin"
    width: int
    batch: int
    steps: tuple[int, ...]  # per trainer
    bucket_cap_mb: float
    find_unused: bool = False  # DDP's find_unused_parameters

    def fails(self) -> bool:
        """DDP's search for unused parameters (find_unused_parameters) stops at an RPC: a parameter
        used only before one fails the pass, in PyTorch as in twinrpc."""
        rpcs = [i for i, kind in enumerate(self.stages) if kind != "local"]
        return (
            self.find_unused
            and self.placement == "outside"
            and bool(rpcs)
            and "local" in self.stages[: rpcs[-1]]
        )


programs = st.builds(
    Program,
    placement=st.sampled_from(["outside", "inside", "none"]),
    stages=st.lists(st.sampled_from(["local", "remote_module", "remote_builtin"]), max_size=3).map(tuple),
    width=st.integers(1, 4),
    batch=st.integers(1, 3),
    steps=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    bucket_cap_mb=st.sampled_from([25.0, 1e-6]),
    find_unused=st.booleans(),
)


# -- the model (on the trainers; its remote parts on the owner) -------------------------------------
def _linear(width_in: int, width_out: int, seed: int) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(width_in, width_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    return layer


def _call_forward(rref: Any, x: torch.Tensor) -> torch.Tensor:
    return rref.local_value()(x)  # type: ignore[no-any-return]


def _remote_grads(rref: Any, context_id: int, backend: str) -> list[list[float]]:
    grads = dist_autograd_module(backend).get_gradients(context_id)
    return [grads[p].flatten().tolist() for p in rref.local_value().parameters()]


class Hybrid(torch.nn.Module):
    """The drawn stages, then a local head (wrapped in DDP for the "inside" placement)."""

    def __init__(self, rpc: Any, program: Program, remotes: list[Any], group: Any) -> None:
        super().__init__()
        self.rpc = rpc
        self.stages = program.stages
        self.remotes = remotes
        self.locals = torch.nn.ModuleList(
            _linear(program.width, program.width, i)
            for i, kind in enumerate(program.stages)
            if kind == "local"
        )
        head = _linear(program.width, 2, 100)
        self.head: torch.nn.Module = head
        if program.placement == "inside":
            self.head = DDP(
                head,
                process_group=group,
                bucket_cap_mb=program.bucket_cap_mb,
                find_unused_parameters=program.find_unused,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local_layers, remotes = iter(self.locals), iter(self.remotes)
        for kind in self.stages:
            if kind == "local":
                x = torch.tanh(next(local_layers)(x))
            elif kind == "remote_module":
                x = self.rpc.rpc_sync(f"worker{OWNER}", _call_forward, args=(next(remotes), x))
            else:
                x = self.rpc.rpc_sync(f"worker{OWNER}", torch.mul, args=(x, 2.0))
        return self.head(x)  # type: ignore[no-any-return]


def _batches(program: Program, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    return [
        (
            torch.randn(program.batch, program.width, generator=gen),
            torch.randn(program.batch, 2, generator=gen),
        )
        for _ in range(program.steps[rank])
    ]


def _train(ctx: Any, program: Program, init_file: str) -> Any:
    """A trainer's steps, each in a context: per step, its local parameters' gradients (in the
    model's order) and its remote modules' (read from the owner's context)."""
    if ctx.rank == OWNER:
        return None
    rpc, dist_autograd = ctx.rpc, ctx.dist_autograd
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=ctx.rank, world_size=TRAINERS)
    model = ddp = None
    try:
        remotes = [
            rpc.remote(f"worker{OWNER}", _linear, args=(program.width, program.width, i))
            for i, kind in enumerate(program.stages)
            if kind == "remote_module"
        ]
        model = Hybrid(rpc, program, remotes, dist.group.WORLD)
        ddp = model
        if program.placement == "outside":
            ddp = DDP(model, bucket_cap_mb=program.bucket_cap_mb, find_unused_parameters=program.find_unused)
        joinable = ddp if program.placement == "outside" else model.head
        uneven = program.placement != "none" and len(set(program.steps)) > 1
        params = [p for p in model.parameters()]
        steps = []
        try:
            with joinable.join() if uneven else contextlib.nullcontext():
                for x, target in _batches(program, ctx.rank):
                    with dist_autograd.context() as cid:
                        loss = (ddp(x) - target).pow(2).mean()
                        dist_autograd.backward(cid, [loss])
                        grads = dist_autograd.get_gradients(cid)
                        remote = [
                            rpc.rpc_sync(f"worker{OWNER}", _remote_grads, args=(r, cid, ctx.backend))
                            for r in remotes
                        ]
                        steps.append(([grads[p].flatten().tolist() for p in params], remote))
        except RuntimeError as exc:
            return {"error": str(exc)}
        return {"steps": steps, "untouched": all(p.grad is None for p in params)}
    finally:
        # the DDP modules (their reducers hold the group) go first, while the group is there
        model = ddp = joinable = None
        gc.collect()
        dist.destroy_process_group()


# -- the reference ---------------------------------------------------------------------------------
def _reference(program: Program) -> list[list[tuple[list[list[float]], list[list[list[float]]]]]]:
    """Per trainer and step: (local parameters' gradients, remote modules' gradients)."""
    own: list[list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]] = []
    for rank in range(TRAINERS):
        own.append([])
        for x, target in _batches(program, rank):
            local_layers = [
                _linear(program.width, program.width, i) for i, k in enumerate(program.stages) if k == "local"
            ]
            remote_layers = [
                _linear(program.width, program.width, i)
                for i, k in enumerate(program.stages)
                if k == "remote_module"
            ]
            head = _linear(program.width, 2, 100)
            li, ri = iter(local_layers), iter(remote_layers)
            h = x
            for kind in program.stages:
                h = (
                    torch.tanh(next(li)(h))
                    if kind == "local"
                    else next(ri)(h)
                    if kind == "remote_module"
                    else h * 2.0
                )
            (head(h) - target).pow(2).mean().backward()
            local_grads = [p.grad.flatten() for m in (*local_layers, head) for p in m.parameters()]  # type: ignore[union-attr]
            remote_grads = [[p.grad.flatten() for p in m.parameters()] for m in remote_layers]  # type: ignore[union-attr]
            own[-1].append((local_grads, remote_grads))
    n_head = 2  # the head's weight and bias come last in the model's parameters
    expected = []
    for rank in range(TRAINERS):
        steps = []
        for s, (local_grads, remote_grads) in enumerate(own[rank]):
            held = (
                range(len(local_grads))
                if program.placement == "outside"
                else range(len(local_grads) - n_head, len(local_grads))
                if program.placement == "inside"
                else range(0)
            )
            grads = [
                sum((own[r][s][0][i] for r in range(TRAINERS) if s < len(own[r])), torch.zeros(1)) / TRAINERS
                if i in held
                else g
                for i, g in enumerate(local_grads)
            ]
            steps.append(([g.tolist() for g in grads], [[g.tolist() for g in m] for m in remote_grads]))
        expected.append(steps)
    return expected


def _assert_equal_grads(got: Any, want: Any, what: str) -> None:
    assert len(got) == len(want), what
    for s, ((got_local, got_remote), (want_local, want_remote)) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(
            zip(
                [*got_local, *itertools.chain(*got_remote)],
                [*want_local, *itertools.chain(*want_remote)],
                strict=True,
            )
        ):
            torch.testing.assert_close(
                torch.tensor(g), torch.tensor(w), rtol=1e-5, atol=1e-6, msg=f"{what}, step {s}, gradient {i}"
            )


def _run(world: World, program: Program, tmp: Path) -> list[Any]:
    results = world.run(_train, program, str(tmp / f"pg-{uuid.uuid4().hex}"), world_size=TRAINERS + 1)
    return results[:TRAINERS]


def _check_against_reference(program: Program, results: list[Any], what: str) -> None:
    if program.fails():
        for rank, got in enumerate(results):
            assert "The grad for the variable should exist in dist_autograd context" in got.get(
                "error", ""
            ), f"{what}: trainer {rank}: {got}"
        return
    expected = _reference(program)
    for rank, got in enumerate(results):
        assert "error" not in got, f"{what}: trainer {rank}: {got['error']}"
        _assert_equal_grads(
            got["steps"], expected[rank], f"{what}: trainer {rank} vs local autograd with DDP's average"
        )
        assert got["untouched"], f"{what}: trainer {rank}: a distributed backward wrote .grad"


# -- the properties ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="twinrpc-ddp-placement-"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def torch_world(scratch: Path) -> Iterator[World]:
    backend = TorchBackend(BackendConfig(tmp_dir=scratch, world_timeout=60.0, spares=0))
    yield World(backend, default_timeout=60.0)
    backend.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=programs, seed=st.integers(0, 1000))
# PyTorch's "outside" case: a DDP parameter whose gradient arrives only once the RPC's came back
@example(program=Program("outside", ("local", "remote_module", "remote_builtin"), 3, 2, (1, 1), 25.0), seed=0)
@example(program=Program("outside", ("local", "remote_module"), 2, 2, (2, 1), 1e-6), seed=1)
# find_unused_parameters: a parameter used only before an RPC fails the pass
@example(program=Program("outside", ("local", "remote_builtin"), 2, 1, (1, 1), 25.0, True), seed=2)
# join() with find_unused_parameters: the joined trainer all-reduces its map of used parameters
@example(program=Program("outside", ("remote_module", "local"), 2, 1, (2, 1), 25.0, True), seed=3)
def test_ddp_anywhere_around_rpc_gives_local_ddp_gradients_in_the_simulator(
    program: Program, seed: int, scratch: Path
) -> None:
    world = World(SimBackend(BackendConfig(sim_seed=seed, tmp_dir=scratch)), default_timeout=60.0)
    _check_against_reference(program, _run(world, program, scratch), "simulator")


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=programs)
def test_ddp_anywhere_around_rpc_gives_upstream_pytorchs_gradients(
    program: Program, scratch: Path, torch_world: World
) -> None:
    upstream = _run(torch_world, program, scratch)
    _check_against_reference(program, upstream, "upstream PyTorch")
    sim = World(SimBackend(BackendConfig(tmp_dir=scratch)), default_timeout=60.0)
    for rank, (mine, theirs) in enumerate(zip(_run(sim, program, scratch), upstream, strict=True)):
        if program.fails():
            assert "error" in mine, f"trainer {rank}: the simulator gave gradients where PyTorch fails"
            continue
        _assert_equal_grads(mine["steps"], theirs["steps"], f"trainer {rank}: simulator vs upstream PyTorch")
