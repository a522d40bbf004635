"""Leaves in a distributed backward: their AccumulateGrad hooks run, DDP inside a context all-reduces,
and gradients in a context never share memory (DAG-15..DAG-17).

A DDP program sets up its own gloo process group beside RPC, as PyTorch's "DDP with the distributed
RPC framework" pattern does; the test hands every rank the same ``file://`` rendezvous (the simulator
makes a simulated group and ignores it, SIM-5).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch


# -- user functions (run on workers) ---------------------------------------------------------------
class _HookedLinear(torch.nn.Module):
    """A module whose weight records every gradient its hooks see (lives on its owner)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(3, 2)
        self.tensor_hook_grads: list[list[list[float]]] = []
        self.post_hook_grads: list[list[list[float]]] = []
        self.lin.weight.register_hook(self._tensor_hook)
        # the tensor holds its accumulator weakly: keep it, or the hook goes with it
        self._accumulator = torch.autograd.graph.get_gradient_edge(self.lin.weight).node
        self._accumulator.register_hook(self._post_hook)

    def _tensor_hook(self, grad: torch.Tensor) -> torch.Tensor:
        self.tensor_hook_grads.append(grad.tolist())
        return grad * 2  # as in local autograd, the context gets what the hook returns

    def _post_hook(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.post_hook_grads.append(grad_outputs[0].tolist())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def report(self, context_id: int, dist_autograd: Any) -> dict[str, Any]:
        grads = dist_autograd.get_gradients(context_id)
        return {
            "tensor_hook": self.tensor_hook_grads,
            "post_hook": self.post_hook_grads,
            "context": grads[self.lin.weight].tolist(),
            "dot_grad": self.lin.weight.grad,
        }


def _call_forward(rref: Any, x: torch.Tensor) -> torch.Tensor:
    return rref.local_value()(x)  # type: ignore[no-any-return]


def _report(rref: Any, context_id: int, backend: str) -> dict[str, Any]:
    if backend == "torch":
        import torch.distributed.autograd as dist_autograd
    else:
        import twinrpc.autograd as dist_autograd
    return rref.local_value().report(context_id, dist_autograd)  # type: ignore[no-any-return]


def _hooks_on_both_sides(ctx: Any) -> dict[str, Any]:
    rpc, dist_autograd = ctx.rpc, ctx.dist_autograd
    owner = rpc.remote("worker1", _HookedLinear)
    local = _HookedLinear()
    x = torch.arange(6.0).reshape(2, 3)
    with dist_autograd.context() as cid:
        remote_out = rpc.rpc_sync("worker1", _call_forward, args=(owner, x))
        loss = (remote_out * local(x)).sum()
        dist_autograd.backward(cid, [loss])
        mine = local.report(cid, dist_autograd)
        theirs = rpc.rpc_sync("worker1", _report, args=(owner, cid, ctx.backend))
    # the same computation in local autograd, with the same doubling hook
    ref_remote, ref_local = _HookedLinear(), _HookedLinear()
    (ref_remote(x) * ref_local(x)).sum().backward()
    return {
        "mine": mine,
        "theirs": theirs,
        "ref_local": ref_local.lin.weight.grad.tolist(),  # type: ignore[union-attr]
        "ref_remote": ref_remote.lin.weight.grad.tolist(),  # type: ignore[union-attr]
        "ref_local_tensor_hook": ref_local.tensor_hook_grads,
    }


@pytest.mark.spec("DAG-15")
def test_leaf_tensor_hooks_and_accumulate_grad_post_hooks_run_once_on_every_worker(world: Any) -> None:
    got = world.run_on(0, _hooks_on_both_sides)
    for side, ref in (("mine", "ref_local"), ("theirs", "ref_remote")):
        report = got[side]
        assert len(report["tensor_hook"]) == 1, side
        assert len(report["post_hook"]) == 1, side
        # the post-hook and the context see what the tensor hook returned (doubled), as .grad does locally
        assert torch.allclose(torch.tensor(report["post_hook"][0]), torch.tensor(got[ref])), side
        assert torch.allclose(torch.tensor(report["context"]), torch.tensor(got[ref])), side
        assert report["dot_grad"] is None, side  # .grad is never written by a distributed backward
    assert torch.allclose(
        torch.tensor(got["mine"]["tensor_hook"][0]), torch.tensor(got["ref_local_tensor_hook"][0])
    )


# -- DDP inside a distributed autograd context -------------------------------------------------------
def _remote_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0


def _ddp_under_dist_autograd(ctx: Any, init_file: str, batches: list[int]) -> dict[str, Any]:
    """Each rank trains a DDP model on its own batches (``batches[rank]`` of them; unequal counts run
    under ``join()``), with a factor computed by an RPC to the other rank, inside a context per batch.
    The same steps with local autograd give the reference."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, rpc, dist_autograd = ctx.rank, ctx.rpc, ctx.dist_autograd
    other = ctx.name(1 - rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ddp = ddp_ref = None
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        reference.load_state_dict(model.state_dict())
        ddp, ddp_ref = DDP(model), DDP(reference)
        data = torch.Generator().manual_seed(100 + rank)
        inputs = [torch.randn(5, 4, generator=data) for _ in range(batches[rank])]
        dist_grads: list[list[list[float]]] = []
        dot_grads_untouched = True
        with ddp.join():
            for x in inputs:
                with dist_autograd.context() as cid:
                    factor = rpc.rpc_sync(other, _remote_scale, args=(torch.ones(5, 3),))
                    loss = (ddp(x) * factor).pow(2).sum()
                    dist_autograd.backward(cid, [loss])
                    grads = dist_autograd.get_gradients(cid)
                    dist_grads.append([grads[p].flatten().tolist() for p in model.parameters()])
                    dot_grads_untouched &= all(p.grad is None for p in model.parameters())
        local_grads: list[list[list[float]]] = []
        own_grads: list[list[list[float]]] = []
        with ddp_ref.join():
            for x in inputs:
                ddp_ref.zero_grad(set_to_none=True)
                (ddp_ref(x) * torch.full((5, 3), 3.0)).pow(2).sum().backward()
                local_grads.append([p.grad.flatten().tolist() for p in reference.parameters()])  # type: ignore[union-attr]
                alone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
                alone.load_state_dict(reference.state_dict())
                (alone(x) * 3.0).pow(2).sum().backward()
                own_grads.append([p.grad.flatten().tolist() for p in alone.parameters()])  # type: ignore[union-attr]
    finally:
        # The DDP modules (their reducers hold the process group) go first, while the group is
        # there: torn down after it, with the frame's locals, one rank once hung in that teardown.
        ddp = ddp_ref = None
        gc.collect()
        dist.destroy_process_group()
    return {"dist": dist_grads, "local": local_grads, "own": own_grads, "untouched": dot_grads_untouched}


def _assert_same(a: list[list[list[float]]], b: list[list[list[float]]]) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b, strict=True):
        for pa, pb in zip(step_a, step_b, strict=True):
            assert torch.allclose(torch.tensor(pa), torch.tensor(pb), atol=1e-5), (pa, pb)


@pytest.mark.spec("DAG-16")
def test_ddp_inside_a_context_all_reduces_and_its_gradients_equal_local_ddp(
    world: Any, tmp_path: Any
) -> None:
    results = world.run(_ddp_under_dist_autograd, str(tmp_path / "pg"), [2, 2])
    for got in results:
        _assert_same(got["dist"], got["local"])
        assert got["untouched"]
        # the all-reduce happened: a rank's gradient is not what its own batch alone gives
        assert not torch.allclose(torch.tensor(got["dist"][0][0]), torch.tensor(got["own"][0][0]))


@pytest.mark.spec("DAG-16")
def test_ddp_join_with_uneven_inputs_inside_contexts_equals_local_ddp(world: Any, tmp_path: Any) -> None:
    results = world.run(_ddp_under_dist_autograd, str(tmp_path / "pg"), [3, 1])
    for got in results:
        _assert_same(got["dist"], got["local"])


# -- gradients in a context never alias ----------------------------------------------------------------
def _aliasing(ctx: Any) -> dict[str, Any]:
    rpc, dist_autograd = ctx.rpc, ctx.dist_autograd
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    c = torch.ones(2, 3, requires_grad=True)
    with dist_autograd.context() as cid:
        # a and b get the very same gradient tensor from the add; c's comes from sum(): expanded
        s = rpc.rpc_sync("worker1", torch.add, args=(a, b))
        loss = s.sum() + rpc.rpc_sync("worker1", torch.mul, args=(c, 2.0)).sum()
        dist_autograd.backward(cid, [loss], retain_graph=True)
        grads = dist_autograd.get_gradients(cid)
        shared = grads[a].data_ptr() == grads[b].data_ptr()
        grads[a].mul_(10)  # clipping one gradient in place ...
        b_after = grads[b].tolist()  # ... leaves the other alone
        expanded = grads[c].stride()
        grads[c].clamp_(max=1.5)  # and works on every gradient (no expanded, stride-0 storage)
        c_after = grads[c].tolist()
        # a second pass in the same context adds into the context's own tensors
        dist_autograd.backward(cid, [loss])
        again = dist_autograd.get_gradients(cid)
    return {
        "shared": shared,
        "b_after": b_after,
        "stride": list(expanded),
        "c": c_after,
        "a2": again[a].tolist(),
        "b2": again[b].tolist(),
        "c2": again[c].tolist(),
    }


@pytest.mark.spec("DAG-17", "DAG-8")
def test_gradients_in_a_context_never_share_memory_and_can_be_edited_in_place(world: Any) -> None:
    got = world.run_on(0, _aliasing)
    assert got["shared"] is False
    assert got["b_after"] == [1.0, 1.0, 1.0]
    assert 0 not in got["stride"]
    assert got["c"] == [[1.5, 1.5, 1.5], [1.5, 1.5, 1.5]]
    assert got["a2"] == [11.0, 11.0, 11.0]  # 10 (edited in place) + 1
    assert got["b2"] == [2.0, 2.0, 2.0]
    assert got["c2"] == [[3.5, 3.5, 3.5], [3.5, 3.5, 3.5]]
