"""Sparse gradients over any number of RPC hops, through nested RRefs and accumulated over passes (DAG-14).

A tensor that arrives in an RPC and is passed on to another worker is linked again (DAG-4), whatever
its layout; the gradients that come back are local autograd's (DAG-9), and several passes in one
context add up (DAG-8). These are the sparse variants of PyTorch's dist_autograd_test.py
(test_backward_multiple_round_trips_sparse, test_nested_backward_accumulate_grads_sparse,
test_multiple_backward_sparse, test_backward_rref_nested_sparse, test_backward_different_dtypes_sparse),
with the number of hops, the layout and the number of passes drawn by hypothesis.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conformance._support import rpc_module


def _tensor(sparse: bool, requires_grad: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PyTorch's ``build_sparse_tensor`` (3x3, three entries), or the same matrix dense."""
    t = torch.sparse_coo_tensor(
        [[0, 1, 1], [2, 0, 2]], [3.2, 4.1, 5.3], (3, 3), dtype=dtype, check_invariants=True
    )
    if not sparse:
        t = t.to_dense()
    return t.requires_grad_(requires_grad)


def _total(t: torch.Tensor) -> torch.Tensor:
    return torch.sparse.sum(t) if t.layout == torch.sparse_coo else t.sum()


def _combine(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    return torch.mul(torch.add(t1, t2), t2)


def _pass_on(backend: str, t1: torch.Tensor, t2: torch.Tensor, me: int, world_size: int, hops: int) -> Any:
    """Hand both tensors on to the next worker ``hops`` more times, then combine them there."""
    rpc = rpc_module(backend)
    nxt = f"worker{(me + 1) % world_size}"
    if hops > 0:
        return rpc.rpc_sync(
            nxt, _pass_on, args=(backend, t1, t2, (me + 1) % world_size, world_size, hops - 1)
        )
    return rpc.rpc_sync(nxt, _combine, args=(t1, t2))


def _record(g: torch.Tensor | None) -> Any:
    return None if g is None else [str(g.layout), str(g.dtype), g.to_dense().tolist()]


def _hops_program(
    ctx: Any, hops: int, sparse: bool, t2_requires_grad: bool, passes: int, how: str
) -> dict[str, Any]:
    """``_combine(t1, t2)`` computed ``hops + 1`` workers away, its result squared back here; ``passes``
    backward passes in one context. Local autograd on the same computation is the reference."""
    rpc, da = ctx.rpc, ctx.dist_autograd
    t1, t2 = _tensor(sparse, True), _tensor(sparse, t2_requires_grad)
    args = (ctx.backend, t1, t2, 1, ctx.world_size, hops)
    with da.context() as cid:
        if how == "rpc":
            ret = rpc.rpc_sync(ctx.name(1), _pass_on, args=args)
        else:
            ret = rpc.remote(ctx.name(1), _pass_on, args=args).to_here()
        loss = _total(torch.mul(ret, ret))
        for i in range(passes):
            da.backward(cid, [loss], retain_graph=i < passes - 1)
        grads = da.get_gradients(cid)
        got = [_record(grads.get(t1)), _record(grads.get(t2))]
    l1, l2 = _tensor(sparse, True), _tensor(sparse, t2_requires_grad)
    local = _combine(l1, l2)
    for i in range(passes):
        _total(torch.mul(local, local)).backward(retain_graph=i < passes - 1)
    return {"got": got, "local": [_record(l1.grad), _record(l2.grad)]}


def _assert_close(got: list[Any], local: list[Any]) -> None:
    for g, want in zip(got, local, strict=True):
        if want is None:
            assert g is None
            continue
        assert g[:2] == want[:2]  # layout and dtype
        assert torch.allclose(torch.tensor(g[2]), torch.tensor(want[2]), rtol=1e-5), (g, want)


@pytest.mark.spec("DAG-14", "DAG-4", "DAG-9")
@pytest.mark.parametrize("how", ["rpc", "remote"])
@pytest.mark.parametrize("hops", [0, 2])
def test_sparse_gradients_flow_back_through_tensors_passed_on_over_several_hops(
    world: Any, hops: int, how: str
) -> None:
    out = world.run_on(0, _hops_program, hops, True, False, 1, how, world_size=3)
    _assert_close(out["got"], out["local"])
    assert out["got"][0][0] == "torch.sparse_coo"  # a sparse leaf's gradient stays sparse


@pytest.mark.spec("DAG-14", "DAG-8", "DAG-9")
def test_hops_layouts_and_passes_give_local_gradients(world: Any) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(
        max_examples=10,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        derandomize=True,
    )
    @given(
        hops=st.integers(0, 4),
        sparse=st.booleans(),
        t2_requires_grad=st.booleans(),
        passes=st.integers(1, 4),
        how=st.sampled_from(["rpc", "remote"]),
    )
    def check(hops: int, sparse: bool, t2_requires_grad: bool, passes: int, how: str) -> None:
        out = world.run_on(0, _hops_program, hops, sparse, t2_requires_grad, passes, how, world_size=3)
        _assert_close(out["got"], out["local"])

    check()


# -- nested RRefs (PyTorch's _backward_rref with the callee not the owner) -----------------------------
def _owned_tensor(sparse: bool) -> torch.Tensor:
    return _tensor(sparse, True)


def _rref_add(rref_t1: Any, t2: torch.Tensor) -> torch.Tensor:
    return torch.add(rref_t1.local_value(), t2)


def _nested_rref_add(backend: str, owner: str, rref_t1: Any, t2: torch.Tensor) -> torch.Tensor:
    return rpc_module(backend).rpc_sync(owner, _rref_add, args=(rref_t1, t2))  # type: ignore[no-any-return]


def _owner_gradient(backend: str, cid: int, rref_t1: Any) -> Any:
    if backend == "torch":
        import torch.distributed.autograd as da
    else:
        import twinrpc.autograd as da
    return _record(da.get_gradients(cid).get(rref_t1.local_value()))


def _nested_rref_program(ctx: Any, sparse: bool, passes: int) -> dict[str, Any]:
    rpc, da = ctx.rpc, ctx.dist_autograd
    callee, owner = ctx.name(1), ctx.name(2)
    t2 = _tensor(sparse, True)
    with da.context() as cid:
        rref_t1 = rpc.remote(owner, _owned_tensor, args=(sparse,))
        rref = rpc.remote(callee, _nested_rref_add, args=(ctx.backend, owner, rref_t1, t2))
        loss = _total(rref.to_here())
        for i in range(passes):
            da.backward(cid, [loss], retain_graph=i < passes - 1)
        mine = _record(da.get_gradients(cid).get(t2))
        theirs = rpc.rpc_sync(owner, _owner_gradient, args=(ctx.backend, cid, rref_t1))
    l1, l2 = _tensor(sparse, True), _tensor(sparse, True)
    local = torch.add(l1, l2)
    for i in range(passes):
        _total(local).backward(retain_graph=i < passes - 1)
    return {"got": [mine, theirs], "local": [_record(l2.grad), _record(l1.grad)]}


@pytest.mark.spec("DAG-14", "DAG-12", "DAG-8")
@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("sparse", [True, False])
def test_gradients_through_a_nested_rref_reach_its_owner(world: Any, sparse: bool, passes: int) -> None:
    out = world.run_on(0, _nested_rref_program, sparse, passes, world_size=3)
    _assert_close(out["got"], out["local"])


# -- dtypes (PyTorch's test_backward_different_dtypes_sparse) ------------------------------------------
def _different_dtypes(ctx: Any, sparse: bool) -> dict[str, Any]:
    rpc, da = ctx.rpc, ctx.dist_autograd
    t1, t2 = _tensor(sparse, True, torch.float32), _tensor(sparse, True, torch.float64)
    with da.context() as cid:
        loss = _total(rpc.remote(ctx.name(1), torch.add, args=(t1, t2)).to_here())
        da.backward(cid, [loss])
        grads = da.get_gradients(cid)
        got = [_record(grads[t1]), _record(grads[t2])]
    l1, l2 = _tensor(sparse, True, torch.float32), _tensor(sparse, True, torch.float64)
    _total(torch.add(l1, l2)).backward()
    return {"got": got, "local": [_record(l1.grad), _record(l2.grad)]}


@pytest.mark.spec("DAG-14", "DAG-9")
@pytest.mark.parametrize("sparse", [True, False])
def test_gradients_keep_each_tensors_dtype(world: Any, sparse: bool) -> None:
    out = world.run_on(0, _different_dtypes, sparse)
    _assert_close(out["got"], out["local"])
    assert [g[1] for g in out["got"]] == ["torch.float32", "torch.float64"]


# -- values used here and sent on (PyTorch's test_backwards_nested_python_udf_sparse) -----------------
def _nested_udf(backend: str, t1: torch.Tensor, t2: torch.Tensor, dst: str) -> torch.Tensor:
    """Received tensors used here and also sent on to ``dst``: their gradient is the sum of both."""
    t3, t4 = t1 * t2, t1 + t2
    res = rpc_module(backend).rpc_sync(dst, torch.add, args=(t3, t4))
    return t1 * t2 * t3 * t4 * res  # type: ignore[no-any-return]


def _nested_udf_program(ctx: Any, sparse: bool) -> dict[str, Any]:
    rpc, da = ctx.rpc, ctx.dist_autograd
    t1, t2 = _tensor(sparse, True), _tensor(sparse, True)
    with da.context() as cid:
        loss = _total(rpc.rpc_sync(ctx.name(1), _nested_udf, args=(ctx.backend, t1, t2, ctx.name(2))))
        da.backward(cid, [loss])
        grads = da.get_gradients(cid)
        got = [_record(grads[t1]), _record(grads[t2])]
    l1, l2 = _tensor(sparse, True), _tensor(sparse, True)
    t3, t4 = l1 * l2, l1 + l2
    _total(l1 * l2 * t3 * t4 * (t3 + t4)).backward()
    return {"got": got, "local": [_record(l1.grad), _record(l2.grad)]}


@pytest.mark.spec("DAG-14", "DAG-9")
@pytest.mark.parametrize("sparse", [True, False])
def test_received_tensors_used_there_and_sent_on_get_the_sum_of_both_gradients(
    world: Any, sparse: bool
) -> None:
    out = world.run_on(0, _nested_udf_program, sparse, world_size=3)
    _assert_close(out["got"], out["local"])


# -- a remote EmbeddingBag with sparse gradients, two passes (PyTorch's test_embedding_bag_with_no_grad_tensors)
def _embedding_bag() -> torch.nn.EmbeddingBag:
    torch.manual_seed(5)
    return torch.nn.EmbeddingBag(16, 16, mode="sum", sparse=True)


def _bag_forward(
    rref: Any, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    return rref.local_value()(indices, offsets, weights)  # type: ignore[no-any-return]


def _bag_gradient(backend: str, rref: Any, cid: int) -> Any:
    if backend == "torch":
        import torch.distributed.autograd as da
    else:
        import twinrpc.autograd as da
    return da.get_gradients(cid)[rref.local_value().weight]


def _embedding_bag_program(ctx: Any, passes: int) -> dict[str, Any]:
    rpc, da = ctx.rpc, ctx.dist_autograd
    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    weights = torch.rand(8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    bag = rpc.remote(ctx.name(1), _embedding_bag)
    with da.context() as cid:
        res = rpc.rpc_sync(ctx.name(1), _bag_forward, args=(bag, indices, offsets, weights))
        for i in range(passes):
            da.backward(cid, [res.sum()], retain_graph=i < passes - 1)
        remote = rpc.rpc_sync(ctx.name(1), _bag_gradient, args=(ctx.backend, bag, cid))  # a sparse result
        weights_grad = da.get_gradients(cid)[weights]
    local, lw = _embedding_bag(), weights.detach().clone().requires_grad_()
    out = local(indices, offsets, lw)
    for i in range(passes):
        out.sum().backward(retain_graph=i < passes - 1)
    return {
        "got": [_record(remote), _record(weights_grad)],
        "local": [_record(local.weight.grad), _record(lw.grad)],
    }


@pytest.mark.spec("DAG-14", "DAG-8", "RPC-19")
@pytest.mark.parametrize("passes", [2, 3])
def test_a_remote_sparse_embedding_bag_accumulates_its_sparse_gradient_over_passes(
    world: Any, passes: int
) -> None:
    out = world.run_on(0, _embedding_bag_program, passes)
    _assert_close(out["got"], out["local"])
    assert out["got"][0][0] == "torch.sparse_coo"
