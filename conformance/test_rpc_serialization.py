"""What survives an RPC (tensor metadata, shared storage, containers) and what cannot be sent at all.

The UDFs here describe the tensors they received (shape, dtype, stride, storage offset, storage size) as
plain data, so the test bodies compare what the callee saw with what the caller sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

# ---------------------------------------------------------------- UDFs


def _meta(t: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "stride": list(t.stride()),
        "storage_offset": t.storage_offset(),
        "storage_nbytes": t.untyped_storage().nbytes(),
        "requires_grad": t.requires_grad,
        "is_leaf": t.is_leaf,
        "grad_fn": None if t.grad_fn is None else type(t.grad_fn).__name__,
        "values": t.detach().float().tolist(),
    }


def _meta_many(*tensors: torch.Tensor) -> list[dict[str, Any]]:
    return [_meta(t) for t in tensors]


def _share_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _write_through_first(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Writing through ``a`` is visible in ``b`` only if the callee kept them on one storage."""
    a.fill_(-1)
    return b.tolist()


def _identity(x: Any) -> Any:
    return x


def _make_views() -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.arange(10000.0)
    return base[10:20], torch.arange(6.0).reshape(2, 3).t()


def _return_lock() -> Any:
    return threading.Lock()


def _return_future() -> Any:
    return torch.futures.Future()


def _return_then_future() -> Any:
    return torch.futures.Future().then(lambda f: f.wait())  # a torch._C.Future


def _add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@dataclass
class Batch:
    name: str
    features: torch.Tensor
    labels: list[torch.Tensor]


def _sum_nested(obj: dict[str, Any]) -> dict[str, Any]:
    batch = obj["batch"]
    return {
        "list_sum": sum(t.sum().item() for t in obj["list"]),
        "tuple_types": [type(x).__name__ for x in obj["tuple"]],
        "batch_type": type(batch).__name__,
        "batch_name": batch.name,
        "features": batch.features.tolist(),
        "labels": [t.tolist() for t in batch.labels],
        "nested": obj["deep"]["a"][0]["b"].tolist(),
    }


# ---------------------------------------------------------------- programs


def _prog_send_meta(ctx: Any, to: str, tensor: torch.Tensor) -> dict[str, Any]:
    return ctx.rpc.rpc_sync(to, _meta, args=(tensor,))


def _prog_dtypes(ctx: Any) -> list[dict[str, Any]]:
    tensors = [
        torch.tensor([[1.5, -2.25], [3.0, 4.0]], dtype=torch.float64),
        torch.tensor([-128, 0, 127], dtype=torch.int8),
        torch.tensor([True, False, True]),
        torch.tensor([1.0, 0.5, -3.0], dtype=torch.bfloat16),
    ]
    return ctx.rpc.rpc_sync("worker1", _meta_many, args=tuple(tensors))


def _prog_small_view(ctx: Any) -> dict[str, Any]:
    base = torch.arange(100.0)
    return ctx.rpc.rpc_sync("worker1", _meta, args=(base[10:20],))


def _prog_strided(ctx: Any) -> list[dict[str, Any]]:
    t = torch.arange(12.0).reshape(3, 4)
    return ctx.rpc.rpc_sync("worker1", _meta_many, args=(t.t(), t[:, ::2], t[1:, 1:3]))


def _prog_shared_views(ctx: Any, n: int) -> tuple[bool, list[float]]:
    base = torch.arange(float(n))
    a, b = base[:5], base[2:7]
    shared = ctx.rpc.rpc_sync("worker1", _share_storage, args=(a, b))
    seen = ctx.rpc.rpc_sync("worker1", _write_through_first, args=(a, b))
    return shared, seen


def _prog_same_tensor_twice(ctx: Any) -> bool:
    t = torch.ones(3)
    return ctx.rpc.rpc_sync("worker1", _share_storage, args=(t, t))


def _prog_big_storage_view(ctx: Any, numel: int, start: int, stop: int) -> dict[str, Any]:
    base = torch.zeros(numel)
    return ctx.rpc.rpc_sync("worker1", _meta, args=(base[start:stop],))


def _prog_requires_grad(ctx: Any) -> list[dict[str, Any]]:
    leaf = torch.ones(2, requires_grad=True)
    non_leaf = leaf * 2
    plain = torch.ones(2)
    return ctx.rpc.rpc_sync("worker1", _meta_many, args=(leaf, non_leaf, plain))


def _prog_result_views(ctx: Any) -> list[dict[str, Any]]:
    big_view, transposed = ctx.rpc.rpc_sync("worker1", _make_views)
    return [_meta(big_view), _meta(transposed)]


def _prog_nested_containers(ctx: Any) -> tuple[dict[str, Any], Any]:
    payload = {
        "list": [torch.ones(2), torch.full((3,), 2.0)],
        "tuple": (torch.zeros(1), 3, "s"),
        "batch": Batch("b0", torch.eye(2), [torch.tensor([1]), torch.tensor([0])]),
        "deep": {"a": [{"b": torch.tensor([7.0, 8.0])}]},
    }
    summary = ctx.rpc.rpc_sync("worker1", _sum_nested, args=(payload,))
    echoed = ctx.rpc.rpc_sync("worker1", _identity, args=(payload,))
    return summary, (
        type(echoed["batch"]).__name__,
        echoed["batch"].features.tolist(),
        isinstance(echoed["tuple"], tuple),
        echoed["deep"]["a"][0]["b"].tolist(),
    )


def _after_error_still_works(ctx: Any) -> list[list[float]]:
    return [
        ctx.rpc.rpc_sync("worker1", _add_one, args=(torch.zeros(2),)).tolist(),
        ctx.rpc.rpc_async("worker1", _add_one, args=(torch.ones(2),)).wait().tolist(),
    ]


def _attempt(ctx: Any, api: str, to: str, func: Any, args: tuple[Any, ...]) -> tuple[list[str], str]:
    """``(names of the error's classes (its MRO), message)``: tests check ``except <torch's type>`` would catch it."""
    try:
        if api == "rpc_sync":
            ctx.rpc.rpc_sync(to, func, args=args)
        elif api == "rpc_async":
            ctx.rpc.rpc_async(to, func, args=args).wait()
        else:
            ctx.rpc.remote(to, func, args=args).to_here()
    except Exception as e:
        return [c.__name__ for c in type(e).__mro__], str(e)
    return ["no error"], ""


def _prog_future_argument(ctx: Any, api: str) -> tuple[list[str], str]:
    return _attempt(ctx, api, "worker1", _identity, (ctx.futures.Future(),))


def _prog_lambda_func(ctx: Any, api: str) -> tuple[tuple[list[str], str], list[list[float]]]:
    outcome = _attempt(ctx, api, "worker1", lambda x: x, (1,))
    return outcome, _after_error_still_works(ctx)


def _prog_lock_argument(ctx: Any, api: str, to: str) -> tuple[tuple[list[str], str], list[list[float]]]:
    outcome = _attempt(ctx, api, to, _identity, ({"lock": threading.Lock()},))
    return outcome, _after_error_still_works(ctx)


def _prog_unpicklable_result(
    ctx: Any, api: str, func_name: str
) -> tuple[tuple[list[str], str], list[list[float]]]:
    outcome = _attempt(ctx, api, "worker1", globals()[func_name], ())
    return outcome, _after_error_still_works(ctx)


# ---------------------------------------------------------------- tests


@pytest.mark.spec("RPC-9")
def test_dtype_shape_and_values_survive_transfer(world: Any) -> None:
    got = world.run_on(0, _prog_dtypes)
    assert [(m["dtype"], m["shape"], m["values"]) for m in got] == [
        ("torch.float64", [2, 2], [[1.5, -2.25], [3.0, 4.0]]),
        ("torch.int8", [3], [-128.0, 0.0, 127.0]),
        ("torch.bool", [3], [1.0, 0.0, 1.0]),
        ("torch.bfloat16", [3], [1.0, 0.5, -3.0]),
    ]


@pytest.mark.spec("RPC-9")
def test_view_of_small_storage_keeps_storage_offset_and_whole_storage(world: Any) -> None:
    got = world.run_on(0, _prog_small_view)
    assert (got["shape"], got["stride"], got["storage_offset"], got["storage_nbytes"]) == ([10], [1], 10, 400)
    assert got["values"] == [float(i) for i in range(10, 20)]


@pytest.mark.spec("RPC-9")
def test_non_contiguous_tensors_keep_strides_and_values(world: Any) -> None:
    transposed, every_other, block = world.run_on(0, _prog_strided)
    assert (transposed["shape"], transposed["stride"]) == ([4, 3], [1, 4])
    assert transposed["values"] == torch.arange(12.0).reshape(3, 4).t().tolist()
    assert (every_other["shape"], every_other["stride"]) == ([3, 2], [4, 2])
    assert every_other["values"] == [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]]
    assert (block["shape"], block["stride"], block["storage_offset"]) == ([2, 2], [4, 1], 5)
    assert block["values"] == [[5.0, 6.0], [9.0, 10.0]]


@pytest.mark.spec("RPC-9")
def test_views_of_one_storage_in_one_message_share_storage_on_callee(world: Any) -> None:
    shared, seen = world.run_on(0, _prog_shared_views, 10)
    assert shared is True
    # b = base[2:7]; the callee filled a = base[:5] with -1, which covers b's first three elements.
    assert seen == [-1.0, -1.0, -1.0, 5.0, 6.0]


@pytest.mark.spec("RPC-9")
def test_same_tensor_passed_twice_arrives_as_one_storage(world: Any) -> None:
    assert world.run_on(0, _prog_same_tensor_twice) is True


@pytest.mark.spec("RPC-9")
@pytest.mark.parametrize(
    ("numel", "start", "stop", "storage_nbytes", "storage_offset"),
    [
        pytest.param(10000, 10, 20, 40, 0, id="40B-view-of-40000B-storage-compacted"),
        pytest.param(4096, 0, 2000, 8000, 0, id="8000B-view-of-16KiB-storage-compacted"),
        pytest.param(4096, 0, 2100, 16384, 0, id="8400B-view-of-16KiB-storage-sent-whole"),
        pytest.param(1000, 10, 20, 4000, 10, id="view-of-4000B-storage-sent-whole"),
    ],
)
def test_view_of_large_storage_is_compacted_only_past_size_threshold(
    world: Any, numel: int, start: int, stop: int, storage_nbytes: int, storage_offset: int
) -> None:
    """The whole storage is sent unless it is >= 8 KiB and >= 2x the view's bytes (then it is cloned)."""
    got = world.run_on(0, _prog_big_storage_view, numel, start, stop)
    assert (got["storage_nbytes"], got["storage_offset"], got["shape"]) == (
        storage_nbytes,
        storage_offset,
        [stop - start],
    )


@pytest.mark.spec("RPC-9")
def test_compacted_views_of_one_large_storage_no_longer_share_storage(world: Any) -> None:
    shared, seen = world.run_on(0, _prog_shared_views, 10000)
    assert shared is False
    assert seen == [2.0, 3.0, 4.0, 5.0, 6.0]


@pytest.mark.spec("RPC-9")
def test_requires_grad_survives_and_received_tensors_are_leaves(world: Any) -> None:
    leaf, non_leaf, plain = world.run_on(0, _prog_requires_grad)
    assert (leaf["requires_grad"], leaf["is_leaf"], leaf["grad_fn"]) == (True, True, None)
    assert (non_leaf["requires_grad"], non_leaf["is_leaf"], non_leaf["grad_fn"]) == (True, True, None)
    assert non_leaf["values"] == [2.0, 2.0]
    assert (plain["requires_grad"], plain["is_leaf"]) == (False, True)


@pytest.mark.spec("RPC-9")
def test_returned_tensors_keep_strides_and_large_storage_views_are_compacted(world: Any) -> None:
    big_view, transposed = world.run_on(0, _prog_result_views)
    assert (big_view["storage_nbytes"], big_view["storage_offset"], big_view["values"]) == (
        40,
        0,
        [float(i) for i in range(10, 20)],
    )
    assert (transposed["shape"], transposed["stride"], transposed["storage_nbytes"]) == ([3, 2], [1, 3], 24)


@pytest.mark.spec("RPC-8", "RPC-9")
def test_tensors_nested_in_dicts_lists_tuples_and_dataclasses_survive(world: Any) -> None:
    summary, echoed = world.run_on(0, _prog_nested_containers)
    assert summary == {
        "list_sum": 8.0,
        "tuple_types": ["Tensor", "int", "str"],
        "batch_type": "Batch",
        "batch_name": "b0",
        "features": [[1.0, 0.0], [0.0, 1.0]],
        "labels": [[1], [0]],
        "nested": [7.0, 8.0],
    }
    assert echoed == ("Batch", [[1.0, 0.0], [0.0, 1.0]], True, [7.0, 8.0])


@pytest.mark.spec("RPC-8", "ERR-9")
@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
def test_future_argument_raises_cannot_pickle_future(world: Any, api: str) -> None:
    kinds, msg = world.run_on(0, _prog_future_argument, api)
    assert "RuntimeError" in kinds, kinds
    assert "Can not pickle torch.futures.Future" in msg


@pytest.mark.spec("RPC-8", "ERR-9")
@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async"])
@pytest.mark.parametrize("udf", ["_return_future", "_return_then_future"])
def test_returning_future_from_plain_udf_raises_cannot_pickle_future(world: Any, api: str, udf: str) -> None:
    (kinds, msg), after = world.run_on(0, _prog_unpicklable_result, api, udf)
    assert "RuntimeError" in kinds, kinds
    assert "Can not pickle torch.futures.Future" in msg
    assert after == [[1.0, 1.0], [2.0, 2.0]]


@pytest.mark.spec("RPC-8", "ERR-9")
@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
def test_lambda_func_fails_to_pickle_and_workers_stay_usable(world: Any, api: str) -> None:
    """A lambda defined in a function is a local object: pickle refuses it on the caller.

    Python 3.11 reports a local object with AttributeError ("Can't pickle local object"), newer Pythons
    with pickle.PicklingError; both name the lambda.
    """
    (kinds, msg), after = world.run_on(0, _prog_lambda_func, api)
    assert {"AttributeError", "PicklingError"} & set(kinds), kinds
    assert "<lambda>" in msg and "pickle" in msg.lower()
    assert after == [[1.0, 1.0], [2.0, 2.0]]


@pytest.mark.spec("RPC-8", "ERR-9")
@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
@pytest.mark.parametrize("to", ["worker0", "worker1"])
def test_unpicklable_argument_raises_type_error_and_workers_stay_usable(
    world: Any, api: str, to: str
) -> None:
    (kinds, msg), after = world.run_on(0, _prog_lock_argument, api, to)
    assert "TypeError" in kinds, kinds
    assert "cannot pickle '_thread.lock' object" in msg
    assert after == [[1.0, 1.0], [2.0, 2.0]]


@pytest.mark.spec("RPC-8", "ERR-9")
@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
def test_unpicklable_result_gives_caller_runtime_error_and_workers_stay_usable(world: Any, api: str) -> None:
    (kinds, msg), after = world.run_on(0, _prog_unpicklable_result, api, "_return_lock")
    assert "RuntimeError" in kinds, kinds
    assert "cannot pickle '_thread.lock' object" in msg
    assert after == [[1.0, 1.0], [2.0, 2.0]]
