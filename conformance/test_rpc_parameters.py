"""``nn.Parameter`` across an RPC (RPC-9, DAG-4).

PyTorch's RPC pickler sends a Parameter as ``Parameter.__reduce_ex__`` makes it: its detached
``data`` and its ``requires_grad``. So it arrives as an ``nn.Parameter`` (a fresh leaf), as an argument,
a result, an RRef's value or inside a module, and a Python function's Parameter argument or result is
never recorded by distributed autograd; a builtin operator's Parameter argument is, like any tensor.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from conformance._support import rpc_module


def _describe(x: Any) -> dict[str, Any]:
    return {
        "type": type(x).__name__,
        "requires_grad": x.requires_grad,
        "is_leaf": x.is_leaf,
        "has_grad_fn": x.grad_fn is not None,
        "values": x.detach().tolist(),
    }


def _make_parameter(requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.arange(3.0), requires_grad=requires_grad)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _parameter_types(module: torch.nn.Module) -> list[tuple[str, str, bool]]:
    return [(name, type(p).__name__, p.requires_grad) for name, p in module.named_parameters()]


def _prog_arguments(ctx: Any, requires_grad: bool) -> list[Any]:
    p = _make_parameter(requires_grad)
    return [
        ctx.rpc.rpc_sync("worker1", _describe, args=(p,)),
        ctx.rpc.rpc_async("worker1", _describe, args=(p,)).wait(),
        ctx.rpc.remote("worker1", _describe, args=(p,)).to_here(),
    ]


def _prog_results(ctx: Any, requires_grad: bool) -> list[Any]:
    return [
        _describe(ctx.rpc.rpc_sync("worker1", _make_parameter, args=(requires_grad,))),
        _describe(ctx.rpc.rpc_async("worker1", _make_parameter, args=(requires_grad,)).wait()),
        _describe(ctx.rpc.remote("worker1", _make_parameter, args=(requires_grad,)).to_here()),
    ]


def _fetch_held_parameters(rrefs: list[Any]) -> list[Any]:
    out = []
    for rref in rrefs:
        value = rref.to_here()
        out.append(_describe(value) if isinstance(value, torch.Tensor) else _parameter_types(value))
    return out


def _make_module() -> torch.nn.Module:
    module = torch.nn.Linear(2, 1)
    module.bias.requires_grad_(False)
    return module


def _prog_held_in_rref(ctx: Any) -> list[Any]:
    held = [ctx.rpc.RRef(_make_parameter(True)), ctx.rpc.RRef(_make_module())]
    return ctx.rpc.rpc_sync("worker1", _fetch_held_parameters, args=(held,))


def _prog_module_argument(ctx: Any) -> Any:
    return ctx.rpc.rpc_sync("worker1", _parameter_types, args=(_make_module(),))


def _prog_gradients(ctx: Any, func: str) -> dict[str, Any]:
    """What the call returned, and whether a distributed backward reaches the caller's Parameter."""
    p = _make_parameter(True)
    with ctx.dist_autograd.context() as cid:
        if func == "builtin":
            received = out = ctx.rpc.rpc_sync("worker1", torch.mul, args=(p, 2))
        elif func == "udf":
            received = out = ctx.rpc.rpc_sync("worker1", _double, args=(p,))
        else:  # a Parameter returned inside the context, then used here
            received = ctx.rpc.rpc_sync("worker1", _make_parameter, args=(True,))
            out = received * p
        ctx.dist_autograd.backward(cid, [out.sum()])
        grads = ctx.dist_autograd.get_gradients(cid)
        return {"received": _describe(received), "caller_grad": grads[p].tolist() if p in grads else None}


_HELD: dict[str, torch.nn.Parameter] = {}


def _hold_parameter(backend: str) -> Any:
    """On the callee: an ``RRef(value)`` of a Parameter it keeps."""
    _HELD["p"] = p = _make_parameter(True)
    return rpc_module(backend).RRef(p)


def _gradient_of_held(backend: str, context_id: int) -> list[float] | None:
    autograd = importlib.import_module(
        "torch.distributed.autograd" if backend == "torch" else "twinrpc.autograd"
    )
    grads = autograd.get_gradients(context_id)
    return grads[_HELD["p"]].tolist() if _HELD["p"] in grads else None


def _prog_fetch_held_parameter(ctx: Any) -> dict[str, Any]:
    """Fetch another worker's ``RRef(Parameter)`` inside a context: does the backward reach it?"""
    rref = ctx.rpc.rpc_sync("worker1", _hold_parameter, args=(ctx.backend,))
    with ctx.dist_autograd.context() as cid:
        fetched = rref.to_here()
        ctx.dist_autograd.backward(cid, [(fetched * 3).sum()])
        owner_grad = ctx.rpc.rpc_sync("worker1", _gradient_of_held, args=(ctx.backend, cid))
        return {"fetched": _describe(fetched), "owner_grad": owner_grad}


def _described(
    type_name: str, requires_grad: bool, values: list[float], *, leaf: bool = True
) -> dict[str, Any]:
    """What :func:`_describe` says of a tensor (a leaf has no grad_fn, a recorded one has)."""
    return {
        "type": type_name,
        "requires_grad": requires_grad,
        "is_leaf": leaf,
        "has_grad_fn": not leaf,
        "values": values,
    }


@pytest.mark.spec("RPC-9")
@pytest.mark.parametrize("requires_grad", [True, False])
def test_parameter_argument_arrives_as_parameter_with_its_requires_grad(
    world: Any, requires_grad: bool
) -> None:
    expected = _described("Parameter", requires_grad, [0.0, 1.0, 2.0])
    assert world.run_on(0, _prog_arguments, requires_grad) == [expected] * 3


@pytest.mark.spec("RPC-9", "RREF-1")
@pytest.mark.parametrize("requires_grad", [True, False])
def test_parameter_result_arrives_as_parameter(world: Any, requires_grad: bool) -> None:
    expected = _described("Parameter", requires_grad, [0.0, 1.0, 2.0])
    assert world.run_on(0, _prog_results, requires_grad) == [expected] * 3


@pytest.mark.spec("RPC-9", "RREF-1")
def test_rref_of_a_parameter_fetches_a_tensor_and_rref_of_a_module_its_parameters(world: Any) -> None:
    # PyTorch fetches RRef(value) of a value TorchScript can type (a tensor) through TorchScript,
    # which drops the Parameter class; any other value is pickled.
    assert world.run_on(0, _prog_held_in_rref) == [
        _described("Tensor", True, [0.0, 1.0, 2.0]),
        [("weight", "Parameter", True), ("bias", "Parameter", False)],
    ]


@pytest.mark.spec("RPC-9")
def test_module_argument_keeps_its_parameters(world: Any) -> None:
    assert world.run_on(0, _prog_module_argument) == [
        ("weight", "Parameter", True),
        ("bias", "Parameter", False),
    ]


@pytest.mark.spec("RPC-9", "DAG-4")
@pytest.mark.parametrize(
    ("func", "received", "caller_grad"),
    [
        # a builtin operator's Parameter argument is recorded like any tensor
        ("builtin", _described("Tensor", True, [0.0, 2.0, 4.0], leaf=False), [2.0, 2.0, 2.0]),
        # a Python function's is not: the callee's Parameter is a fresh leaf, and only the reply is
        # recorded, so the caller's Parameter gets no gradient
        ("udf", _described("Tensor", True, [0.0, 2.0, 4.0], leaf=False), None),
        # nor is a Parameter result: it arrives as a fresh leaf (the caller's gradient is local)
        ("result", _described("Parameter", True, [0.0, 1.0, 2.0]), [0.0, 1.0, 2.0]),
    ],
)
def test_dist_autograd_records_a_parameter_only_as_a_builtin_operators_argument(
    world: Any, func: str, received: dict[str, Any], caller_grad: list[float] | None
) -> None:
    assert world.run_on(0, _prog_gradients, func) == {"received": received, "caller_grad": caller_grad}


@pytest.mark.spec("RPC-9", "DAG-4")
def test_fetching_an_rref_of_a_parameter_in_a_context_records_it(world: Any) -> None:
    # RRef(value) of a Parameter is fetched as a tensor, recorded like any tensor: the owner's
    # Parameter gets the gradient
    assert world.run_on(0, _prog_fetch_held_parameter) == {
        "fetched": _described("Tensor", True, [0.0, 1.0, 2.0], leaf=False),
        "owner_grad": [3.0, 3.0, 3.0],
    }
