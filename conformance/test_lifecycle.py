"""init_rpc / shutdown lifecycle: names, argument checks, re-initialisation, worker infos (LIFE-*, ERR-8).

Tests that initialise RPC themselves use ``world.spawn`` (a fresh world per test). Programs return plain
data, usually ``_outcome(...)`` pairs: ``("ok", value)`` or ``(builtin exception kinds, message)``.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance._support import outcome

NOT_INITIALIZED = "RPC has not been initialized"
NAME_RULE = "Worker name must match"


def _echo(x: Any) -> Any:
    return x


def _callee(backend: str, tag: Any = None) -> Any:
    """Runs on the callee: its own worker name (proves where the call ran), plus ``tag``."""
    if backend == "torch":
        import torch.distributed.rpc as rpc
    else:
        import twinrpc.rpc as rpc
    return (rpc.get_worker_info().name, tag)


_outcome = outcome


def _unusable_api_calls(ctx: Any) -> dict[str, tuple[str, Any]]:
    """Every RPC entry point, called while RPC is not initialised."""
    rpc = ctx.rpc
    return {
        "rpc_sync": _outcome(lambda: rpc.rpc_sync("worker1", _echo, args=(1,))),
        "rpc_async": _outcome(lambda: rpc.rpc_async("worker1", _echo, args=(1,))),
        "remote": _outcome(lambda: rpc.remote("worker1", _echo, args=(1,))),
        "get_worker_info()": _outcome(lambda: rpc.get_worker_info()),
        "get_worker_info(name)": _outcome(lambda: rpc.get_worker_info("worker1")),
    }


# ---------------------------------------------------------------------------------------------------
# Worker programs
# ---------------------------------------------------------------------------------------------------


def _prog_before_init(ctx: Any) -> dict[str, tuple[str, Any]]:
    out = _unusable_api_calls(ctx)
    out["shutdown"] = _outcome(ctx.rpc.shutdown)
    return out


def _prog_rref_before_init(ctx: Any) -> tuple[str, Any]:
    return _outcome(lambda: ctx.rpc.RRef(5))


def _prog_after_shutdown(ctx: Any) -> dict[str, tuple[str, Any]]:
    ctx.init_rpc()
    ctx.rpc.rpc_sync(ctx.name((ctx.rank + 1) % ctx.world_size), _echo, args=(0,))
    ctx.rpc.shutdown()
    return _unusable_api_calls(ctx)


def _prog_worker_info_names(ctx: Any, names: list[str]) -> dict[str, tuple[str, Any]]:
    out = {}
    for name in names:
        got = _outcome(lambda name=name: ctx.rpc.WorkerInfo(name, 0))
        out[name] = (got[0], got[1] if got[0] != "ok" else (got[1].name, got[1].id))
    return out


def _prog_init_invalid_name_then_valid(ctx: Any) -> dict[str, Any]:
    bad = _outcome(lambda: ctx.init_rpc(name=["bad name", "bad.name"][ctx.rank]))
    after_bad = _outcome(ctx.rpc.get_worker_info)
    ctx.init_rpc()
    out = {
        "bad": bad,
        "after_bad": after_bad,
        "call": ctx.rpc.rpc_sync(ctx.name(1 - ctx.rank), _callee, args=(ctx.backend,)),
    }
    ctx.rpc.shutdown()
    return out


def _prog_duplicate_names(ctx: Any) -> tuple[str, Any]:
    # No shutdown: a failed init leaves nothing to shut down, and the spawned world is thrown away.
    return _outcome(lambda: ctx.init_rpc(name="same-name"))


def _prog_bad_init_arguments(ctx: Any) -> dict[str, Any]:
    out = {
        "backend": _outcome(lambda: ctx.rpc.init_rpc("worker0", backend="TENSORPIPE", rank=0, world_size=1)),
        "options": _outcome(
            lambda: ctx.rpc.init_rpc(
                "worker0", rank=0, world_size=1, rpc_backend_options={"rpc_timeout": 3.0}
            )
        ),
        "still_uninitialised": _outcome(ctx.rpc.get_worker_info),
    }
    ctx.init_rpc()
    out["after_good_init"] = ctx.rpc.get_worker_info().name
    ctx.rpc.shutdown()
    return out


def _prog_init_twice(ctx: Any) -> dict[str, Any]:
    ctx.init_rpc()
    again = _outcome(lambda: ctx.init_rpc())
    out = {
        "again": again,
        "self": ctx.rpc.get_worker_info().name,
        "call": ctx.rpc.rpc_sync(ctx.name(1 - ctx.rank), _callee, args=(ctx.backend,)),
    }
    ctx.rpc.shutdown()
    return out


def _prog_reinit_after_shutdown(ctx: Any) -> dict[str, Any]:
    peer = ctx.name(1 - ctx.rank)
    ctx.init_rpc(rpc_timeout=7.5)
    first = (ctx.rpc.rpc_sync(peer, _callee, args=(ctx.backend, "first")), ctx.rpc.get_rpc_timeout())
    ctx.rpc.shutdown()
    ctx.init_rpc()
    second = (ctx.rpc.rpc_sync(peer, _callee, args=(ctx.backend, "second")), ctx.rpc.get_rpc_timeout())
    info = ctx.rpc.get_worker_info()
    ctx.rpc.shutdown()
    return {"first": first, "second": second, "self": (info.name, info.id)}


def _prog_worker_infos(ctx: Any) -> dict[str, Any]:
    me = ctx.rpc.get_worker_info()
    infos = [ctx.rpc.get_worker_info(ctx.name(r)) for r in range(ctx.world_size)]
    return {
        "self": (me.name, me.id),
        "self_equals_by_name": me == ctx.rpc.get_worker_info(ctx.name(ctx.rank)),
        "by_name": [(i.name, i.id) for i in infos],
        "distinct_hashes": len({hash(i) for i in infos}),
    }


def _prog_unknown_worker_name(ctx: Any) -> tuple[str, Any]:
    return _outcome(lambda: ctx.rpc.get_worker_info("no-such-worker"))


def _prog_num_worker_threads(ctx: Any) -> dict[str, Any]:
    options = ctx.options(num_worker_threads=4)
    ctx.rpc.init_rpc(
        ctx.name(ctx.rank), rank=ctx.rank, world_size=ctx.world_size, rpc_backend_options=options
    )
    out = {
        "option": options.num_worker_threads,
        "calls": [ctx.rpc.rpc_sync(ctx.name(1 - ctx.rank), _callee, args=(ctx.backend, i)) for i in range(3)],
    }
    ctx.rpc.shutdown()
    return out


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


def _assert_not_initialized(outcomes: dict[str, tuple[str, Any]]) -> None:
    for api, (kind, message) in outcomes.items():
        assert "RuntimeError" in kind, (api, kind, message)
        assert NOT_INITIALIZED in message, (api, message)


@pytest.mark.spec("ERR-8")
def test_every_api_before_init_rpc_raises_not_initialized(world):
    got = world.spawn(_prog_before_init, world_size=1)[0]
    assert set(got) == {
        "rpc_sync",
        "rpc_async",
        "remote",
        "get_worker_info()",
        "get_worker_info(name)",
        "shutdown",
    }
    _assert_not_initialized(got)


@pytest.mark.spec("ERR-8")
def test_creating_rref_without_an_agent_raises_runtime_error(world):
    kind, message = world.spawn(_prog_rref_before_init, world_size=1)[0]
    assert "RuntimeError" in kind, message
    assert "init_rpc" in message


@pytest.mark.spec("ERR-8", "SHUT-5")
def test_every_api_after_shutdown_raises_not_initialized(world):
    for outcomes in world.spawn(_prog_after_shutdown):
        _assert_not_initialized(outcomes)


INVALID_NAMES = ["", "a b", "w/1", "a.b", "tab\tname", "x" * 128, "x" * 300]
VALID_NAMES = ["a-b_c:1", "ABC", "x" * 127, "0"]


@pytest.mark.spec("LIFE-1")
def test_worker_info_rejects_names_outside_the_allowed_pattern_or_length(world):
    got = world.run_on(0, _prog_worker_info_names, INVALID_NAMES)
    for name in INVALID_NAMES:
        kind, message = got[name]
        assert "RuntimeError" in kind, (name, kind, message)
        assert NAME_RULE in message, (name, message)


@pytest.mark.spec("LIFE-1")
def test_worker_info_accepts_names_up_to_127_allowed_characters(world):
    got = world.run_on(0, _prog_worker_info_names, VALID_NAMES)
    assert got == {name: ("ok", (name, 0)) for name in VALID_NAMES}


@pytest.mark.spec("LIFE-1", "LIFE-6")
def test_init_rpc_with_invalid_name_fails_and_leaves_rpc_uninitialized(world):
    got = world.spawn(_prog_init_invalid_name_then_valid)
    for rank, result in enumerate(got):
        kind, message = result["bad"]
        assert "RuntimeError" in kind, result
        assert NAME_RULE in message
        assert ["bad name", "bad.name"][rank] in message
        assert "RuntimeError" in result["after_bad"][0], result
        assert NOT_INITIALIZED in result["after_bad"][1]
        assert result["call"] == (f"worker{1 - rank}", None)


@pytest.mark.spec("LIFE-2")
def test_duplicate_worker_names_fail_init_with_is_not_unique(world):
    got = world.spawn(_prog_duplicate_names, timeout=30)
    for kind, message in got:
        assert "RuntimeError" in kind, (kind, message)
        assert "same-name is not unique" in message


@pytest.mark.spec("LIFE-3")
def test_init_rpc_rejects_bad_backend_and_options_types_with_type_error(world):
    got = world.spawn(_prog_bad_init_arguments, world_size=1)[0]
    kinds, message = got["backend"]
    assert "TypeError" in kinds, got
    assert "Argument backend must be a member of BackendType" in message
    kinds, message = got["options"]
    assert "TypeError" in kinds, got
    assert "Argument rpc_backend_options must be an instance of RpcBackendOptions" in message
    assert "RuntimeError" in got["still_uninitialised"][0], got
    assert got["after_good_init"] == "worker0"


@pytest.mark.spec("LIFE-6")
def test_init_rpc_twice_raises_already_initialized_and_keeps_first_agent(world):
    got = world.spawn(_prog_init_twice)
    for rank, result in enumerate(got):
        kind, message = result["again"]
        assert "RuntimeError" in kind, result
        assert "is already initialized" in message
        assert result["self"] == f"worker{rank}"
        assert result["call"] == (f"worker{1 - rank}", None)


@pytest.mark.spec("LIFE-6", "LIFE-7")
def test_reinit_after_shutdown_with_fresh_options_works(world):
    got = world.spawn(_prog_reinit_after_shutdown)
    for rank, result in enumerate(got):
        peer = f"worker{1 - rank}"
        assert result["first"] == ((peer, "first"), 7.5)
        # The second world starts from its own options: the old rpc_timeout does not leak into it.
        assert result["second"] == ((peer, "second"), 60.0)
        assert result["self"] == (f"worker{rank}", rank)


@pytest.mark.spec("LIFE-7")
def test_worker_infos_have_ids_zero_to_n_minus_one_and_harness_names(world):
    got = world.run(_prog_worker_infos, world_size=3)
    expected = [(f"worker{r}", r) for r in range(3)]
    for rank, result in enumerate(got):
        assert result["self"] == (f"worker{rank}", rank)
        assert result["self_equals_by_name"] is True
        assert result["by_name"] == expected
        assert result["distinct_hashes"] == 3


@pytest.mark.spec("LIFE-7")
def test_get_worker_info_of_unknown_name_raises_runtime_error_naming_it(world):
    kind, message = world.run_on(1, _prog_unknown_worker_name)
    assert "RuntimeError" in kind
    assert "no-such-worker" in message


@pytest.mark.spec("LIFE-7")
def test_num_worker_threads_option_is_accepted(world):
    got = world.spawn(_prog_num_worker_threads)
    for rank, result in enumerate(got):
        assert result == {"option": 4, "calls": [(f"worker{1 - rank}", i) for i in range(3)]}
