"""rpc_sync / rpc_async / remote: dispatch, destinations, self-RPC, nesting, @async_execution, RRef proxies.

Worker programs are module-level ``_prog_*(ctx, ...)`` functions; the UDFs they send are module-level too
(pickled by reference). A UDF that needs the RPC API itself receives the module's dotted name
(``ctx.rpc.__name__``) and imports it, so one UDF serves torch.distributed.rpc and twinrpc.rpc alike.

``@async_execution`` must be applied when the UDF is defined, before the backend is known, so
:func:`_per_rpc_module` binds one decorated copy per RPC implementation as a module global
(``<name>_torch`` / ``<name>_twinrpc``) and :func:`_pick` selects the copy for ``ctx``.
"""

from __future__ import annotations

import importlib
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

_RPC_MODULES = {"torch": "torch.distributed.rpc", "twinrpc": "twinrpc.rpc"}


def _suffix(rpc_module_name: str) -> str:
    return "torch" if rpc_module_name.startswith("torch.") else "twinrpc"


def _pick(ctx: Any, name: str) -> Any:
    """The module global ``name`` decorated with ``ctx.rpc.functions.async_execution``."""
    return globals()[f"{name}_{_suffix(ctx.rpc.__name__)}"]


def _rename(obj: Any, qualname: str) -> None:
    obj.__name__ = qualname.rsplit(".", 1)[-1]
    obj.__qualname__ = qualname
    obj.__module__ = __name__


def _per_rpc_module(make: Callable[[Callable[[Any], Any]], Any]) -> Callable[..., Any]:
    """Bind ``make(async_execution)`` as ``<make name>_<suffix>`` for every importable RPC module.

    The result (a function or a class) gets a qualname matching its global name, and so do the methods of
    a class, so that both backends pickle them by reference and resolve them on the callee.
    """
    base = make.__name__.removeprefix("_make_")
    for suffix, module_name in _RPC_MODULES.items():
        try:
            async_execution = importlib.import_module(module_name).functions.async_execution
        except Exception:  # the implementation under development may not import yet
            continue
        name = f"{base}_{suffix}"
        obj = make(async_execution)
        _rename(obj, name)
        if isinstance(obj, type):
            for attr, member in list(vars(obj).items()):
                func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                if callable(func) and getattr(func, "__module__", None) == __name__:
                    _rename(func, f"{name}.{attr}")
        globals()[name] = obj
    return make


def _module(name: str) -> Any:
    return importlib.import_module(name)


# ---------------------------------------------------------------- UDFs (run on the callee)


def _whoami(rpc_name: str) -> str:
    return _module(rpc_name).get_worker_info().name


def _describe_call(rpc_name: str, a: Any, b: Any = 0, *, scale: int = 1) -> tuple[str, Any]:
    return _module(rpc_name).get_worker_info().name, (a + b) * scale


def _mutate_and_return(items: list[int], t: torch.Tensor) -> tuple[list[int], list[float]]:
    items.append(99)
    t.add_(100)
    return items, t.tolist()


def _hop(rpc_name: str, to: str, x: int) -> tuple[str, str]:
    """Run on the callee: RPC to ``to`` (maybe the caller) and report where both ends ran."""
    rpc = _module(rpc_name)
    here = rpc.get_worker_info().name
    there = rpc.rpc_sync(to, _whoami, (rpc_name,))
    return here, f"{there}:{x + 1}"


def _double_hop(rpc_name: str, first: str, second: str) -> list[str]:
    rpc = _module(rpc_name)
    here = rpc.get_worker_info().name
    inner = rpc.rpc_sync(first, _hop, (rpc_name, second, 0))
    return [here, *inner]


_SLOTS: dict[str, Any] = {}


def _slot(futures_name: str, key: str) -> Any:
    """A Future per key on this worker; whichever of wait/release arrives first creates it.

    The two requests may run at the same time on two request threads: ``setdefault`` is atomic, so
    both always get the same Future (a get-then-create here once lost the release).
    """
    fut = _SLOTS.get(key)
    if fut is None:
        fut = _SLOTS.setdefault(key, _module(futures_name).Future())
    return fut


def _release(futures_name: str, key: str, value: Any) -> None:
    _slot(futures_name, key).set_result(value)


@_per_rpc_module
def _make_wait_for_release(async_execution: Any) -> Any:
    @async_execution
    def wait_for_release(futures_name: str, key: str) -> Any:
        return _slot(futures_name, key)

    return wait_for_release


@_per_rpc_module
def _make_async_add_then_double(async_execution: Any) -> Any:
    @async_execution
    def async_add_then_double(rpc_name: str, to: str, x: torch.Tensor, y: int) -> Any:
        fut = _module(rpc_name).rpc_async(to, torch.add, args=(x, y))
        return fut.then(lambda f: f.wait() * 2)

    return async_add_then_double


@_per_rpc_module
def _make_async_returns_int(async_execution: Any) -> Any:
    @async_execution
    def async_returns_int(x: int) -> Any:
        return x + 1

    return async_returns_int


@_per_rpc_module
def _make_AsyncHolder(async_execution: Any) -> Any:
    class AsyncHolder:
        """Held in an RRef; ``add_remote`` is @async_execution, used through the RRef proxies."""

        def __init__(self, base: int) -> None:
            self.base = base

        @async_execution
        def add_remote(self, rpc_name: str, to: str, x: torch.Tensor) -> Any:
            fut = _module(rpc_name).rpc_async(to, torch.add, args=(x, self.base))
            return fut.then(lambda f: f.wait() + 1)

        @staticmethod
        @async_execution
        def static_add(rpc_name: str, to: str, x: torch.Tensor) -> Any:
            return _module(rpc_name).rpc_async(to, torch.add, args=(x, 10))

    return AsyncHolder


@_per_rpc_module
def _make_Batcher(async_execution: Any) -> Any:
    class Batcher:
        """PyTorch's async-execution tutorial pattern, held in an RRef: a lock collects calls into a
        batch, and each call returns ``then`` of the batch's ``torch.futures.Future`` (a
        ``torch._C.Future``), so its reply waits until the batch is full."""

        def __init__(self, size: int) -> None:
            self.size = size
            self.lock = threading.Lock()
            self.pending: list[torch.Tensor] = []
            self.batch: Any = torch.futures.Future()

        def _join(self, x: torch.Tensor) -> Any:
            with self.lock:
                slot = len(self.pending)
                self.pending.append(x)
                batch, full = self.batch, len(self.pending) == self.size
                if full:
                    values, self.pending, self.batch = (
                        torch.stack(self.pending) * 2,
                        [],
                        torch.futures.Future(),
                    )
            mine = batch.then(lambda f: f.wait()[slot])
            if full:
                batch.set_result(values)
            return mine

        @async_execution
        def add(self, x: torch.Tensor) -> Any:
            return self._join(x)

        @staticmethod
        @async_execution
        def static_add(rref: Any, x: torch.Tensor) -> Any:
            return rref.local_value()._join(x)

        @classmethod
        @async_execution
        def class_add(cls, rref: Any, x: torch.Tensor) -> Any:
            return rref.local_value()._join(x)

    return Batcher


def _relay(rpc_name: str, to: str, xs: list[torch.Tensor]) -> list[Any]:
    """One user-made ``torch.futures.Future`` per ``x``, completed by a ``then`` of an ``rpc_async``."""
    rpc = _module(rpc_name)
    futs = [torch.futures.Future() for _ in xs]
    for fut, x in zip(futs, xs, strict=True):
        rpc.rpc_async(to, torch.add, args=(x, 1)).then(lambda f, fut=fut: fut.set_result(f.wait()))
    return futs


@_per_rpc_module
def _make_async_collect_all_then(async_execution: Any) -> Any:
    @async_execution
    def async_collect_all_then(rpc_name: str, to: str, xs: list[torch.Tensor]) -> Any:
        ready = torch.futures.collect_all(_relay(rpc_name, to, xs))  # a torch._C.Future
        return ready.then(lambda f: torch.stack([g.wait() for g in f.wait()]).sum(0))

    return async_collect_all_then


@_per_rpc_module
def _make_async_wait_all_then(async_execution: Any) -> Any:
    @async_execution
    def async_wait_all_then(rpc_name: str, to: str, xs: list[torch.Tensor]) -> Any:
        futs = _relay(rpc_name, to, xs)
        return torch.futures.collect_all(futs).then(
            lambda _: torch.stack(torch.futures.wait_all(futs)).sum(0)
        )

    return async_wait_all_then


@_per_rpc_module
def _make_async_collect_all_of_rpcs(async_execution: Any) -> Any:
    @async_execution
    def async_collect_all_of_rpcs(rpc_name: str, to: str, xs: list[torch.Tensor]) -> Any:
        rpc = _module(rpc_name)
        futs = [rpc.rpc_async(to, torch.add, args=(x, 1)) for x in xs]
        return torch.futures.collect_all(futs).then(
            lambda f: torch.stack([g.wait() for g in f.wait()]).sum(0)
        )

    return async_collect_all_of_rpcs


class Counter:
    """A user-defined object held in an RRef on its owner."""

    def __init__(self, start: int) -> None:
        self.count = start

    def increment(self, by: int = 1) -> int:
        self.count += by
        return self.count

    def get(self) -> int:
        return self.count


# ---------------------------------------------------------------- programs (run on rank 0 unless noted)


def _prog_builtins(ctx: Any) -> list[list[float]]:
    t = torch.ones(3)
    return [
        ctx.rpc.rpc_sync("worker1", torch.add, args=(t, 1)).tolist(),
        ctx.rpc.rpc_sync("worker1", torch.mul, args=(t,), kwargs={"other": 3}).tolist(),
        ctx.rpc.rpc_sync("worker1", torch.add, args=(t, t), kwargs={"alpha": 2}).tolist(),
        ctx.rpc.rpc_async("worker1", torch.mul, args=(t,), kwargs={"other": 4}).wait().tolist(),
        ctx.rpc.remote("worker1", torch.mul, args=(t,), kwargs={"other": 5}).to_here().tolist(),
    ]


def _prog_udf_three_apis(ctx: Any) -> list[Any]:
    name = ctx.rpc.__name__
    kwargs = {"scale": 10}
    return [
        ctx.rpc.rpc_sync("worker1", _describe_call, args=(name, 1, 2), kwargs=kwargs),
        ctx.rpc.rpc_async("worker1", _describe_call, args=(name, 3), kwargs=kwargs).wait(),
        ctx.rpc.remote("worker1", _describe_call, args=(name, 4, 1)).to_here(),
    ]


def _prog_destination_forms(ctx: Any) -> list[str]:
    name = ctx.rpc.__name__
    info = ctx.rpc.get_worker_info("worker1")
    return (
        [ctx.rpc.rpc_sync(to, _whoami, args=(name,)) for to in ("worker1", 1, info)]
        + [ctx.rpc.rpc_async(to, _whoami, args=(name,)).wait() for to in ("worker1", 1, info)]
        + [ctx.rpc.remote(to, _whoami, args=(name,)).to_here() for to in ("worker1", 1, info)]
    )


def _prog_rpc_async_pending(ctx: Any, key: str) -> tuple[bool, bool, int]:
    futures_name = ctx.futures.__name__
    fut = ctx.rpc.rpc_async("worker1", _pick(ctx, "wait_for_release"), args=(futures_name, key))
    pending_after_call = fut.done()
    ctx.rpc.rpc_sync("worker1", _release, args=(futures_name, key, 42))
    value = fut.wait()
    return pending_after_call, fut.done(), value


def _prog_remote_pending(ctx: Any, key: str) -> tuple[str, bool, int]:
    futures_name = ctx.futures.__name__
    rref = ctx.rpc.remote("worker1", _pick(ctx, "wait_for_release"), args=(futures_name, key))
    owner = rref.owner_name()
    ctx.rpc.rpc_sync("worker1", _release, args=(futures_name, key, 7))
    return owner, rref.is_owner(), rref.to_here()


def _prog_many_async(ctx: Any, n: int) -> list[tuple[str, int]]:
    name = ctx.rpc.__name__
    futs = [ctx.rpc.rpc_async(ctx.name(i % ctx.world_size), _describe_call, args=(name, i)) for i in range(n)]
    return [f.wait() for f in futs]


def _prog_remote_ownership(ctx: Any) -> tuple[str, int, bool, bool, list[float]]:
    rref = ctx.rpc.remote("worker1", torch.add, args=(torch.zeros(2), 3))
    owner = rref.owner()
    return (
        rref.owner_name(),
        owner.id,
        owner == ctx.rpc.get_worker_info("worker1"),
        rref.is_owner(),
        (rref.to_here().tolist()),
    )


def _prog_non_callable(ctx: Any, api: str) -> tuple[str, str]:
    try:
        getattr(ctx.rpc, api)("worker1", 3, args=(1,))
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _prog_remote_non_callable(ctx: Any) -> str:
    try:
        ctx.rpc.remote("worker1", "not a function").to_here()
    except TypeError:
        return "TypeError"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _call(ctx: Any, api: str, to: Any) -> Any:
    fn = getattr(ctx.rpc, api)
    result = fn(to, _whoami, args=(ctx.rpc.__name__,))
    if api == "rpc_async":
        return result.wait()
    if api == "remote":
        return result.to_here()
    return result


def _prog_bad_destination(ctx: Any, api: str, to: Any) -> tuple[str, str]:
    try:
        _call(ctx, api, to)
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _prog_self_rpc(ctx: Any) -> list[Any]:
    me = ctx.name(ctx.rank)
    rref = ctx.rpc.remote(me, torch.add, args=(torch.ones(2), 1))
    return [
        ctx.rpc.rpc_sync(me, _whoami, args=(ctx.rpc.__name__,)),
        ctx.rpc.rpc_async(me, torch.add, args=(torch.ones(2), 2)).wait().tolist(),
        rref.is_owner(),
        rref.to_here().tolist(),
        ctx.rpc.remote(me, _describe_call, args=(ctx.rpc.__name__, 5)).to_here(),
    ]


def _prog_callee_mutation(ctx: Any, to: str) -> list[Any]:
    items, t = [1, 2], torch.zeros(2)
    out = [
        ctx.rpc.rpc_sync(to, _mutate_and_return, args=(items, t)),
        ctx.rpc.rpc_async(to, _mutate_and_return, args=(items, t)).wait(),
        ctx.rpc.remote(to, _mutate_and_return, args=(items, t)).to_here(),
    ]
    return [out, items, t.tolist()]


def _prog_nested_back_to_caller(ctx: Any) -> tuple[str, str]:
    return ctx.rpc.rpc_sync("worker1", _hop, args=(ctx.rpc.__name__, "worker0", 41))


def _prog_nested_three_workers(ctx: Any) -> list[Any]:
    name = ctx.rpc.__name__
    return [
        ctx.rpc.rpc_sync("worker1", _hop, args=(name, "worker2", 1)),
        ctx.rpc.rpc_async("worker1", _double_hop, args=(name, "worker2", "worker0")).wait(),
        ctx.rpc.remote("worker2", _double_hop, args=(name, "worker1", "worker0")).to_here(),
    ]


def _prog_async_execution_chain(ctx: Any) -> list[list[float]]:
    udf = _pick(ctx, "async_add_then_double")
    name = ctx.rpc.__name__
    return [
        ctx.rpc.rpc_sync("worker1", udf, args=(name, "worker0", torch.ones(2), 3)).tolist(),
        ctx.rpc.rpc_async("worker1", udf, args=(name, "worker1", torch.ones(2), 1)).wait().tolist(),
        ctx.rpc.remote("worker1", udf, args=(name, "worker0", torch.zeros(2), 5)).to_here().tolist(),
    ]


def _prog_async_execution_staticmethod(ctx: Any) -> list[list[float]]:
    holder = _pick(ctx, "AsyncHolder")
    name = ctx.rpc.__name__
    return [
        ctx.rpc.rpc_sync("worker1", holder.static_add, args=(name, "worker0", torch.ones(1))).tolist(),
        ctx.rpc.rpc_async("worker1", holder.static_add, args=(name, "worker1", torch.ones(1)))
        .wait()
        .tolist(),
    ]


def _prog_async_execution_non_future(ctx: Any, api: str) -> tuple[str, str]:
    udf = _pick(ctx, "async_returns_int")
    try:
        if api == "rpc_sync":
            ctx.rpc.rpc_sync("worker1", udf, args=(1,))
        elif api == "rpc_async":
            ctx.rpc.rpc_async("worker1", udf, args=(1,)).wait()
        else:
            ctx.rpc.remote("worker1", udf, args=(1,)).to_here()
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _prog_async_execution_via_proxy(ctx: Any) -> list[list[float]]:
    rref = ctx.rpc.remote("worker1", _pick(ctx, "AsyncHolder"), args=(5,))
    name = ctx.rpc.__name__
    x = torch.ones(1)
    return [
        rref.rpc_sync().add_remote(name, "worker0", x).tolist(),
        rref.rpc_async().add_remote(name, "worker1", x).wait().tolist(),
        rref.remote().add_remote(name, "worker0", x).to_here().tolist(),
    ]


def _prog_async_execution_batches(ctx: Any) -> list[list[float]]:
    """Three batches of two calls each, every call in another form; each reply waits for its batch."""
    batcher = _pick(ctx, "Batcher")
    rref = ctx.rpc.remote("worker1", batcher, args=(2,))
    t = torch.tensor
    first = [
        ctx.rpc.rpc_async("worker1", batcher.static_add, args=(rref, t([1.0]))),
        rref.rpc_async().add(t([2.0])),
    ]
    second = [
        ctx.rpc.rpc_async("worker1", batcher.class_add, args=(rref, t([3.0]))),
        rref.remote().add(t([4.0])),
    ]
    third = ctx.rpc.remote("worker1", batcher.class_add, args=(rref, t([5.0])))
    last = rref.rpc_sync().add(t([6.0]))
    return [
        *(f.wait().tolist() for f in first),
        second[0].wait().tolist(),
        second[1].to_here().tolist(),
        third.to_here().tolist(),
        last.tolist(),
    ]


def _prog_async_execution_combined(ctx: Any, udf_name: str) -> list[list[float]]:
    udf = _pick(ctx, udf_name)
    name = ctx.rpc.__name__
    xs = [torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)]
    return [
        ctx.rpc.rpc_sync("worker1", udf, args=(name, "worker0", xs)).tolist(),
        ctx.rpc.rpc_async("worker1", udf, args=(name, "worker1", xs)).wait().tolist(),
        ctx.rpc.remote("worker1", udf, args=(name, "worker0", xs)).to_here().tolist(),
    ]


def _prog_rref_proxies(ctx: Any) -> list[Any]:
    rref = ctx.rpc.remote("worker1", Counter, args=(10,))
    return [
        rref.rpc_sync().increment(),
        rref.rpc_async().increment(by=5).wait(),
        rref.remote().increment(2).to_here(),
        rref.rpc_sync().get(),
        rref.to_here().count,
    ]


def _prog_rref_proxy_missing_method(ctx: Any, held: str) -> list[tuple[str, str]]:
    if held == "Counter":
        rref = ctx.rpc.remote("worker1", Counter, args=(0,))
    else:
        rref = ctx.rpc.remote("worker1", torch.ones, args=([2],))
    out = []
    for call in (
        lambda: rref.rpc_sync().no_such_method(),
        lambda: rref.rpc_async().no_such_method().wait(),
        lambda: rref.remote().no_such_method().to_here(),
    ):
        try:
            call()
            out.append(("no error", ""))
        except Exception as e:
            out.append((type(e).__name__, str(e)))
    return out


# ---------------------------------------------------------------- tests


@pytest.mark.spec("RPC-1", "RPC-2", "RPC-3")
def test_builtin_ops_run_on_callee_with_args_and_kwargs(world: Any) -> None:
    assert world.run_on(0, _prog_builtins) == [
        [2.0, 2.0, 2.0],
        [3.0, 3.0, 3.0],
        [3.0, 3.0, 3.0],
        [4.0, 4.0, 4.0],
        [5.0, 5.0, 5.0],
    ]


@pytest.mark.spec("RPC-1", "RPC-2", "RPC-3")
def test_python_udf_runs_on_destination_with_args_and_kwargs(world: Any) -> None:
    assert world.run_on(0, _prog_udf_three_apis) == [("worker1", 30), ("worker1", 30), ("worker1", 5)]


@pytest.mark.spec("RPC-5")
def test_destination_given_as_name_rank_or_worker_info_resolves_same_worker(world: Any) -> None:
    assert world.run_on(0, _prog_destination_forms, world_size=3) == ["worker1"] * 9


@pytest.mark.spec("RPC-1")
def test_rpc_async_returns_pending_future_before_callee_replies(world: Any) -> None:
    pending, done_after_wait, value = world.run_on(0, _prog_rpc_async_pending, uuid.uuid4().hex)
    assert (pending, done_after_wait, value) == (False, True, 42)


@pytest.mark.spec("RPC-2")
def test_remote_returns_rref_before_value_is_produced(world: Any) -> None:
    assert world.run_on(0, _prog_remote_pending, uuid.uuid4().hex) == ("worker1", False, 7)


@pytest.mark.spec("RPC-1")
def test_many_concurrent_rpc_async_each_future_gets_its_own_result(world: Any) -> None:
    n = 60
    results = world.run_on(0, _prog_many_async, n, world_size=3)
    assert results == [(f"worker{i % 3}", i) for i in range(n)]


@pytest.mark.spec("RPC-1")
def test_all_ranks_calling_each_other_concurrently_get_their_results(world: Any) -> None:
    results = world.run(_prog_many_async, 12, world_size=3)
    assert results == [[(f"worker{i % 3}", i) for i in range(12)]] * 3


@pytest.mark.spec("RPC-2")
def test_remote_rref_is_owned_by_destination_and_to_here_fetches_value(world: Any) -> None:
    assert world.run_on(0, _prog_remote_ownership) == ("worker1", 1, True, False, [3.0, 3.0])


@pytest.mark.spec("RPC-4")
@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async"])
def test_non_callable_func_raises_type_error(world: Any, api: str) -> None:
    assert world.run_on(0, _prog_non_callable, api) == ("TypeError", "function should be callable.")


@pytest.mark.spec("RPC-4")
def test_remote_with_non_callable_func_fails_with_type_error(world: Any) -> None:
    """PyTorch's remote() does not check callability up front; to_here() raises the callee's TypeError."""
    assert world.run_on(0, _prog_remote_non_callable) == "TypeError"


@pytest.mark.spec("RPC-5")
@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
def test_unknown_destination_name_raises_runtime_error(world: Any, api: str) -> None:
    kind, msg = world.run_on(0, _prog_bad_destination, api, "no_such_worker")
    assert kind == "RuntimeError"
    assert "could not find destination name no_such_worker" in msg


@pytest.mark.spec("RPC-5")
@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
def test_out_of_range_rank_raises_runtime_error(world: Any, api: str) -> None:
    kind, msg = world.run_on(0, _prog_bad_destination, api, 7)
    assert kind == "RuntimeError"
    assert "could not find destination id 7" in msg


@pytest.mark.spec("RPC-5")
def test_float_destination_raises_value_error(world: Any) -> None:
    assert world.run_on(0, _prog_bad_destination, "rpc_sync", 1.5) == (
        "ValueError",
        "Cannot get WorkerInfo from name 1.5",
    )


@pytest.mark.spec("RPC-6")
@pytest.mark.parametrize("world_size", [1, 2])
def test_self_rpc_works_for_all_three_apis(world: Any, world_size: int) -> None:
    assert world.run_on(0, _prog_self_rpc, world_size=world_size) == [
        "worker0",
        [3.0, 3.0],
        True,
        [2.0, 2.0],
        ("worker0", 5),
    ]


@pytest.mark.spec("RPC-6", "RPC-8")
@pytest.mark.parametrize("to", ["worker0", "worker1"])
def test_callee_cannot_mutate_caller_arguments(world: Any, to: str) -> None:
    out, items, t = world.run_on(0, _prog_callee_mutation, to)
    assert out == [([1, 2, 99], [100.0, 100.0])] * 3  # every call saw a fresh copy
    assert items == [1, 2]
    assert t == [0.0, 0.0]


@pytest.mark.spec("RPC-7")
def test_nested_rpc_from_callee_back_to_its_caller(world: Any) -> None:
    assert world.run_on(0, _prog_nested_back_to_caller) == ("worker1", "worker0:42")


@pytest.mark.spec("RPC-7")
def test_nested_rpc_through_a_third_worker(world: Any) -> None:
    assert world.run_on(0, _prog_nested_three_workers, world_size=3) == [
        ("worker1", "worker2:2"),
        ["worker1", "worker2", "worker0:1"],
        ["worker2", "worker1", "worker0:1"],
    ]


@pytest.mark.spec("RPC-14")
def test_async_execution_replies_with_value_of_returned_future_chain(world: Any) -> None:
    assert world.run_on(0, _prog_async_execution_chain) == [[8.0, 8.0], [4.0, 4.0], [10.0, 10.0]]


@pytest.mark.spec("RPC-14")
def test_async_execution_works_as_staticmethod(world: Any) -> None:
    assert world.run_on(0, _prog_async_execution_staticmethod) == [[11.0], [11.0]]


@pytest.mark.spec("RPC-14")
@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
def test_async_execution_function_not_returning_future_raises_runtime_error(world: Any, api: str) -> None:
    kind, msg = world.run_on(0, _prog_async_execution_non_future, api)
    assert kind == "RuntimeError"
    assert "must return a torch.futures.Future object" in msg


@pytest.mark.spec("RPC-14", "RPC-15", "RPC-17")
def test_async_execution_accepts_then_of_a_torch_future_in_every_form(world: Any) -> None:
    # The tutorial's batching pattern: a ``then`` of a user-made torch.futures.Future is a torch._C.Future.
    assert world.run_on(0, _prog_async_execution_batches) == [[2.0], [4.0], [6.0], [8.0], [10.0], [12.0]]


@pytest.mark.spec("RPC-14", "RPC-17")
@pytest.mark.parametrize(
    "udf", ["async_collect_all_then", "async_wait_all_then", "async_collect_all_of_rpcs"]
)
def test_async_execution_accepts_collect_all_and_wait_all_chains(world: Any, udf: str) -> None:
    # (1 + 1) + (2 + 1) + (3 + 1) per element, through every API
    assert world.run_on(0, _prog_async_execution_combined, udf) == [[9.0, 9.0]] * 3


@pytest.mark.spec("RPC-14", "RPC-15")
def test_async_execution_method_through_rref_proxies(world: Any) -> None:
    assert world.run_on(0, _prog_async_execution_via_proxy) == [[7.0], [7.0], [7.0]]


@pytest.mark.spec("RPC-15")
def test_rref_proxies_call_methods_on_the_owners_object(world: Any) -> None:
    # Every proxy call mutates the one object on the owner; to_here() then returns a copy of it.
    assert world.run_on(0, _prog_rref_proxies) == [11, 16, 18, 18, 18]


@pytest.mark.spec("RPC-15")
@pytest.mark.parametrize("held", ["Counter", "Tensor"])
def test_rref_proxy_missing_method_raises_attribute_error(world: Any, held: str) -> None:
    out = world.run_on(0, _prog_rref_proxy_missing_method, held)
    expected = f"type object '{held}' has no attribute 'no_such_method'"
    assert [kind for kind, _ in out] == ["AttributeError"] * 3
    assert all(expected in msg for _, msg in out), out
