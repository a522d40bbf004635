"""Unit tests of the RPC pickler (DESIGN.md §2), below the conformance suite."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from twinrpc._errors import RPCError, SerializationError
from twinrpc._future import Future
from twinrpc._serialize import copy_storages, dumps, loads


def roundtrip(obj: object) -> object:
    payload, storages = dumps(obj)
    value, _ = loads(payload, copy_storages(storages))
    return value


def test_views_keep_shape_stride_offset_and_share_storage_within_one_message() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    a, b = base[1:, ::2], base.t()
    out_a, out_b = roundtrip((a, b))  # type: ignore[misc]
    assert torch.equal(out_a, a) and torch.equal(out_b, b)
    assert out_a.stride() == a.stride() and out_a.storage_offset() == a.storage_offset()
    assert out_a.untyped_storage().data_ptr() == out_b.untyped_storage().data_ptr()
    assert out_a.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_one_storage_travels_once_however_many_views_use_it() -> None:
    base = torch.zeros(100)
    _, storages = dumps([base[:10], base[10:20], base])
    assert len(storages) == 1


def test_small_view_of_a_big_storage_is_compacted_before_sending() -> None:
    big = torch.zeros(10_000)  # 40 KB storage
    _, storages = dumps(big[:10])
    assert storages[0].numel() == 40
    _, storages = dumps(torch.zeros(100)[:10])  # 400 B storage: below the 8 KiB floor, sent whole
    assert storages[0].numel() == 400


def test_requires_grad_survives_and_the_copy_is_a_leaf() -> None:
    x = torch.ones(3, requires_grad=True)
    out = roundtrip(x * 2)
    assert isinstance(out, torch.Tensor) and out.requires_grad and out.is_leaf


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.bool, torch.bfloat16, torch.complex64])
def test_dtypes_survive(dtype: torch.dtype) -> None:
    t = torch.ones(5, dtype=dtype)
    out = roundtrip(t)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and torch.equal(out, t)


def test_sparse_tensors_travel_through_their_dense_parts() -> None:
    s = torch.eye(3).to_sparse()
    out = roundtrip(s)
    assert isinstance(out, torch.Tensor) and out.is_sparse and torch.equal(out.to_dense(), torch.eye(3))


def test_a_non_cpu_tensor_is_refused_with_its_device_named() -> None:
    with pytest.raises(SerializationError, match="only supports CPU tensors; got a tensor on meta"):
        dumps(torch.empty(2, device="meta"))


def test_a_future_cannot_travel() -> None:
    for fut in (Future(), torch.futures.Future()):
        with pytest.raises(RuntimeError, match=r"Can not pickle torch\.futures\.Future"):
            dumps([fut])


def test_pickler_errors_keep_their_own_type_and_are_rpc_errors() -> None:
    with pytest.raises(TypeError, match=r"_thread\.lock") as info:
        dumps(threading.Lock())
    assert isinstance(info.value, RPCError) and isinstance(info.value, pickle.PicklingError)

    def local() -> None: ...

    with pytest.raises(AttributeError, match="importable module-level") as info2:
        dumps(local)
    assert isinstance(info2.value, SerializationError)


def test_tensor_records_cannot_be_unpickled_outside_a_message() -> None:
    payload, _ = dumps(torch.ones(1))
    with pytest.raises(SerializationError, match="outside an RPC message"):
        pickle.loads(payload)
