"""When a context adopts the gradient a backward pass hands a leaf and when it copies it (DAG-20).

PyTorch's context accumulates with ``AccumulateGrad::accumulateGrad``: a dense gradient that nothing
else holds and that has the leaf's layout is adopted as it is (stolen), any other is cloned into the
leaf's layout; a sparse one is adopted when its indices and values are contiguous and owned by it
alone. Which happened is visible through the gradient a custom Function returns: its ``data_ptr``
is the context's, or not. These are PyTorch's ``test_no_grad_copy``, ``test_no_grad_copy_sparse`` and
``test_grad_copy_sparse_indices_extra_ref`` (dist_autograd_test.py), and their variations.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import Function

# Each Function records, in ``seen``, the data pointers of the gradients its backward returned:
# plain data that stays on the worker and is compared there.


class _Sum(Function):
    """``a + b``; its backward hands the very same gradient tensor to both inputs."""

    seen: list[int] = []

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _Sum.seen.append(grad.data_ptr())
        return grad, grad


class _Identity(Function):
    """Passes its gradient through unchanged (a fresh, exclusively owned tensor when the engine
    hands it one)."""

    seen: list[int] = []
    kept: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, keep: bool) -> torch.Tensor:
        ctx.keep = keep
        return a.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _Identity.seen.append(grad.data_ptr())
        if ctx.keep:  # a reference the function keeps: the context may not adopt the tensor
            _Identity.kept.append(grad)
        return grad, None


class _Expanded(Function):
    """A scalar whose backward returns an expanded (stride-0) gradient."""

    seen: list[int] = []

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.size = a.size()
        return torch.tensor([1.0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        g = torch.ones(1).expand(ctx.size)
        _Expanded.seen.append(g.data_ptr())
        return g


class _SparseIdentity(Function):
    """Passes a sparse gradient through; records its values' pointer, optionally keeps views of its
    indices and values (which do not count as references to the sparse tensor)."""

    seen: list[int] = []
    views: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, keep_views: bool) -> torch.Tensor:
        ctx.keep_views = keep_views
        return a

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _SparseIdentity.seen.append(grad._values().data_ptr())
        if ctx.keep_views:
            _SparseIdentity.views += [grad._indices(), grad._values()]
        return grad, None


class _SparseNonContiguous(_Sum):
    """``a + b``; its backward hands both inputs one sparse gradient whose indices and values are
    expanded (non-contiguous)."""

    seen: list[int] = []

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.full((1, 3), 0.5).expand(8, 3)
        indices = torch.ones(1, 1, dtype=torch.long).expand(1, 8)
        g = torch.sparse_coo_tensor(indices, values, (10, 3), check_invariants=True)
        _SparseNonContiguous.seen.append(g._values().data_ptr())
        return g, g


def _reset() -> None:
    for fn in (_Sum, _Identity, _Expanded, _SparseIdentity, _SparseNonContiguous):
        fn.seen = []
    _Identity.kept = []
    _SparseIdentity.views = []


def _two_leaves(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random leaves of one shape, with every Function's records cleared."""
    _reset()
    torch.manual_seed(0)
    return torch.randn(rows, cols, requires_grad=True), torch.randn(rows, cols, requires_grad=True)


# -- dense -------------------------------------------------------------------------------------------
def _dense_cases(ctx: Any) -> dict[str, Any]:
    da = ctx.dist_autograd
    a, b = _two_leaves(5, 6)
    out: dict[str, Any] = {}
    with da.context() as cid:  # an expanded gradient, through a function that hands it on to two leaves
        da.backward(cid, [_Expanded.apply(_Sum.apply(a, b))])
        g = da.get_gradients(cid)
        out["expanded"] = {
            "a_is_fn_grad": g[a].data_ptr() in _Sum.seen + _Expanded.seen,
            "b_is_fn_grad": g[b].data_ptr() in _Sum.seen + _Expanded.seen,
            "strides": [list(g[a].stride()), list(g[b].stride())],
            "values": [g[a].tolist(), g[b].tolist()],
        }
    _reset()
    with da.context() as cid:  # one leaf, an exclusively owned contiguous gradient
        da.backward(cid, [_Identity.apply(a, False)[1][0]])
        out["owned"] = da.get_gradients(cid)[a].data_ptr() == _Identity.seen[0]
    _reset()
    with da.context() as cid:  # the same, but the function keeps a reference to the gradient
        da.backward(cid, [_Identity.apply(a, True)[1][0]])
        out["kept"] = da.get_gradients(cid)[a].data_ptr() == _Identity.seen[0]
    _reset()
    with da.context() as cid:  # one gradient tensor handed to two leaves in one pass
        da.backward(cid, [_Sum.apply(a, b)[1][0]])
        g = da.get_gradients(cid)
        out["two_leaves"] = {
            "a_is_fn_grad": g[a].data_ptr() == _Sum.seen[0],
            "b_is_fn_grad": g[b].data_ptr() == _Sum.seen[0],
            "a_is_b": g[a].data_ptr() == g[b].data_ptr(),
        }
    return out


@pytest.mark.spec("DAG-20", "DAG-17")
def test_an_expanded_gradient_is_copied_into_the_leafs_layout(world: Any) -> None:
    got = world.run_on(0, _dense_cases)["expanded"]
    assert got["a_is_fn_grad"] is False
    assert got["b_is_fn_grad"] is False
    assert got["strides"] == [[6, 1], [6, 1]]
    assert got["values"] == [[[1.0] * 6] * 5] * 2


@pytest.mark.spec("DAG-20")
def test_an_exclusively_owned_gradient_is_adopted_without_a_copy(world: Any) -> None:
    assert world.run_on(0, _dense_cases)["owned"] is True


@pytest.mark.spec("DAG-20", "DAG-17")
def test_a_gradient_the_function_still_holds_is_copied(world: Any) -> None:
    assert world.run_on(0, _dense_cases)["kept"] is False


@pytest.mark.spec("DAG-20", "DAG-17")
def test_a_gradient_handed_to_two_leaves_is_copied_for_both(world: Any) -> None:
    """Local autograd lets the last leaf adopt it; PyTorch's distributed engine holds every leaf's
    captured gradient until the pass ends, so neither may."""
    got = world.run_on(0, _dense_cases)["two_leaves"]
    assert got == {"a_is_fn_grad": False, "b_is_fn_grad": False, "a_is_b": False}


def _layout_of_leaf(ctx: Any, transposed: bool) -> dict[str, Any]:
    """A leaf whose strides are not row-major gets a gradient with its own strides (the layout
    contract), whatever layout the pass produced."""
    da = ctx.dist_autograd
    base = torch.arange(30.0).reshape(6, 5)
    a = (base.t() if transposed else base.t().contiguous()).detach().requires_grad_()
    with da.context() as cid:
        da.backward(cid, [(a * 2.0).sum()])
        g = da.get_gradients(cid)[a]
    local = a.detach().clone().requires_grad_()
    (local * 2.0).sum().backward()
    return {"leaf": list(a.stride()), "grad": list(g.stride()), "equal": torch.equal(g, local.grad)}


@pytest.mark.spec("DAG-20")
@pytest.mark.parametrize("transposed", [True, False])
def test_a_gradient_gets_the_strides_of_its_leaf(world: Any, transposed: bool) -> None:
    got = world.run_on(0, _layout_of_leaf, transposed)
    assert got["grad"] == got["leaf"]
    assert got["equal"] is True


def _adopted_then_added_in_place(ctx: Any, passes: int) -> dict[str, Any]:
    da = ctx.dist_autograd
    _reset()
    a = torch.ones(2, 3, requires_grad=True)
    with da.context() as cid:
        loss = _Identity.apply(a, False)[1][0]  # its gradient: a fresh one-hot tensor each pass
        for i in range(passes):
            da.backward(cid, [loss], retain_graph=i < passes - 1)
            if i == 0:
                first = da.get_gradients(cid)[a].data_ptr()
        g = da.get_gradients(cid)[a]
        return {"same_tensor": g.data_ptr() == first, "value": g.tolist()}


@pytest.mark.spec("DAG-20", "DAG-8")
@pytest.mark.parametrize("passes", [2, 5])
def test_later_passes_add_into_the_contexts_gradient_in_place(world: Any, passes: int) -> None:
    got = world.run_on(0, _adopted_then_added_in_place, passes)
    assert got["same_tensor"] is True
    assert got["value"] == [[0.0, 0.0, 0.0], [float(passes), 0.0, 0.0]]


# -- sparse ------------------------------------------------------------------------------------------
_INPUT = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
_OFFSETS = torch.tensor([0, 4])


def _sparse_cases(ctx: Any, passes: int) -> dict[str, Any]:
    da = ctx.dist_autograd
    a, b = _two_leaves(10, 3)
    out: dict[str, Any] = {}
    for keep_views in (False, True):
        _reset()
        with da.context() as cid:
            loss = F.embedding_bag(_INPUT, _SparseIdentity.apply(a, keep_views), _OFFSETS, sparse=True).sum()
            da.backward(cid, [loss], retain_graph=True)
            g = da.get_gradients(cid)[a]
            adopted = g._values().data_ptr() == _SparseIdentity.seen[0]
            for _ in range(passes - 1):
                da.backward(cid, [loss], retain_graph=True)
            total = da.get_gradients(cid)[a]
            out["views" if keep_views else "owned"] = {
                "adopted": adopted,
                "layout": str(total.layout),
                "dense": total.to_dense().tolist(),
            }
    _reset()
    with da.context() as cid:
        emb = _SparseNonContiguous.apply(a, b)
        loss = F.embedding_bag(_INPUT, emb, _OFFSETS, sparse=True).sum()
        da.backward(cid, [loss], retain_graph=True)
        g = da.get_gradients(cid)
        pa, pb = g[a]._values().data_ptr(), g[b]._values().data_ptr()
        for _ in range(passes - 1):
            da.backward(cid, [loss], retain_graph=True)
        g = da.get_gradients(cid)
        out["non_contiguous"] = {
            "a_is_fn_grad": pa == _SparseNonContiguous.seen[0],
            "b_is_fn_grad": pb == _SparseNonContiguous.seen[0],
            "a_is_b": pa == pb,
            "dense": [g[a].to_dense().tolist(), g[b].to_dense().tolist()],
        }
    local = a.detach().clone().requires_grad_()
    for _ in range(passes):
        F.embedding_bag(_INPUT, local, _OFFSETS, sparse=True).sum().backward()
    out["local"] = local.grad.to_dense().tolist()  # type: ignore[union-attr]
    return out


@pytest.mark.spec("DAG-20", "DAG-14")
@pytest.mark.parametrize("passes", [1, 3])
def test_an_owned_sparse_gradient_is_adopted_and_later_passes_accumulate(world: Any, passes: int) -> None:
    got = world.run_on(0, _sparse_cases, passes)
    assert got["owned"]["adopted"] is True
    assert got["owned"]["layout"] == "torch.sparse_coo"
    assert got["owned"]["dense"] == got["local"]


@pytest.mark.spec("DAG-20", "DAG-14")
def test_views_of_a_sparse_gradients_indices_and_values_do_not_prevent_its_adoption(world: Any) -> None:
    got = world.run_on(0, _sparse_cases, 1)
    assert got["views"]["adopted"] is True
    assert got["views"]["dense"] == got["local"]


@pytest.mark.spec("DAG-20", "DAG-17", "DAG-14")
@pytest.mark.parametrize("passes", [1, 3])
def test_a_sparse_gradient_with_non_contiguous_parts_is_copied_for_each_leaf(world: Any, passes: int) -> None:
    got = world.run_on(0, _sparse_cases, passes)["non_contiguous"]
    assert (got["a_is_fn_grad"], got["b_is_fn_grad"], got["a_is_b"]) == (False, False, False)
    row = [[0.0] * 3, [0.5 * 8 * passes] * 3] + [[0.0] * 3] * 8
    assert got["dense"] == [row, row]


# -- gradients that come back over RPC ---------------------------------------------------------------
def _times_two(t: torch.Tensor) -> torch.Tensor:
    return t * 2.0


def _owned_leaf() -> torch.Tensor:
    return torch.ones(2, 3, requires_grad=True)


def _through_identity_times_three(rref: Any) -> torch.Tensor:
    _reset()
    return _Identity.apply(rref.local_value(), False) * 3.0  # type: ignore[no-any-return]


def _owner_report(rref: Any, cid: int, backend: str) -> dict[str, Any]:
    if backend == "torch":
        import torch.distributed.autograd as da
    else:
        import twinrpc.autograd as da
    g = da.get_gradients(cid)[rref.local_value()]
    return {"adopted": g.data_ptr() == _Identity.seen[0], "value": g.tolist()}


def _across_rpc(ctx: Any, where: str) -> dict[str, Any]:
    """``where``: the leaf's gradient comes back over RPC and reaches it through a Function
    (``behind_send``); the Function's output is used here and sent too, so its gradient is the sum
    of both (``used_here_and_sent``); the leaf lives on the callee (``on_the_owner``)."""
    rpc, da = ctx.rpc, ctx.dist_autograd
    _reset()
    x = torch.ones(2, 3, requires_grad=True)
    with da.context() as cid:
        if where == "on_the_owner":
            w = rpc.remote(ctx.name(1), _owned_leaf)
            loss = rpc.rpc_sync(ctx.name(1), _through_identity_times_three, args=(w,)).sum()
            da.backward(cid, [loss])
            return rpc.rpc_sync(ctx.name(1), _owner_report, args=(w, cid, ctx.backend))  # type: ignore[no-any-return]
        z = _Identity.apply(x, False)
        loss = rpc.rpc_sync(ctx.name(1), _times_two, args=(z,)).sum()
        if where == "used_here_and_sent":
            loss = loss + z.sum()
        da.backward(cid, [loss], retain_graph=True)
        first = da.get_gradients(cid)[x]
        adopted, ptr = first.data_ptr() == _Identity.seen[0], first.data_ptr()
        da.backward(cid, [loss])
        again = da.get_gradients(cid)[x]
        return {"adopted": adopted, "in_place": again.data_ptr() == ptr, "value": again.tolist()}


@pytest.mark.spec("DAG-20", "DAG-6")
@pytest.mark.parametrize("where", ["behind_send", "used_here_and_sent"])
def test_a_gradient_that_comes_back_over_rpc_is_adopted_and_later_passes_add_in_place(
    world: Any, where: str
) -> None:
    """The send function gives its gradients away: a Function between it and the leaf returns a
    tensor nothing else holds, also when it is the sum of a local and a remote gradient. PyTorch
    adopts a gradient that comes back over RPC only when its RPC thread has let go of the message
    first, a race it almost always wins (spec/autograd.md, DAG-20): twinrpc always adopts it, and
    on the ``torch`` backend only the value and the in-place later pass are held to."""
    got = world.run_on(0, _across_rpc, where)
    per_pass = 2.0 if where == "behind_send" else 3.0
    adopted = got["adopted"] if world.backend == "torch" else True
    assert got == {"adopted": adopted, "in_place": True, "value": [[2 * per_pass] * 3] * 2}


@pytest.mark.spec("DAG-20", "DAG-6")
def test_a_gradient_sent_to_the_owner_of_a_leaf_is_adopted_there(world: Any) -> None:
    got = world.run_on(0, _across_rpc, "on_the_owner")
    assert got == {"adopted": True, "value": [[3.0] * 3] * 2}


# -- a property over where the gradient comes from -----------------------------------------------------
def _drawn_case(ctx: Any, over_rpc: bool, expanded: bool, keep: bool, passes: int) -> dict[str, Any]:
    """The leaf's gradient passes through ``_Identity`` (which may ``keep`` it); before that it is
    the expanded gradient of ``sum()`` or the fresh one of an indexing (``expanded``), computed here
    or on worker1 (``over_rpc``, where ``* 2`` makes any gradient fresh and contiguous)."""
    rpc, da = ctx.rpc, ctx.dist_autograd
    _reset()
    x = torch.ones(2, 3, requires_grad=True)
    with da.context() as cid:
        z = _Identity.apply(x, keep)
        if over_rpc:
            z = rpc.rpc_sync(ctx.name(1), _times_two, args=(z,))
        loss = z.sum() if expanded else z[1][0]
        for i in range(passes):
            da.backward(cid, [loss], retain_graph=i < passes - 1)
            if i == 0:
                first = da.get_gradients(cid)[x]
                adopted, ptr = first.data_ptr() == _Identity.seen[0], first.data_ptr()
        g = da.get_gradients(cid)[x]
        return {"adopted": adopted, "in_place": g.data_ptr() == ptr, "value": g.tolist()}


@pytest.mark.spec("DAG-20", "DAG-8", "DAG-9")
def test_adoption_follows_who_holds_the_gradient_and_its_layout(world: Any) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(
        max_examples=12,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        derandomize=True,
    )
    @given(over_rpc=st.booleans(), expanded=st.booleans(), keep=st.booleans(), passes=st.integers(1, 3))
    def check(over_rpc: bool, expanded: bool, keep: bool, passes: int) -> None:
        got = world.run_on(0, _drawn_case, over_rpc, expanded, keep, passes)
        scale = passes * (2.0 if over_rpc else 1.0)
        value = [[scale] * 3] * 2 if expanded else [[0.0] * 3, [scale, 0.0, 0.0]]
        fresh = over_rpc or not expanded  # an expanded gradient is copied into the leaf's layout
        adopted = fresh and not keep
        if adopted and over_rpc and world.backend == "torch":
            adopted = got["adopted"]  # upstream's race (DAG-20, see the test above): value and in_place only
        assert got == {"adopted": adopted, "in_place": True, "value": value}

    check()
