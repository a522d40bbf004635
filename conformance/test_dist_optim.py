"""DistributedOptimizer: construction, functional variant, step, gradients from the owner's context
(OPT-1..OPT-5). Results are compared with the same optimizer run locally on the same computation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conformance._support import outcome

# optimizer name -> (class, kwargs)
OPTIMIZERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"lr": 0.05}),
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "Adam": (torch.optim.Adam, {"lr": 0.05}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 0.5}),
    "Rprop": (torch.optim.Rprop, {"lr": 0.05}),
    "Adamax": (torch.optim.Adamax, {"lr": 0.05}),
}


def _param(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_()


def _matmul(rref: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ rref.local_value())


def _value(rref: Any) -> torch.Tensor:
    return rref.local_value().detach().clone()


class _PlainSGD(torch.optim.SGD):
    """Not in the functional map: owners build the plain optimizer (OPT-2)."""


class _FailingOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise ValueError("Error running optimizer.")


class _FailingConstructor(torch.optim.Optimizer):
    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, {})
        raise ValueError("Error creating optimizer.")


def _forward(ctx: Any, p1: Any, p2: Any, x: torch.Tensor) -> torch.Tensor:
    h = ctx.rpc.rpc_sync(ctx.name(1), _matmul, args=(p1, x))
    y = ctx.rpc.rpc_sync(ctx.name(2), _matmul, args=(p2, h))
    return (y * y).sum()


def _train(ctx: Any, name: str, steps: int) -> dict[str, Any]:
    cls, kwargs = OPTIMIZERS[name]
    p1 = ctx.rpc.remote(ctx.name(1), _param, args=(1, (4, 5)))
    p2 = ctx.rpc.remote(ctx.name(2), _param, args=(2, (5, 3)))
    opt = ctx.optim.DistributedOptimizer(cls, [p1, p2], **kwargs)
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 + i)) for i in range(steps)]
    for x in xs:
        with ctx.dist_autograd.context() as cid:
            loss = _forward(ctx, p1, p2, x)
            ctx.dist_autograd.backward(cid, [loss])
            opt.step(cid)
    got = [ctx.rpc.rpc_sync(p.owner(), _value, args=(p,)) for p in (p1, p2)]
    l1, l2 = _param(1, (4, 5)), _param(2, (5, 3))
    local = cls([l1, l2], **kwargs)
    for x in xs:
        local.zero_grad()
        y = torch.tanh(torch.tanh(x @ l1) @ l2)
        (y * y).sum().backward()
        local.step()
    return {
        "equal": [torch.allclose(g, w.detach(), atol=1e-5) for g, w in zip(got, (l1, l2), strict=True)],
        "moved": not torch.allclose(got[0], _param(1, (4, 5)).detach()),
        "functional": opt.is_functional_optim,
        "n_remote": len(opt.remote_optimizers),
    }


@pytest.mark.spec("OPT-1", "OPT-2", "OPT-4", "OPT-5", "DAG-12")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_distributed_step_equals_the_local_optimizer(world: Any, name: str) -> None:
    # generous bound: on torch, owners compile the functional optimizer with TorchScript first
    got = world.run_on(0, _train, name, 3, world_size=3, timeout=300)
    assert got == {"equal": [True, True], "moved": True, "functional": True, "n_remote": 2}


def _plain(ctx: Any) -> dict[str, Any]:
    p1 = ctx.rpc.remote(ctx.name(1), _param, args=(1, (4, 5)))
    p2 = ctx.rpc.remote(ctx.name(1), _param, args=(2, (5, 3)))
    opt = ctx.optim.DistributedOptimizer(_PlainSGD, [p1, p2], lr=0.1)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    with ctx.dist_autograd.context() as cid:
        h = ctx.rpc.rpc_sync(ctx.name(1), _matmul, args=(p1, x))
        ctx.dist_autograd.backward(cid, [h.sum()])  # p2 gets no gradient
        opt.step(cid)
    l1 = _param(1, (4, 5))
    torch.tanh(x @ l1).sum().backward()
    with torch.no_grad():
        l1 -= 0.1 * l1.grad  # type: ignore[operator]
    v1 = ctx.rpc.rpc_sync(ctx.name(1), _value, args=(p1,))
    v2 = ctx.rpc.rpc_sync(ctx.name(1), _value, args=(p2,))
    return {
        "functional": opt.is_functional_optim,
        "n_remote": len(opt.remote_optimizers),
        "p1": torch.allclose(v1, l1.detach(), atol=1e-6),
        "p2_unchanged": torch.equal(v2, _param(2, (5, 3)).detach()),
    }


@pytest.mark.spec("OPT-1", "OPT-2", "OPT-4")
def test_plain_optimizer_on_one_owner_leaves_params_without_gradient_unchanged(world: Any) -> None:
    got = world.run_on(0, _plain)
    assert got == {"functional": False, "n_remote": 1, "p1": True, "p2_unchanged": True}


def _errors(ctx: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    p1 = ctx.rpc.remote(ctx.name(1), _param, args=(1, (4, 5)))
    out["ctor"] = outcome(lambda: ctx.optim.DistributedOptimizer(_FailingConstructor, [p1]))
    opt = ctx.optim.DistributedOptimizer(_FailingOptimizer, [p1])
    x = torch.randn(2, 4)
    with ctx.dist_autograd.context() as cid:
        h = ctx.rpc.rpc_sync(ctx.name(1), _matmul, args=(p1, x))
        ctx.dist_autograd.backward(cid, [h.sum()])
        out["step"] = outcome(lambda: opt.step(cid))
    out["unknown"] = outcome(lambda: opt.step(cid))
    return out


@pytest.mark.spec("OPT-1", "OPT-3")
def test_owner_errors_reach_the_caller_and_unknown_contexts_are_refused(world: Any) -> None:
    got = world.run_on(0, _errors)
    assert "Error creating optimizer." in got["ctor"][1]
    assert "Error running optimizer." in got["step"][1]
    kinds, msg = got["unknown"]
    assert "RuntimeError" in kinds and "Could not find autograd context with id" in msg


# -- OPT-5 as a property: random partitions, random optimizer -------------------------------------
def _plan_optim_program(ctx: Any, plan: dict[str, Any], name: str) -> list[bool]:
    from conformance.test_dist_autograd import _plan_param, run_plan

    cls, kwargs = OPTIMIZERS[name]
    params = [ctx.rpc.remote(ctx.name(o), _plan_param, args=(100 + i,)) for i, o in enumerate(plan["owners"])]
    opt = ctx.optim.DistributedOptimizer(cls, params, **kwargs)
    x = torch.randn(3, generator=torch.Generator().manual_seed(plan["seed"]))
    for _ in range(2):
        with ctx.dist_autograd.context() as cid:
            ctx.dist_autograd.backward(cid, [run_plan(ctx, plan, [x], params)])
            opt.step(cid)
    got = [ctx.rpc.rpc_sync(p.owner(), _value, args=(p,)) for p in params]
    lparams = [_plan_param(100 + i) for i in range(len(params))]
    local = cls(lparams, **kwargs)
    for _ in range(2):
        local.zero_grad()
        run_plan(None, plan, [x], lparams).backward()
        local.step()
    return [torch.allclose(g, lp.detach(), atol=1e-5) for g, lp in zip(got, lparams, strict=True)]


@pytest.mark.spec("OPT-5", "DAG-9")
def test_random_partitions_step_like_the_local_optimizer(world: Any) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from conformance.test_dist_autograd import _plan_examples, plans

    @settings(
        max_examples=max(5, _plan_examples() // 2),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        derandomize=True,
    )
    @given(plan=plans(), name=st.sampled_from(sorted(OPTIMIZERS)))
    def check(plan: dict[str, Any], name: str) -> None:
        got = world.run_on(0, _plan_optim_program, plan, name, world_size=plan["world_size"], timeout=300)
        assert got == [True] * len(plan["owners"]), (name, plan)

    check()
