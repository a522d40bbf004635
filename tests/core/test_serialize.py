"""Unit tests of the RPC pickler (src/twinrpc/_serialize.py), below the conformance suite."""

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


def test_a_storage_is_sent_as_the_tensors_own_bytes_without_a_copy() -> None:
    t = torch.arange(6.0).reshape(2, 3).t()
    _, storages = dumps(t)
    (sent,) = storages
    assert sent.dtype == torch.uint8 and sent.numel() == t.untyped_storage().nbytes()
    assert sent.data_ptr() == t.untyped_storage().data_ptr()


def test_requires_grad_survives_and_the_copy_is_a_leaf() -> None:
    x = torch.ones(3, requires_grad=True)
    out = roundtrip(x * 2)
    assert isinstance(out, torch.Tensor) and out.requires_grad and out.is_leaf


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.bool, torch.bfloat16, torch.complex64])
def test_dtypes_survive(dtype: torch.dtype) -> None:
    t = torch.ones(5, dtype=dtype)
    out = roundtrip(t)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and torch.equal(out, t)


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


_DENSE = torch.arange(16.0).reshape(4, 4) * (torch.arange(16).reshape(4, 4) % 3 == 0)
_SPARSE = {
    "coo": lambda: _DENSE.to_sparse(),
    "coo_hybrid": lambda: _DENSE.to_sparse(sparse_dim=1),
    "coo_uncoalesced": lambda: torch.sparse_coo_tensor(
        [[1, 0, 1], [2, 3, 2]], [1.0, 2.0, 3.0], (4, 4), check_invariants=True
    ),
    "csr_int32": lambda: torch.sparse_csr_tensor(
        torch.tensor([0, 1, 1, 3], dtype=torch.int32),
        torch.tensor([2, 0, 1], dtype=torch.int32),
        [1.0, 2.0, 3.0],
        check_invariants=True,
    ),
    "csr_batched": lambda: torch.stack([_DENSE, _DENSE.t()]).to_sparse_csr(),
    "csc": lambda: _DENSE.to_sparse_csc(),
    "bsr": lambda: _DENSE.to_sparse_bsr((2, 2)),
    "bsc_hybrid": lambda: _DENSE.unsqueeze(-1).to_sparse_bsc((2, 1), dense_dim=1),
}


@pytest.mark.parametrize("kind", sorted(_SPARSE))
@pytest.mark.parametrize("requires_grad", [False, True])
def test_sparse_tensors_keep_layout_parts_and_requires_grad(kind: str, requires_grad: bool) -> None:
    t = _SPARSE[kind]().requires_grad_(requires_grad)
    out = roundtrip(t)
    assert isinstance(out, torch.Tensor)
    assert (out.layout, out.shape, out.dtype) == (t.layout, t.shape, t.dtype)
    assert out.requires_grad is requires_grad and out.is_leaf
    for got, sent in zip(_sparse_parts(out), _sparse_parts(t.detach()), strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    if t.layout == torch.sparse_coo:
        assert out.is_coalesced() is (t._nnz() < 2)  # as PyTorch: coalesced-ness is not kept (RPC-19)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsc])
def test_sparse_tensors_send_their_index_and_value_bytes(layout: torch.layout) -> None:
    """What the simulator charges for (Message.nbytes) and the gloo world frames: each part's
    storage, as flat bytes, a part that views a much larger storage compacted first (RPC-9): the
    plain indices of a converted tensor view a storage twice their size."""
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(256, 256, generator=g) * (torch.rand(256, 256, generator=g) < 0.05)
    t = dense.to_sparse(layout=layout, blocksize=(2, 2) if layout == torch.sparse_bsc else None)
    parts = _sparse_parts(t)
    _, storages = dumps(t)
    assert all(s.dtype == torch.uint8 and s.dim() == 1 for s in storages)
    assert sorted(s.numel() for s in storages) == sorted(p.numel() * p.element_size() for p in parts)


def test_a_sparse_tensor_with_non_contiguous_values_keeps_them() -> None:
    values = torch.arange(12.0).reshape(2, 6)[:, ::2].t()  # (3, 2), a strided view
    t = torch.sparse_coo_tensor([[0, 2, 3]], values, (4, 2), check_invariants=True)
    out = roundtrip(t)
    assert isinstance(out, torch.Tensor) and torch.equal(out.to_dense(), t.to_dense())


def test_a_tensor_of_another_layout_is_refused_with_its_layout_named() -> None:
    with pytest.raises(SerializationError, match=r"cannot send a tensor with layout torch\._mkldnn"):
        dumps([torch.ones(2, 2).to_mkldnn()])


def test_a_non_cpu_sparse_tensor_is_refused_with_its_device_named() -> None:
    with pytest.raises(SerializationError, match="only supports CPU tensors; got a tensor on meta"):
        dumps(
            torch.sparse_coo_tensor(
                torch.zeros(2, 0, dtype=torch.long, device="meta"), torch.zeros(0, device="meta"), (2, 2)
            )
        )


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
