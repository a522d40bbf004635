"""PyTorch's DDP-under-distributed-autograd test, ported: DistributedDataParallel outside a module whose
``forward`` calls RPC, inside it, or absent, and uneven inputs under ``join()`` (DAG-16, DAG-19).

The program is ``torch/testing/_internal/distributed/ddp_under_dist_autograd_test.py``
(``DdpUnderDistAutogradTest``) with its imports changed: four trainers, a remote worker owning an
embedding and a net (RRefs made with ``rpc.remote``), and a master that creates the trainers with
``rpc.remote`` and drives their ``train_batch`` over RPC. What differs lies outside the part under
test: the workers wait for the master with ``dist.barrier()`` instead of a ``threading.Condition``
that an RPC notifies (a simulated worker must not block its thread); the master returns the gradients
(as lists, with whether ``.grad`` stayed untouched) for the test body to check instead of asserting
on a worker; DDP's deprecated ``check_reduction=True``, which does nothing, is left out; and
``destroy_pg`` drops the DDP module before its group.

Besides PyTorch's own checks (the DDP parameters' gradients all-reduce to zero, the others are not
zero), every gradient must equal what local autograd and DDP's averaging give for the same batches
(``_local_reference``): each trainer's own gradient for parameters DDP does not hold, and for those it
holds, the sum over the trainers that ran the batch divided by the number of trainers.

The last tests cover ``find_unused_parameters=True``: DDP's search for unused parameters stops at an
RPC, and a parameter it does not reach fails the pass, as in PyTorch.
"""

from __future__ import annotations

import contextlib
import enum
import gc
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from conformance._support import dist_autograd_module, rpc_module

NUM_EM_ROW = 2
D_SPARSE = 3
D_DENSE = 2
D_HID = 3
D_OUT = 1
NUM_TRAINERS = 4
# Trainers + the master + the remote worker
WORLD_SIZE = NUM_TRAINERS + 2
TRAINER_RANKS = list(range(NUM_TRAINERS))
REMOTE_WORKER_RANK = TRAINER_RANKS[-1] + 1
MASTER_RANK = REMOTE_WORKER_RANK + 1


class DdpMode(enum.Enum):
    # Don't apply DDP
    NONE = enum.auto()
    # Apply DDP to the top level nn.Module
    OUTSIDE = enum.auto()
    # Embed DDP inside the top level nn.Module
    INSIDE = enum.auto()


class FeatureSet(NamedTuple):
    """A feature set has 2 types of features"""

    dense_features: torch.Tensor
    sparse_features: torch.Tensor
    values: torch.Tensor


def _call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(backend: str, method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    args_tup = (method, rref, *args)
    return rpc_module(backend).rpc_sync(rref.owner(), _call_method, args=args_tup, kwargs=kwargs)


def _remote_method_async(backend: str, method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    args_tup = (method, rref, *args)
    return rpc_module(backend).rpc_async(rref.owner(), _call_method, args=args_tup, kwargs=kwargs)


class RemoteEM(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        init_em = [0.5] * embedding_dim
        self.em = nn.EmbeddingBag(
            num_embeddings, embedding_dim, _weight=torch.tensor([init_em] * num_embeddings)
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.em(input, offsets=torch.LongTensor(range(input.shape[0])))  # type: ignore[no-any-return]


# Return a linear module with predefined parameters.
def getLinear(d_in: int, d_out: int) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, bias=False)
    w = torch.ones((d_out, d_in))
    w[0][0] = -1
    w.requires_grad_()
    layer.weight.data = w
    return layer


class RemoteNet(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = getLinear(d_in, d_out)
        self.relu = nn.ReLU()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.relu(self.fc(input))  # type: ignore[no-any-return]


class HybridModel(nn.Module):
    def __init__(
        self, backend: str, remote_em_rref: Any, remote_net_rref: Any, process_group_for_ddp: Any = None
    ) -> None:
        super().__init__()
        self.backend = backend
        self.remote_em_rref = remote_em_rref
        self.remote_net_rref = remote_net_rref
        self.fc1 = getLinear(D_DENSE, D_DENSE)
        self.fc2: nn.Module = getLinear(D_HID, D_OUT)

        self.non_ddp_params = tuple(self.fc1.parameters()) + tuple(self.fc2.parameters())
        self.ddp_params: tuple[Any, ...] = ()

        if process_group_for_ddp is not None:
            self.non_ddp_params, self.ddp_params = (
                tuple(self.fc1.parameters()),
                tuple(self.fc2.parameters()),
            )
            self.fc2 = DistributedDataParallel(self.fc2, process_group=process_group_for_ddp)

    def forward(self, input: FeatureSet) -> torch.Tensor:
        sparse = _remote_method(self.backend, RemoteEM.forward, self.remote_em_rref, input.sparse_features)
        # The same size of mini batch.
        assert sparse.shape[0] == input.dense_features.shape[0]
        dense = self.fc1(input.dense_features)
        x = torch.cat((dense, sparse), 1)
        x = _remote_method(self.backend, RemoteNet.forward, self.remote_net_rref, x)
        return self.fc2(x)  # type: ignore[no-any-return]


class Trainer:
    def __init__(
        self, backend: str, remote_em_rref: Any, remote_net_rref: Any, ddp_mode: DdpMode, rank: int
    ) -> None:
        self.backend = backend
        self.rank = rank
        self.trainer_group = (
            dist.new_group(TRAINER_RANKS) if ddp_mode in (DdpMode.INSIDE, DdpMode.OUTSIDE) else None
        )
        self.remote_em_rref = remote_em_rref
        self.remote_net_rref = remote_net_rref
        self.hybrid_module: nn.Module = HybridModel(
            backend,
            self.remote_em_rref,
            self.remote_net_rref,
            self.trainer_group if ddp_mode == DdpMode.INSIDE else None,
        )
        self.ddp_params, self.non_ddp_params = (
            self.hybrid_module.ddp_params,
            self.hybrid_module.non_ddp_params,
        )
        if ddp_mode == DdpMode.OUTSIDE:
            self.ddp_params += self.non_ddp_params
            self.non_ddp_params = ()
            self.hybrid_module = DistributedDataParallel(self.hybrid_module, process_group=self.trainer_group)

    def destroy_pg(self) -> None:
        if self.trainer_group:
            # the DDP module (its reducer holds the group) goes first, while the group is there
            self.hybrid_module = None  # type: ignore[assignment]
            gc.collect()
            dist.destroy_process_group(self.trainer_group)

    def train_batch(
        self, mini_batch: FeatureSet, trainer_has_less_inputs: bool, simulate_uneven_inputs: bool
    ) -> tuple[list[list[float]], list[list[float]], bool]:
        dist_autograd = dist_autograd_module(self.backend)
        grads_dict: Any = None
        input_batches = _microbatches(mini_batch, trainer_has_less_inputs, simulate_uneven_inputs)
        with self.hybrid_module.join() if simulate_uneven_inputs else contextlib.nullcontext():  # type: ignore[operator]
            for b in input_batches:
                with dist_autograd.context() as context_id:
                    output = self.hybrid_module.forward(b)
                    loss = (output * mini_batch.values).sum()
                    dist_autograd.backward(context_id, [loss])
                    grads_dict = dist_autograd.get_gradients(context_id)
        untouched = all(p.grad is None for p in self.ddp_params + self.non_ddp_params)
        return (
            [grads_dict[param].tolist() for param in self.ddp_params],
            [grads_dict[param].tolist() for param in self.non_ddp_params],
            untouched,
        )


def _microbatches(
    mini_batch: FeatureSet, trainer_has_less_inputs: bool, simulate_uneven_inputs: bool
) -> list[FeatureSet]:
    """PyTorch's split: microbatches of two examples, half of them for trainers with less inputs."""
    if not simulate_uneven_inputs:
        return [mini_batch]
    batches = [
        FeatureSet(dense_features=d, sparse_features=s, values=v)
        for d, s, v in zip(
            torch.split(mini_batch.dense_features, 2),
            torch.split(mini_batch.sparse_features, 2),
            torch.split(mini_batch.values, 2),
            strict=True,
        )
    ]
    return batches[: len(batches) // 2] if trainer_has_less_inputs else batches


def get_training_examples() -> list[FeatureSet]:
    n = 16
    training_examples = FeatureSet(
        dense_features=torch.zeros((n, D_DENSE)),
        sparse_features=torch.zeros(n, dtype=torch.long),
        values=torch.zeros(n),
    )
    idx = 0
    # Every example has another one that has exactly the same features but an
    # opposite value. Therefore, their grads cancel each other in all-reduce.
    for value in (-1, 1):
        for x in (-1.0 * value, 1.0 * value):
            for y in (1.0 * value, -1.0 * value):
                for z in (0, 1):
                    training_examples.dense_features[idx, :] = torch.tensor((x, y))
                    training_examples.sparse_features[idx] = z
                    training_examples.values[idx] = value
                    idx += 1

    # Split the examples among NUM_TRAINERS trainers
    assert n % NUM_TRAINERS == 0
    examples_per_trainer = int(n / NUM_TRAINERS)
    return [
        FeatureSet(
            dense_features=training_examples.dense_features[start : start + examples_per_trainer, :],
            sparse_features=training_examples.sparse_features[start : start + examples_per_trainer],
            values=training_examples.values[start : start + examples_per_trainer],
        )
        for start in range(0, n, examples_per_trainer)
    ]


# -- the worlds' programs --------------------------------------------------------------------------
def _do_test_on_master(ctx: Any, ddp_mode: DdpMode, simulate_uneven_inputs: bool) -> list[Any]:
    rpc = ctx.rpc
    remote_worker = ctx.name(REMOTE_WORKER_RANK)
    remote_em_rref = rpc.remote(remote_worker, RemoteEM, args=(NUM_EM_ROW, D_SPARSE))
    remote_net_rref = rpc.remote(remote_worker, RemoteNet, args=(D_DENSE + D_SPARSE, D_HID))
    trainer_rrefs = [
        rpc.remote(
            ctx.name(rank), Trainer, args=(ctx.backend, remote_em_rref, remote_net_rref, ddp_mode, rank)
        )
        for rank in TRAINER_RANKS
    ]
    if ddp_mode in (DdpMode.INSIDE, DdpMode.OUTSIDE):
        # new_group needs to be called on ranks.
        dist.new_group(TRAINER_RANKS)

    training_examples = get_training_examples()
    iterations = []
    for _ in range(3):
        futures = []
        for idx, trainer_rref in enumerate(trainer_rrefs):
            # Half the trainers will deplete inputs earlier than the rest.
            trainer_has_less_inputs = simulate_uneven_inputs and idx < len(trainer_rrefs) // 2
            futures.append(
                _remote_method_async(
                    ctx.backend,
                    Trainer.train_batch,
                    trainer_rref,
                    training_examples[idx],
                    trainer_has_less_inputs,
                    simulate_uneven_inputs,
                )
            )
        iterations.append([future.wait() for future in futures])

    # Destroy process groups
    for trainer_rref in trainer_rrefs:
        _remote_method_async(ctx.backend, Trainer.destroy_pg, trainer_rref).wait()
    return iterations


def _ddp_under_dist_autograd(
    ctx: Any, init_file: str, ddp_mode: DdpMode, simulate_uneven_inputs: bool
) -> Any:
    """Every rank joins the default process group (as PyTorch's test); the master drives the trainers,
    the others serve until the master is done (a barrier stands for PyTorch's shutdown signal)."""
    dist.init_process_group(
        backend="gloo", init_method=f"file://{init_file}", world_size=WORLD_SIZE, rank=ctx.rank
    )
    try:
        # RPC is up before the process group here (the harness starts it), so the master's first calls,
        # which make groups on the trainers, must wait until every rank has its default group
        dist.barrier()
        result = None
        if ctx.rank == MASTER_RANK:
            result = _do_test_on_master(ctx, ddp_mode, simulate_uneven_inputs)
        elif ctx.rank == REMOTE_WORKER_RANK and ddp_mode in (DdpMode.INSIDE, DdpMode.OUTSIDE):
            # new_group needs to be called on ranks.
            dist.new_group(TRAINER_RANKS)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


# -- the reference: local autograd and DDP's average ------------------------------------------------
def _local_reference(ddp_mode: DdpMode, simulate_uneven_inputs: bool) -> list[tuple[list[Any], list[Any]]]:
    """Per trainer, the (DDP, other) gradients its last microbatch's context must hold."""
    em, net = RemoteEM(NUM_EM_ROW, D_SPARSE), RemoteNet(D_DENSE + D_SPARSE, D_HID)
    examples = get_training_examples()
    # own[t][j]: trainer t's local gradients of (fc1, fc2) for its microbatch j
    own: list[list[list[torch.Tensor]]] = []
    for idx, mini_batch in enumerate(examples):
        less = simulate_uneven_inputs and idx < NUM_TRAINERS // 2
        own.append([])
        for b in _microbatches(mini_batch, less, simulate_uneven_inputs):
            fc1, fc2 = getLinear(D_DENSE, D_DENSE), getLinear(D_HID, D_OUT)
            x = net(torch.cat((fc1(b.dense_features), em(b.sparse_features)), 1))
            (fc2(x) * mini_batch.values).sum().backward()
            own[-1].append([fc1.weight.grad, fc2.weight.grad])  # type: ignore[list-item]

    def averaged(j: int, i: int) -> torch.Tensor:
        # DDP divides by the (initial) number of trainers; joined trainers contribute zeros
        return (
            sum((own[t][j][i] for t in range(NUM_TRAINERS) if j < len(own[t])), torch.zeros(1)) / NUM_TRAINERS
        )

    expected = []
    for t in range(NUM_TRAINERS):
        j = len(own[t]) - 1
        fc1_grad, fc2_grad = own[t][j]
        if ddp_mode is DdpMode.NONE:
            expected.append(([], [fc1_grad.tolist(), fc2_grad.tolist()]))
        elif ddp_mode is DdpMode.INSIDE:
            expected.append(([averaged(j, 1).tolist()], [fc1_grad.tolist()]))
        else:
            expected.append(([averaged(j, 0).tolist(), averaged(j, 1).tolist()], []))
    return expected


def _check(iterations: list[Any], ddp_mode: DdpMode, simulate_uneven_inputs: bool) -> None:
    expected = _local_reference(ddp_mode, simulate_uneven_inputs)
    assert len(iterations) == 3
    for trainers in iterations:
        for t, (ddp_grads, non_ddp_grads, untouched) in enumerate(trainers):
            # PyTorch's own checks
            if not simulate_uneven_inputs:
                for grad in ddp_grads:
                    assert torch.equal(torch.tensor(grad), torch.zeros_like(torch.tensor(grad))), (t, grad)
            for grad in non_ddp_grads:
                assert not torch.equal(torch.tensor(grad), torch.zeros_like(torch.tensor(grad))), (t, grad)
            # and equality with local autograd and DDP's average, for every parameter
            want_ddp, want_non_ddp = expected[t]
            for got, want in zip(ddp_grads + non_ddp_grads, want_ddp + want_non_ddp, strict=True):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
            assert untouched, f"trainer {t}: a distributed backward wrote .grad"


def _do_test(world: Any, tmp_path: Any, ddp_mode: DdpMode, simulate_uneven_inputs: bool = False) -> None:
    results = world.run(
        _ddp_under_dist_autograd,
        str(tmp_path / "pg"),
        ddp_mode,
        simulate_uneven_inputs,
        world_size=WORLD_SIZE,
    )
    _check(results[MASTER_RANK], ddp_mode, simulate_uneven_inputs)


@pytest.mark.spec("DAG-16", "DAG-9")
def test_backward_no_ddp(world: Any, tmp_path: Any) -> None:
    _do_test(world, tmp_path, DdpMode.NONE)


@pytest.mark.spec("DAG-19")
def test_backward_ddp_outside(world: Any, tmp_path: Any) -> None:
    _do_test(world, tmp_path, DdpMode.OUTSIDE)


@pytest.mark.spec("DAG-19")
def test_backward_ddp_outside_uneven_inputs(world: Any, tmp_path: Any) -> None:
    _do_test(world, tmp_path, DdpMode.OUTSIDE, simulate_uneven_inputs=True)


@pytest.mark.spec("DAG-16")
def test_backward_ddp_inside(world: Any, tmp_path: Any) -> None:
    _do_test(world, tmp_path, DdpMode.INSIDE)


# -- find_unused_parameters: what the reducer's own search does not reach ---------------------------
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class _ThreeLayers(nn.Module):
    """``a``, then ``b`` (on the far side of an RPC when ``rpc_between``), then ``c`` when ``use_c``."""

    def __init__(self, backend: str, rpc_between: bool, use_c: bool) -> None:
        super().__init__()
        self.backend, self.rpc_between, self.use_c = backend, rpc_between, use_c
        self.a, self.b, self.c = getLinear(3, 3), getLinear(3, 3), getLinear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.rpc_between:
            x = rpc_module(self.backend).rpc_sync("worker2", _double, args=(x,))
        x = self.b(x)
        return self.c(x) if self.use_c else x


def _find_unused_parameters(ctx: Any, init_file: str, rpc_between: bool, use_c: bool) -> Any:
    """Trainers 0 and 1 (a gloo group of two) train DDP(find_unused_parameters=True) in a context; rank 2
    serves the RPC. Returns the DDP gradients in the context and local DDP's, or the error."""
    if ctx.rank == 2:
        return None
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=ctx.rank, world_size=2)
    ddp = reference = None
    try:
        model = _ThreeLayers(ctx.backend, rpc_between, use_c)
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        x = torch.ones(2, 3) * (ctx.rank + 1)
        try:
            with ctx.dist_autograd.context() as cid:
                ctx.dist_autograd.backward(cid, [ddp(x).sum()])
                grads = ctx.dist_autograd.get_gradients(cid)
                got = {n: grads[p].tolist() for n, p in model.named_parameters() if p in grads}
        except RuntimeError as exc:
            return {"error": str(exc)}
        local = _ThreeLayers(ctx.backend, False, use_c)
        reference = DistributedDataParallel(local, find_unused_parameters=True)
        reference(x).sum().backward()
        want = {n: p.grad.tolist() for n, p in local.named_parameters() if p.grad is not None}
        return {"context": got, "local": want, "untouched": all(p.grad is None for p in model.parameters())}
    finally:
        ddp = reference = None
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.spec("DAG-19")
def test_find_unused_parameters_with_every_parameter_used_gives_local_ddp_gradients(
    world: Any, tmp_path: Any
) -> None:
    for got in world.run(_find_unused_parameters, str(tmp_path / "pg"), False, True, world_size=3)[:2]:
        assert got["context"].keys() == {"a.weight", "b.weight", "c.weight"}
        for name, grad in got["context"].items():
            torch.testing.assert_close(torch.tensor(grad), torch.tensor(got["local"][name]))
        assert got["untouched"]


@pytest.mark.spec("DAG-19")
@pytest.mark.parametrize(
    ("rpc_between", "use_c", "unreached"),
    [(False, False, "c.weight"), (True, True, "a.weight")],
    ids=["unused-parameter", "parameter-before-an-rpc"],
)
def test_find_unused_parameters_fails_the_pass_for_a_parameter_its_search_does_not_reach(
    world: Any, tmp_path: Any, rpc_between: bool, use_c: bool, unreached: str
) -> None:
    results = world.run(_find_unused_parameters, str(tmp_path / "pg"), rpc_between, use_c, world_size=3)
    for rank in (0, 1):
        message = results[rank]["error"]
        assert f"Error on Node {rank}" in message
        assert "The grad for the variable should exist in dist_autograd context" in message
        if world.backend != "torch":  # twinrpc names the parameter
            assert unreached in message
