"""The older API generations of the seeds: programs written for PyTorch 1.4 and 1.6 (LIFE-8, DAG-13, OPT-6).

PyTorch 1.4 to 1.7 named its backend ``BackendType.PROCESS_GROUP`` and configured it with
``ProcessGroupRpcBackendOptions(num_send_recv_threads=4, rpc_timeout=60.0, init_method="env://")``;
PyTorch 1.4 ran ``dist_autograd.backward(roots)`` and ``DistributedOptimizer.step()`` in the calling
thread's current context, without a context id. PyTorch 2.13 has none of these (the process-group
backend was removed in 1.9, the context id became required in 1.5), so these tests run on ``sim`` and
``gloo`` only: on ``torch`` each would fail at its first line with an AttributeError or a TypeError
that says nothing about the behaviour. The 2.x forms are tested on all three backends by the other
files of the suite.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conformance._support import backend_sleep, outcome, rpc_module

NO_CONTEXT = "Current thread doesn't have a valid autograd context"


def _pg_options(ctx: Any, **kw: Any) -> Any:
    """PyTorch 1.6's options, with the spawn's fresh rendezvous."""
    return ctx.rpc.ProcessGroupRpcBackendOptions(init_method=ctx.options().init_method, **kw)


# -- LIFE-8: BackendType.PROCESS_GROUP and ProcessGroupRpcBackendOptions ---------------------------
def _whoami(backend: str) -> str:
    return str(rpc_module(backend).get_worker_info().name)


def _prog_process_group_world(ctx: Any) -> dict[str, Any]:
    options = _pg_options(ctx, num_send_recv_threads=3, rpc_timeout=25.0)
    ctx.rpc.init_rpc(
        ctx.name(ctx.rank),
        backend=ctx.rpc.BackendType.PROCESS_GROUP,
        rank=ctx.rank,
        world_size=ctx.world_size,
        rpc_backend_options=options,
    )
    peer = ctx.name(1 - ctx.rank)
    out = {
        "add": ctx.rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), ctx.rank)).tolist(),
        "peer": ctx.rpc.rpc_async(peer, _whoami, args=(ctx.backend,)).wait(),
        "remote": ctx.rpc.remote(peer, torch.add, args=(torch.ones(1), 1)).to_here().tolist(),
        "timeout": ctx.rpc.get_rpc_timeout(),
    }
    ctx.rpc.shutdown()
    return out


@pytest.mark.spec("LIFE-8")
@pytest.mark.backends("sim", "gloo")
def test_process_group_backend_with_its_options_runs_the_three_apis(world: Any) -> None:
    """PROCESS_GROUP and ProcessGroupRpcBackendOptions are gone from PyTorch 2.13 (removed in 1.9)."""
    got = world.spawn(_prog_process_group_world)
    for rank, result in enumerate(got):
        assert result == {
            "add": [1.0 + rank, 1.0 + rank],
            "peer": f"worker{1 - rank}",
            "remote": [2.0],
            "timeout": 25.0,
        }


def _prog_options_values(ctx: Any) -> dict[str, Any]:
    rpc = ctx.rpc
    default = rpc.ProcessGroupRpcBackendOptions()
    positional = rpc.ProcessGroupRpcBackendOptions(8, 20.0, "tcp://127.0.0.1:1")
    changed = rpc.ProcessGroupRpcBackendOptions()
    changed.num_send_recv_threads = 2
    changed.rpc_timeout = 5.0
    return {
        "default": (default.num_send_recv_threads, default.rpc_timeout, default.init_method),
        "positional": (positional.num_send_recv_threads, positional.rpc_timeout, positional.init_method),
        "changed": (changed.num_send_recv_threads, changed.rpc_timeout),
        "pool": changed.num_worker_threads,
        "is_options": isinstance(default, rpc.RpcBackendOptions),
        "constant": rpc.DEFAULT_NUM_SEND_RECV_THREADS,
        "members": sorted(m.name for m in rpc.BackendType),
        "zero": outcome(lambda: rpc.ProcessGroupRpcBackendOptions(num_send_recv_threads=0)),
    }


@pytest.mark.spec("LIFE-8", "LIFE-7")
@pytest.mark.backends("sim", "gloo")
def test_process_group_options_have_pytorch_1_6_defaults_and_readable_attributes(world: Any) -> None:
    """ProcessGroupRpcBackendOptions does not exist in PyTorch 2.13; the values are PyTorch 1.6's."""
    got = world.run_on(0, _prog_options_values)
    assert got["default"] == (4, 60.0, "env://")
    assert got["positional"] == (8, 20.0, "tcp://127.0.0.1:1")
    assert got["changed"] == (2, 5.0) and got["pool"] == 2
    assert got["is_options"] is True and got["constant"] == 4
    assert got["members"] == ["PROCESS_GROUP", "TENSORPIPE"]
    kinds, message = got["zero"]
    assert "ValueError" in kinds and "num_send_recv_threads must be a positive int, but got 0" in message


_RUNNING: list[int] = [
    0,
    0,
]  # [now, most at once], on the callee (the simulator shares it: only rank 1 serves)


def _count_concurrent(backend: str) -> None:
    _RUNNING[0] += 1
    _RUNNING[1] = max(_RUNNING[1], _RUNNING[0])
    backend_sleep(backend, 0.3)
    _RUNNING[0] -= 1


def _most_at_once() -> int:
    return _RUNNING[1]


def _prog_send_recv_threads_size_the_pool(ctx: Any) -> int | None:
    _RUNNING[:] = [0, 0]
    options = _pg_options(ctx, num_send_recv_threads=2)
    ctx.rpc.init_rpc(
        ctx.name(ctx.rank),
        backend=ctx.rpc.BackendType.PROCESS_GROUP,
        rank=ctx.rank,
        world_size=ctx.world_size,
        rpc_backend_options=options,
    )
    out = None
    if ctx.rank == 0:
        futs = [ctx.rpc.rpc_async(ctx.name(1), _count_concurrent, args=(ctx.backend,)) for _ in range(6)]
        for fut in futs:
            fut.wait()
        out = ctx.rpc.rpc_sync(ctx.name(1), _most_at_once)
    ctx.rpc.shutdown()
    return out


@pytest.mark.spec("LIFE-8", "LIFE-7")
@pytest.mark.backends("sim", "gloo")
def test_num_send_recv_threads_is_the_number_of_requests_served_at_once(world: Any) -> None:
    """num_send_recv_threads belongs to PyTorch 1.6's ProcessGroupRpcBackendOptions (gone from 2.13)."""
    assert world.spawn(_prog_send_recv_threads_size_the_pool)[0] == 2


def _prog_mismatched_options(ctx: Any) -> dict[str, Any]:
    rpc = ctx.rpc

    def init(backend: Any, options: Any) -> Any:
        return outcome(
            lambda: rpc.init_rpc(
                "worker0", backend=backend, rank=0, world_size=1, rpc_backend_options=options
            )
        )

    out = {
        "pg+tensorpipe": init(rpc.BackendType.PROCESS_GROUP, rpc.TensorPipeRpcBackendOptions()),
        "tensorpipe+pg": init(rpc.BackendType.TENSORPIPE, rpc.ProcessGroupRpcBackendOptions()),
        "still_uninitialised": outcome(rpc.get_worker_info),
    }
    ctx.init_rpc()
    rpc.shutdown()
    return out


@pytest.mark.spec("LIFE-8", "LIFE-3")
@pytest.mark.backends("sim", "gloo")
def test_options_of_the_other_backend_raise_type_error_before_rendezvous(world: Any) -> None:
    """Needs BackendType.PROCESS_GROUP, which PyTorch 2.13 no longer has."""
    got = world.spawn(_prog_mismatched_options, world_size=1)[0]
    for key, expected in [
        ("pg+tensorpipe", "`rpc_backend_options` must be a `ProcessGroupRpcBackendOptions`."),
        ("tensorpipe+pg", "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`."),
    ]:
        kinds, message = got[key]
        assert "TypeError" in kinds and expected in message, (key, got[key])
    assert "RuntimeError" in got["still_uninitialised"][0]


# -- DAG-13: dist_autograd.backward(roots) in the current context ------------------------------------
def _prog_backward_in_current_context(ctx: Any) -> dict[str, Any]:
    da = ctx.dist_autograd
    out: dict[str, Any] = {}
    # the seed's example, as written for PyTorch 1.4
    with da.context() as context_id:
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        loss = ctx.rpc.rpc_sync(ctx.name(1), torch.add, args=(t1, t2)).sum()
        da.backward([loss])
        grads = da.get_gradients(context_id)
        out["list"] = [grads[t1].tolist(), grads[t2].tolist()]
    # one tensor instead of a list, and the retained graph of a second pass
    with da.context() as context_id:
        t3 = torch.rand(2, requires_grad=True)
        loss = ctx.rpc.rpc_sync(ctx.name(1), torch.mul, args=(t3, 3.0)).sum()
        da.backward(loss, retain_graph=True)
        da.backward(loss)
        out["tensor_twice"] = da.get_gradients(context_id)[t3].tolist()
    return out


@pytest.mark.spec("DAG-13", "DAG-5", "DAG-8")
@pytest.mark.backends("sim", "gloo")
def test_backward_without_context_id_runs_in_the_current_context(world: Any) -> None:
    """backward(roots) is PyTorch 1.4's form; PyTorch 2.13 requires the context id (TypeError)."""
    got = world.run_on(0, _prog_backward_in_current_context)
    assert got["list"] == [[[1.0] * 3] * 3] * 2
    assert got["tensor_twice"] == [6.0, 6.0]


def _prog_no_current_context(ctx: Any) -> dict[str, Any]:
    da = ctx.dist_autograd
    t = torch.rand(2, requires_grad=True)
    loss = ctx.rpc.rpc_sync(ctx.name(1), torch.add, args=(t, 1.0)).sum()
    return {"list": outcome(lambda: da.backward([loss])), "tensor": outcome(lambda: da.backward(loss))}


@pytest.mark.spec("DAG-13")
@pytest.mark.backends("sim", "gloo")
def test_backward_without_context_id_outside_a_context_raises_naming_the_missing_context(world: Any) -> None:
    """PyTorch 1.4's test_backward_without_context; PyTorch 2.13 has no backward without context id."""
    got = world.run_on(0, _prog_no_current_context)
    for key in ("list", "tensor"):
        kinds, message = got[key]
        assert "RuntimeError" in kinds and NO_CONTEXT in message, (key, got[key])
        assert "with torch.distributed.autograd.context() as context_id" in message


# -- OPT-6: DistributedOptimizer.step() in the current context ---------------------------------------
def _leaf(value: float) -> torch.Tensor:
    return torch.full((2,), value, requires_grad=True)


def _scaled(rref: Any, k: float) -> torch.Tensor:
    return rref.local_value() * k


def _value(rref: Any) -> list[float]:
    return rref.local_value().detach().tolist()  # type: ignore[no-any-return]


def _prog_step_in_current_context(ctx: Any) -> dict[str, Any]:
    p1 = ctx.rpc.remote(ctx.name(1), _leaf, args=(1.0,))
    p2 = ctx.rpc.remote(ctx.name(1), _leaf, args=(2.0,))
    opt = ctx.optim.DistributedOptimizer(torch.optim.SGD, [p1, p2], lr=0.05)
    with ctx.dist_autograd.context():
        a = ctx.rpc.rpc_sync(ctx.name(1), _scaled, args=(p1, 3.0))
        b = ctx.rpc.rpc_sync(ctx.name(1), _scaled, args=(p2, 1.0))
        ctx.dist_autograd.backward([(a + b).sum()])
        opt.step()
    outside = outcome(opt.step)
    return {
        "p1": ctx.rpc.rpc_sync(ctx.name(1), _value, args=(p1,)),
        "p2": ctx.rpc.rpc_sync(ctx.name(1), _value, args=(p2,)),
        "outside": outside,
    }


@pytest.mark.spec("OPT-6", "OPT-3")
@pytest.mark.backends("sim", "gloo")
def test_step_without_context_id_steps_with_the_current_contexts_gradients(world: Any) -> None:
    """step() without a context id is PyTorch 1.4's form; PyTorch 2.13's step requires the id."""
    got = world.run_on(0, _prog_step_in_current_context)
    assert got["p1"] == pytest.approx([1.0 - 0.05 * 3.0] * 2)
    assert got["p2"] == pytest.approx([2.0 - 0.05 * 1.0] * 2)
    kinds, message = got["outside"]
    assert "RuntimeError" in kinds and NO_CONTEXT in message
