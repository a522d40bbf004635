"""Sparse tensors across RPCs and in distributed autograd (RPC-19, DAG-14).

PyTorch sends a sparse COO tensor everywhere, a CSR tensor only inside a request (an argument, a
gradient), and no other compressed layout; twinrpc sends all five layouts everywhere (DEV-5, DEV-6).
The UDFs describe what they received as plain data, so the test bodies compare it with what was sent;
gradients are compared with local autograd on the same computation (DAG-9).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conformance._support import outcome, rpc_module

_DENSE = [[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [0.0, 5.0, 0.0, 6.0]]
_COMPRESSED = ["csr", "csc", "bsr", "bsc"]


# -- user functions (run on workers) ---------------------------------------------------------------
def _sparse(layout: str, requires_grad: bool = False) -> torch.Tensor:
    """The same 4x4 matrix in ``layout``; ``coo_uncoalesced`` repeats an index (1 + 2 at (0, 1))."""
    dense = torch.tensor(_DENSE)
    if layout == "coo":
        t = dense.to_sparse()
    elif layout == "coo_uncoalesced":
        t = torch.sparse_coo_tensor([[0, 2, 0], [1, 0, 1]], [1.0, 4.0, 2.0], (4, 4), check_invariants=True)
    elif layout == "coo_one_entry":
        t = torch.sparse_coo_tensor([[2], [0]], [4.0], (4, 4), check_invariants=True)
    elif layout == "coo_hybrid":  # one sparse and one dense dimension
        t = dense.to_sparse(sparse_dim=1)
    elif layout in ("csr", "csc"):
        t = dense.to_sparse(layout=getattr(torch, f"sparse_{layout}"))
    else:
        t = dense.to_sparse(layout=getattr(torch, f"sparse_{layout}"), blocksize=(2, 2))
    return t.requires_grad_(requires_grad)


def _describe(t: torch.Tensor) -> dict[str, Any]:
    t_ = t.detach()
    out: dict[str, Any] = {
        "type": type(t).__name__,
        "layout": str(t.layout),
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "requires_grad": t.requires_grad,
        "is_leaf": t.is_leaf,
        "dense": t_.to_dense().tolist(),
    }
    if t.layout == torch.sparse_coo:
        out["parts"] = [t_._indices().tolist(), t_._values().tolist()]
        out["sparse_dim"] = t_.sparse_dim()
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        out["parts"] = [t_.crow_indices().tolist(), t_.col_indices().tolist(), t_.values().tolist()]
    else:
        out["parts"] = [t_.ccol_indices().tolist(), t_.row_indices().tolist(), t_.values().tolist()]
    return out


def _describe_coalesced(t: torch.Tensor) -> dict[str, Any]:
    return {**_describe(t), "coalesced": t.is_coalesced() if t.layout == torch.sparse_coo else None}


def _make_sparse(layout: str, requires_grad: bool) -> torch.Tensor:
    return _sparse(layout, requires_grad)


def _identity(x: Any) -> Any:
    return x


def _make_mkldnn() -> torch.Tensor:
    return torch.ones(2, 2).to_mkldnn()


def _send(ctx: Any, layout: str, requires_grad: bool, how: str) -> dict[str, Any]:
    """``layout`` as an argument, a result, or an RRef value (held by worker1, fetched to worker0)."""
    rpc, peer = ctx.rpc, ctx.name(1)
    if how == "argument":
        return rpc.rpc_sync(peer, _describe_coalesced, args=(_sparse(layout, requires_grad),))  # type: ignore[no-any-return]
    if how == "result":
        got = rpc.rpc_sync(peer, _make_sparse, args=(layout, requires_grad))
    else:  # an argument of remote(), held by the owner, fetched with to_here()
        got = rpc.remote(peer, _identity, args=(_sparse(layout, requires_grad),)).to_here()
    return _describe_coalesced(got)


def _expected(layout: str, requires_grad: bool) -> dict[str, Any]:
    return _describe(_sparse(layout, requires_grad))


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


# -- RPC-19: what survives ---------------------------------------------------------------------------
@pytest.mark.spec("RPC-19", "RPC-9")
@pytest.mark.parametrize("how", ["argument", "result", "rref_value"])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout", ["coo", "coo_uncoalesced", "coo_hybrid"])
def test_coo_tensor_keeps_layout_indices_values_and_requires_grad(
    world: Any, layout: str, requires_grad: bool, how: str
) -> None:
    got = world.run_on(0, _send, layout, requires_grad, how)
    assert _without(got, "coalesced") == _expected(layout, requires_grad)
    assert got["coalesced"] is False  # two entries or more: never marked coalesced on arrival


@pytest.mark.spec("RPC-19")
@pytest.mark.parametrize("how", ["argument", "result", "rref_value"])
def test_coo_tensor_with_fewer_than_two_entries_arrives_coalesced(world: Any, how: str) -> None:
    got = world.run_on(0, _send, "coo_one_entry", False, how)
    assert _without(got, "coalesced") == _expected("coo_one_entry", False)
    assert got["coalesced"] is True


@pytest.mark.spec("RPC-19", "RPC-9")
@pytest.mark.parametrize("requires_grad", [False, True])
def test_csr_argument_keeps_layout_indices_values_and_requires_grad(world: Any, requires_grad: bool) -> None:
    got = world.run_on(0, _send, "csr", requires_grad, "argument")
    assert _without(got, "coalesced") == _expected("csr", requires_grad)


@pytest.mark.spec("RPC-19")
@pytest.mark.parametrize("layout", ["csc", "bsr", "bsc"])
def test_csc_bsr_and_bsc_arguments_keep_their_layout(world: Any, layout: str) -> None:
    """PyTorch aborts the calling process (DEV-5)."""
    got = world.run_on(0, _send, layout, True, "argument")
    assert _without(got, "coalesced") == _expected(layout, True)


@pytest.mark.spec("RPC-19")
@pytest.mark.parametrize("how", ["result", "rref_value"])
@pytest.mark.parametrize("layout", _COMPRESSED)
def test_compressed_sparse_results_and_rref_values_keep_their_layout(
    world: Any, layout: str, how: str
) -> None:
    """PyTorch's callee fails to send the reply (DEV-6)."""
    got = world.run_on(0, _send, layout, True, how)
    assert _without(got, "coalesced") == _expected(layout, True)


def _large(layout: str) -> torch.Tensor:
    """About 4 MiB of indices and values: more than one frame's worth in the gloo world."""
    g = torch.Generator().manual_seed(3)
    dense = torch.rand(1500, 1500, generator=g, dtype=torch.float64)
    dense = dense * (torch.rand(1500, 1500, generator=g) < 0.1)
    return dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()


def _fingerprint(t: torch.Tensor) -> list[Any]:
    dense = t.detach().to_dense()
    weights = torch.arange(dense.numel(), dtype=torch.float64).reshape(dense.shape)
    return [str(t.layout), list(t.shape), t._nnz(), float((dense * weights).sum()), float(dense.abs().max())]


def _large_argument(ctx: Any, layout: str) -> list[Any]:
    return ctx.rpc.rpc_sync(ctx.name(1), _fingerprint, args=(_large(layout),))  # type: ignore[no-any-return]


def _large_result(ctx: Any) -> list[Any]:
    return _fingerprint(ctx.rpc.rpc_sync(ctx.name(1), _large, args=("coo",)))


@pytest.mark.spec("RPC-19")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_large_sparse_argument_arrives_intact(world: Any, layout: str) -> None:
    assert world.run_on(0, _large_argument, layout) == _fingerprint(_large(layout))


@pytest.mark.spec("RPC-19")
def test_a_large_coo_result_arrives_intact(world: Any) -> None:
    assert world.run_on(0, _large_result) == _fingerprint(_large("coo"))


def _unsupported_result(ctx: Any) -> Any:
    return outcome(lambda: ctx.rpc.rpc_sync(ctx.name(1), _make_mkldnn))[0]


@pytest.mark.spec("RPC-19")
def test_a_result_of_a_layout_that_cannot_travel_raises_runtime_error(world: Any) -> None:
    assert "RuntimeError" in world.run_on(0, _unsupported_result)


def _unsupported_argument(ctx: Any) -> list[Any]:
    rpc = ctx.rpc
    kinds, message = outcome(
        lambda: rpc.rpc_sync(ctx.name(1), _identity, args=(torch.ones(2, 2).to_mkldnn(),))
    )
    return [kinds, "torch._mkldnn" in message, rpc.rpc_sync(ctx.name(1), _identity, args=(1,))]


@pytest.mark.spec("RPC-19", "ERR-9")
def test_an_argument_of_a_layout_that_cannot_travel_raises_naming_it(world: Any) -> None:
    """PyTorch aborts the calling process (DEV-8)."""
    kinds, named, after = world.run_on(0, _unsupported_argument)
    assert "RuntimeError" in kinds and named and after == 1


# -- DAG-14: sparse tensors in distributed autograd ----------------------------------------------------
def _loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.sparse.mm(x, w) if x.layout == torch.sparse_coo else x.to_dense() @ w
    return (y * y).sum()


def _grad_record(g: torch.Tensor | None) -> Any:
    if g is None:
        return None
    return [str(g.layout), list(g.shape), g.to_dense().tolist()]


def _sparse_argument_backward(ctx: Any, layout: str, passes: int) -> dict[str, Any]:
    da = ctx.dist_autograd
    x = _sparse(layout, True)
    w = torch.arange(8.0).reshape(4, 2).requires_grad_()
    with da.context() as cid:
        loss = ctx.rpc.rpc_sync(ctx.name(1), _loss, args=(x, w))
        for i in range(passes):
            da.backward(cid, [loss], retain_graph=i < passes - 1)
        grads = da.get_gradients(cid)
        got = [_grad_record(grads.get(x)), _grad_record(grads.get(w)), len(grads)]
    lx, lw = _sparse(layout, True), w.detach().clone().requires_grad_()
    for _ in range(passes):
        _loss(lx, lw).backward()
    return {"got": got, "local": [_grad_record(lx.grad), _grad_record(lw.grad), 2], "grad": x.grad}


@pytest.mark.spec("DAG-14", "DAG-4", "DAG-9")
@pytest.mark.parametrize("layout", ["coo", "coo_uncoalesced", "csr"])
def test_sparse_argument_gets_the_gradient_local_autograd_gives(world: Any, layout: str) -> None:
    out = world.run_on(0, _sparse_argument_backward, layout, 1)
    assert out["got"] == out["local"]
    assert out["got"][0][0] == f"torch.sparse_{layout[:3]}"  # a sparse leaf gets a sparse gradient
    assert out["grad"] is None  # never written to .grad (DAG-8)


@pytest.mark.spec("DAG-14", "DAG-8")
def test_sparse_gradients_of_two_passes_accumulate_in_the_context(world: Any) -> None:
    out = world.run_on(0, _sparse_argument_backward, "coo", 2)
    assert out["got"] == out["local"]


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _sparse_result_backward(ctx: Any) -> dict[str, Any]:
    da = ctx.dist_autograd
    x = _sparse("coo", True)
    with da.context() as cid:
        y = ctx.rpc.rpc_sync(ctx.name(1), _double, args=(x,))
        linked = [str(y.layout), y.requires_grad, y.grad_fn is not None]
        da.backward(cid, [torch.sparse.sum(y * y)])
        got = _grad_record(da.get_gradients(cid)[x])
    lx = _sparse("coo", True)
    torch.sparse.sum(_double(lx) * _double(lx)).backward()
    return {"linked": linked, "got": got, "local": _grad_record(lx.grad)}


@pytest.mark.spec("DAG-14", "DAG-4", "DAG-9")
def test_sparse_result_is_linked_and_its_sparse_gradient_flows_back(world: Any) -> None:
    out = world.run_on(0, _sparse_result_backward)
    assert out["linked"] == ["torch.sparse_coo", True, True]
    assert out["got"] == out["local"]


def _only_second(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w * 2).sum()


def _unused_sparse_argument(ctx: Any, layout: str) -> Any:
    da = ctx.dist_autograd
    x = _sparse(layout, True)
    w = torch.ones(2, requires_grad=True)
    with da.context() as cid:
        da.backward(cid, [ctx.rpc.rpc_sync(ctx.name(1), _only_second, args=(x, w))])
        grads = da.get_gradients(cid)
        gx = grads[x]
        dims = [gx.sparse_dim(), gx.dense_dim()]
        return [str(gx.layout), list(gx.shape), gx._nnz(), dims, str(gx.dtype), grads[w].tolist()]


@pytest.mark.spec("DAG-14", "DAG-6")
@pytest.mark.parametrize("layout", ["coo", "coo_hybrid", "csr"])
def test_sparse_argument_the_loss_does_not_use_gets_a_sparse_zero_gradient(world: Any, layout: str) -> None:
    """Every dimension of the zero gradient is sparse, also for a hybrid COO tensor (as PyTorch's
    recv function sends ``zeros`` of the tensor's layout)."""
    expected = [f"torch.sparse_{layout[:3]}", [4, 4], 0, [2, 0], "torch.float32", [2.0, 2.0]]
    assert world.run_on(0, _unused_sparse_argument, layout) == expected


# -- DAG-14: an embedding with sparse gradients on a parameter server --------------------------------
def _embedding() -> torch.nn.Embedding:
    torch.manual_seed(0)
    return torch.nn.Embedding(10, 3, sparse=True)


def _lookup(table: Any, indices: torch.Tensor) -> torch.Tensor:
    return table.local_value()(indices)  # type: ignore[no-any-return]


def _weight_rrefs(backend: str, table: Any) -> list[Any]:
    return [rpc_module(backend).RRef(table.local_value().weight)]


def _weight_grad(backend: str, context_id: int, table: Any) -> Any:
    if backend == "torch":
        import torch.distributed.autograd as dist_autograd
    else:
        import twinrpc.autograd as dist_autograd
    weight = table.local_value().weight
    return [_grad_record(dist_autograd.get_gradients(context_id).get(weight)), weight.grad is None]


def _weight(table: Any) -> list[Any]:
    return table.local_value().weight.detach().tolist()  # type: ignore[no-any-return]


def _parameter_server(ctx: Any) -> dict[str, Any]:
    rpc, da, ps = ctx.rpc, ctx.dist_autograd, ctx.name(1)
    table = rpc.remote(ps, _embedding)
    indices = torch.tensor([1, 2, 1, 5])
    scale = torch.arange(12.0).reshape(4, 3)
    opt = ctx.optim.DistributedOptimizer(
        torch.optim.SGD, rpc.rpc_sync(ps, _weight_rrefs, args=(ctx.backend, table)), lr=0.5
    )
    with da.context() as cid:
        out = rpc.rpc_sync(ps, _lookup, args=(table, indices))
        da.backward(cid, [(out * scale).sum()])
        grad = rpc.rpc_sync(ps, _weight_grad, args=(ctx.backend, cid, table))
        opt.step(cid)
    weight = rpc.rpc_sync(ps, _weight, args=(table,))
    local = _embedding()
    (local(indices) * scale).sum().backward()
    torch.optim.SGD(local.parameters(), lr=0.5).step()
    assert local.weight.grad is not None
    return {
        "grad": grad,
        "weight": weight,
        "local_grad": [_grad_record(local.weight.grad), True],
        "local_weight": local.weight.detach().tolist(),
    }


@pytest.mark.spec("DAG-14", "DAG-9", "OPT-5")
def test_sparse_embedding_on_a_parameter_server_gets_the_local_gradient_and_step(world: Any) -> None:
    out = world.run_on(0, _parameter_server)
    assert out["grad"][0][0] == "torch.sparse_coo"
    assert out["grad"] == out["local_grad"]
    assert out["weight"] == out["local_weight"]


def _square_sum(x: torch.Tensor) -> torch.Tensor:
    return torch.sparse.sum(x * x)


def _dense_use(z: torch.Tensor) -> torch.Tensor:
    return ((torch.ones(4, 4) + z) ** 2).sum()  # a dense gradient for the sparse z


def _used_here_and_remotely(ctx: Any, via: str, dense_at: str) -> dict[str, Any]:
    """A sparse non-leaf used locally and sent away: its node waits for gradients from the root and
    from a send function (per-node mode) and adds them, a dense one to a sparse one where ``dense_at``
    says; the remote part returns as an RPC result or through an RRef's to_here (DAG-12)."""
    da = ctx.dist_autograd
    use_here = _dense_use if dense_at == "here" else _square_sum
    use_there = _dense_use if dense_at == "there" else _square_sum
    x = _sparse("coo", True)
    with da.context() as cid:
        z = x * 3
        if via == "rpc":
            remote = ctx.rpc.rpc_sync(ctx.name(1), use_there, args=(z,))
        else:
            remote = use_there(ctx.rpc.remote(ctx.name(1), _double, args=(z,)).to_here())
        da.backward(cid, [remote + use_here(z)])
        got = _grad_record(da.get_gradients(cid)[x])
    lx = _sparse("coo", True)
    lz = lx * 3
    (use_there(lz if via == "rpc" else _double(lz)) + use_here(lz)).backward()
    return {"got": got, "local": _grad_record(lx.grad)}


@pytest.mark.spec("DAG-14", "DAG-9", "DAG-12")
@pytest.mark.parametrize("dense_at", ["nowhere", "here", "there"])
@pytest.mark.parametrize("via", ["rpc", "rref"])
def test_sparse_value_used_locally_and_remotely_gets_the_local_gradient(
    world: Any, via: str, dense_at: str
) -> None:
    out = world.run_on(0, _used_here_and_remotely, via, dense_at)
    assert out["got"] == out["local"]
