"""``nn.Parameter`` across an RPC (RPC-9, DAG-4).

PyTorch's RPC pickler sends a Parameter as ``Parameter.__reduce_ex__`` makes it: its detached
``data`` and its ``requires_grad``. So it arrives as an ``nn.Parameter`` (a fresh leaf), as an argument,
a result, an RRef's value or inside a module, and a Python function's Parameter argument or result is
never recorded by distributed autograd; a builtin operator's Parameter argument is, like any tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


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
    """Whether a distributed backward reaches the caller's Parameter through the call."""
    p = _make_parameter(True)
    with ctx.dist_autograd.context() as cid:
        if func == "builtin":
            out = ctx.rpc.rpc_sync("worker1", torch.mul, args=(p, 2))
        elif func == "udf":
            out = ctx.rpc.rpc_sync("worker1", _double, args=(p,))
        else:  # a Parameter returned inside the context, then used here
            out = ctx.rpc.rpc_sync("worker1", _make_parameter, args=(True,)) * p
        received = _describe(out)
        ctx.dist_autograd.backward(cid, [out.sum()])
        grads = ctx.dist_autograd.get_gradients(cid)
        return {"received": received, "caller_grad": grads[p].tolist() if p in grads else None}


@pytest.mark.spec("RPC-9")
@pytest.mark.parametrize("requires_grad", [True, False])
def test_parameter_argument_arrives_as_parameter_with_its_requires_grad(
    world: Any, requires_grad: bool
) -> None:
    expected = {
        "type": "Parameter",
        "requires_grad": requires_grad,
        "is_leaf": True,
        "has_grad_fn": False,
        "values": [0.0, 1.0, 2.0],
    }
    assert world.run_on(0, _prog_arguments, requires_grad) == [expected] * 3


@pytest.mark.spec("RPC-9", "RREF-1")
@pytest.mark.parametrize("requires_grad", [True, False])
def test_parameter_result_arrives_as_parameter(world: Any, requires_grad: bool) -> None:
    expected = {
        "type": "Parameter",
        "requires_grad": requires_grad,
        "is_leaf": True,
        "has_grad_fn": False,
        "values": [0.0, 1.0, 2.0],
    }
    assert world.run_on(0, _prog_results, requires_grad) == [expected] * 3


@pytest.mark.spec("RPC-9", "RREF-1")
def test_rref_of_a_parameter_fetches_a_tensor_and_rref_of_a_module_its_parameters(world: Any) -> None:
    # PyTorch fetches RRef(value) of a value TorchScript can type (a tensor) through TorchScript,
    # which drops the Parameter class; any other value is pickled.
    assert world.run_on(0, _prog_held_in_rref) == [
        {
            "type": "Tensor",
            "requires_grad": True,
            "is_leaf": True,
            "has_grad_fn": False,
            "values": [0.0, 1.0, 2.0],
        },
        [("weight", "Parameter", True), ("bias", "Parameter", False)],
    ]


@pytest.mark.spec("RPC-9")
def test_module_argument_keeps_its_parameters(world: Any) -> None:
    assert world.run_on(0, _prog_module_argument) == [
        ("weight", "Parameter", True),
        ("bias", "Parameter", False),
    ]


@pytest.mark.spec("RPC-9", "DAG-4")
def test_builtin_operator_records_its_parameter_argument(world: Any) -> None:
    out = world.run_on(0, _prog_gradients, "builtin")
    assert out == {
        "received": {
            "type": "Tensor",
            "requires_grad": True,
            "is_leaf": False,
            "has_grad_fn": True,
            "values": [0.0, 2.0, 4.0],
        },
        "caller_grad": [2.0, 2.0, 2.0],
    }


@pytest.mark.spec("RPC-9", "DAG-4")
def test_python_function_does_not_record_its_parameter_argument(world: Any) -> None:
    # The callee's Parameter is a fresh leaf: the reply is recorded, the argument is not, so the
    # caller's Parameter gets no gradient.
    out = world.run_on(0, _prog_gradients, "udf")
    assert out == {
        "received": {
            "type": "Tensor",
            "requires_grad": True,
            "is_leaf": False,
            "has_grad_fn": True,
            "values": [0.0, 2.0, 4.0],
        },
        "caller_grad": None,
    }


@pytest.mark.spec("RPC-9", "DAG-4")
def test_parameter_result_is_not_recorded(world: Any) -> None:
    out = world.run_on(0, _prog_gradients, "result")
    assert out == {
        "received": {
            "type": "Tensor",
            "requires_grad": True,
            "is_leaf": False,
            "has_grad_fn": True,
            "values": [0.0, 1.0, 4.0],
        },
        "caller_grad": [0.0, 1.0, 2.0],
    }
