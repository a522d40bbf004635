"""Distributed autograd through ``@async_execution`` functions and Future callbacks (DAG-3, DAG-4, DAG-7).

Which RPCs join the caller's context is decided per thread (per simulated task), as in PyTorch
(observed on torch 2.13.0 with this file): the body of an ``@async_execution`` function runs with the
caller's context current, and so does a callback that ``then`` runs at once because its future was
already complete; a callback run later by the task that completes the future (a reply arriving) runs
without a context, so an RPC it makes is not attached. The reply of an ``@async_execution`` function,
sent when its future completes, is linked into the context.

``@async_execution`` must be applied when a UDF is defined, before the backend is known, so
:func:`_async_udf` binds one decorated copy per RPC implementation (``<name>_torch`` /
``<name>_twinrpc``), each pickled by reference under its own name.
"""

from __future__ import annotations

import importlib
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

from conformance._support import outcome, rpc_module

_RPC_MODULES = {"torch": "torch.distributed.rpc", "twinrpc": "twinrpc.rpc"}


def _async_udf(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Bind ``fn`` decorated with each RPC module's ``async_execution`` as ``<fn name>_<suffix>``."""
    for suffix, module_name in _RPC_MODULES.items():
        try:
            async_execution = importlib.import_module(module_name).functions.async_execution
        except Exception:  # an implementation under development may not import yet
            continue
        wrapped = async_execution(fn)
        wrapped.__name__ = wrapped.__qualname__ = f"{fn.__name__}_{suffix}"
        globals()[wrapped.__name__] = wrapped
    return fn


def _pick(backend: str, fn: Callable[..., Any]) -> Any:
    """The copy of ``fn`` decorated for ``backend``'s RPC module."""
    return globals()[f"{fn.__name__}_{'torch' if backend == 'torch' else 'twinrpc'}"]


def _modules(backend: str) -> tuple[Any, Any]:
    """``(dist_autograd, futures)`` of ``backend``, for code running inside a UDF."""
    if backend == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.futures as futures
    else:
        import twinrpc.autograd as dist_autograd
        import twinrpc.futures as futures
    return dist_autograd, futures


def _current_context(backend: str) -> int | None:
    """The id of the context current on this thread (simulated task), or None."""
    dist_autograd = _modules(backend)[0]
    try:
        return dist_autograd._current_context()._context_id()  # type: ignore[no-any-return]
    except RuntimeError as exc:
        assert "Current thread doesn't have a valid autograd context" in str(exc)
        return None


# -- parameters held by workers (keyed by worker name: simulated workers share this module) ----------
_PARAMS: dict[tuple[str, int], torch.Tensor] = {}
_PARAMS_LOCK = threading.Lock()


def _param_value(seed: int) -> torch.Tensor:
    return torch.rand(3, generator=torch.Generator().manual_seed(seed)) + 0.5


def _param(backend: str, seed: int) -> torch.Tensor:
    """This worker's parameter ``seed`` (created once, requires grad)."""
    key = (rpc_module(backend).get_worker_info().name, seed)
    with _PARAMS_LOCK:
        p = _PARAMS.get(key)
        if p is None:
            p = _PARAMS[key] = _param_value(seed).requires_grad_()
        return p


def _param_grad(backend: str, context_id: int, seed: int) -> torch.Tensor | None:
    """On a worker: the context's gradient of this worker's parameter ``seed``."""
    return _modules(backend)[0].get_gradients(context_id).get(_param(backend, seed))


# -- UDFs: an async function on worker1 whose future a worker2 RPC completes -------------------------
_P1, _P2 = 11, 22  # worker1's and worker2's parameter seeds


def _scale_sin(backend: str, u: torch.Tensor) -> torch.Tensor:
    """On worker2: ``sin(u) * p2``."""
    return u.sin() * _param(backend, _P2)


@_async_udf
def _relay(backend: str, mode: str, x: torch.Tensor) -> Any:
    """On worker1: ``u = x * p1``, then the rest on worker2; the returned future carries the result."""
    rpc = rpc_module(backend)
    u = x * _param(backend, _P1)
    fut = rpc.rpc_async("worker2", _scale_sin, args=(backend, u))
    if mode == "returned":  # the future of the RPC itself
        return fut
    if mode == "then":  # a local continuation in a callback, on the task the reply arrives on
        return fut.then(lambda f: f.wait() * u)
    # "wait_then_rpc": the callback runs at once on this (context) thread, so its RPC joins
    fut.wait()
    return fut.then(lambda f: rpc.rpc_sync("worker2", _scale_sin, args=(backend, f.wait() * u)))


def _local_relay(mode: str, x: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
    u = x * p1
    y = u.sin() * p2
    if mode == "returned":
        return y
    if mode == "then":
        return y * u
    return (y * u).sin() * p2


def _async_gradients(ctx: Any, mode: str, via: str) -> dict[str, Any]:
    da, rpc = ctx.dist_autograd, ctx.rpc
    relay = _pick(ctx.backend, _relay)
    a = torch.rand(3, generator=torch.Generator().manual_seed(5)).requires_grad_()
    with da.context() as cid:
        if via == "rpc_sync":
            r = rpc.rpc_sync("worker1", relay, args=(ctx.backend, mode, a))
        else:  # remote: the owner keeps the async result; to_here links it (DAG-12)
            r = rpc.remote("worker1", relay, args=(ctx.backend, mode, a)).to_here()
        da.backward(cid, [(r * a).sum()])
        got = {
            "a": da.get_gradients(cid).get(a),
            "p1": rpc.rpc_sync("worker1", _param_grad, args=(ctx.backend, cid, _P1)),
            "p2": rpc.rpc_sync("worker2", _param_grad, args=(ctx.backend, cid, _P2)),
        }
    la = a.detach().clone().requires_grad_()
    p1 = _param_value(_P1).requires_grad_()
    p2 = _param_value(_P2).requires_grad_()
    (_local_relay(mode, la, p1, p2) * la).sum().backward()
    expected = {"a": la.grad, "p1": p1.grad, "p2": p2.grad}
    return {
        k: g is not None and torch.allclose(g, expected[k], atol=1e-6)  # type: ignore[arg-type]
        for k, g in got.items()
    }


@pytest.mark.spec("DAG-4", "DAG-9", "DAG-12")
@pytest.mark.parametrize("via", ["rpc_sync", "remote"])
@pytest.mark.parametrize("mode", ["returned", "then", "wait_then_rpc"])
def test_async_execution_completed_by_a_third_worker_gives_every_worker_local_gradients(
    world: Any, mode: str, via: str
) -> None:
    got = world.run_on(0, _async_gradients, mode, via, world_size=3)
    assert got == {"a": True, "p1": True, "p2": True}


# -- which RPCs join: the async body, inline callbacks, reply callbacks --------------------------------
_GATES: dict[str, Any] = {}


def _gate(backend: str, key: str) -> Any:
    """A Future per key on this worker; whichever of open/wait arrives first creates it (atomic)."""
    fut = _GATES.get(key)
    if fut is None:
        fut = _GATES.setdefault(key, _modules(backend)[1].Future())
    return fut


def _open_gate(backend: str, key: str) -> None:
    _gate(backend, key).set_result(None)


def _report_context(backend: str) -> int | None:
    return _current_context(backend)


@_async_udf
def _gated_double(backend: str, key: str, x: torch.Tensor) -> Any:
    """On worker2: ``x * 2`` once the gate ``key`` opens, with the context its body saw."""
    seen = _current_context(backend)
    return _gate(backend, key).then(lambda _: (x * 2, seen))


@_async_udf
def _observe_joins(backend: str, key: str, x: torch.Tensor) -> Any:
    """On worker1: which context each place sees, and whether RPCs made there are attached.

    The reply callback is registered before the gate on worker2 opens (the gate is opened by an RPC
    sent after the registration), so it always runs on the task that receives worker2's reply.
    """
    rpc = rpc_module(backend)
    futures = _modules(backend)[1]
    out = futures.Future()
    seen: dict[str, Any] = {"body": _current_context(backend)}
    done = futures.Future()
    done.set_result(None)
    done.then(lambda _: seen.__setitem__("inline_callback", _current_context(backend)))

    def on_reply(fut: Any) -> None:
        try:
            seen["reply_callback"] = _current_context(backend)
            _, seen["body_rpc_callee"] = fut.wait()
            callee = rpc.rpc_async("worker2", _report_context, args=(backend,))
            callee.then(lambda f: out.set_result({**seen, "callback_rpc_callee": f.wait()}))
        except Exception as exc:  # pragma: no cover - reported through the reply
            out.set_exception(exc)

    rpc.rpc_async("worker2", _pick(backend, _gated_double), args=(backend, key, x)).then(on_reply)
    rpc.rpc_async("worker2", _open_gate, args=(backend, key))
    return out


def _where_rpcs_join(ctx: Any) -> tuple[int, dict[str, Any]]:
    da = ctx.dist_autograd
    a = torch.rand(3, requires_grad=True)
    with da.context() as cid:
        seen = ctx.rpc.rpc_sync(
            "worker1", _pick(ctx.backend, _observe_joins), args=(ctx.backend, uuid.uuid4().hex, a)
        )
    return cid, seen


@pytest.mark.spec("DAG-3", "DAG-4")
def test_rpcs_in_an_async_body_join_the_context_and_rpcs_in_reply_callbacks_do_not(world: Any) -> None:
    cid, seen = world.run_on(0, _where_rpcs_join, world_size=3)
    assert seen == {
        "body": cid,
        "inline_callback": cid,
        "body_rpc_callee": cid,
        "reply_callback": None,
        "callback_rpc_callee": None,
    }


# -- the gradient cannot cross an RPC made in a reply callback (DAG-7; deviation DEV-4 on torch) ----
def _sin_twice(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


@_async_udf
def _relay_in_reply_callback(backend: str, key: str, x: torch.Tensor) -> Any:
    """On worker1: forwards ``x`` to worker2 and, from the reply's callback, RPCs the result again."""
    rpc = rpc_module(backend)
    out = _modules(backend)[1].Future()

    def on_reply(fut: Any) -> None:
        try:
            y, _ = fut.wait()
            again = rpc.rpc_async("worker2", _sin_twice, args=(y,))  # not attached: no context here
            again.then(lambda f: out.set_result(f.wait()))
        except Exception as exc:  # pragma: no cover - reported through the reply
            out.set_exception(exc)

    rpc.rpc_async("worker2", _pick(backend, _gated_double), args=(backend, key, x)).then(on_reply)
    rpc.rpc_async("worker2", _open_gate, args=(backend, key))
    return out


_RELAY_DONE: dict[int, bool] = {}


def _signal_relay_done(rank: int, graceful: bool) -> None:
    _RELAY_DONE[rank] = graceful


def _backward_through_callback_rpc(ctx: Any) -> Any:
    ctx.init_rpc()
    da, rpc = ctx.dist_autograd, ctx.rpc
    if ctx.rank != 0:  # serve until rank 0 has its answer, then leave as it does
        while ctx.rank not in _RELAY_DONE:
            ctx.sleep(0.05)
        rpc.shutdown(graceful=_RELAY_DONE.pop(ctx.rank))
        return None
    a = torch.rand(3, requires_grad=True)
    box: list[Any] = []
    relay = _pick(ctx.backend, _relay_in_reply_callback)

    def run() -> None:
        with da.context() as cid:
            r = rpc.rpc_sync("worker1", relay, args=(ctx.backend, uuid.uuid4().hex, a))
            box.append(outcome(lambda: da.backward(cid, [(r * a).sum()])))

    if ctx.simulated:  # one OS thread runs every worker: a blocked thread would stop them all
        run()
    else:
        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(5.0)  # PyTorch's FAST mode waits forever here (observed on torch 2.13.0)
    result = box[0] if box else "hung"
    graceful = result != "hung"  # a hung pass would keep a graceful shutdown waiting too
    for r in (1, 2):
        rpc.rpc_sync(ctx.name(r), _signal_relay_done, args=(r, graceful))
    rpc.shutdown(graceful=graceful)
    return result


@pytest.mark.spec("DAG-7")
def test_backward_through_an_rpc_made_in_a_reply_callback_raises_naming_the_unlinked_rpc(world: Any) -> None:
    result = world.spawn(_backward_through_callback_rpc, world_size=3)[0]
    assert result != "hung", "backward hung: a send function got no gradient (PyTorch FAST mode)"
    kinds, msg = result
    assert "RuntimeError" in kinds
    assert "received no gradient" in msg
    assert "_relay_in_reply_callback" in msg and "worker1" in msg
    assert "Future callback" in msg  # the hint: where the chain of attached RPCs was broken
