"""Remote exceptions: what the caller gets when a user function raises on the callee (ERR-1..ERR-3).

Programs catch the exception on the caller and return plain data ``(type name, isinstance checks,
message)`` so the assertions stay in the test bodies.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance._support import rpc_module

# ---------------------------------------------------------------------------------------------------
# Exception types and user functions (module level: pickled by reference to real worker processes)
# ---------------------------------------------------------------------------------------------------


class RemoteBoom(Exception):
    """A user-defined exception whose constructor takes one message, like most exceptions."""


class TwoArgError(Exception):
    """An exception that cannot be rebuilt from a single string (ERR-2)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)


def _raise_value_error() -> None:
    raise ValueError("bad value 42")


def _raise_key_error() -> None:
    raise KeyError("missing-key-7")


def _raise_remote_boom() -> None:
    raise RemoteBoom("custom boom 9")


def _raise_two_arg_error() -> None:
    raise TwoArgError(3, "two-arg detail")


def _inner_raise_value_error() -> None:
    raise ValueError("inner boom 5")


def _outer_calls_worker2(backend: str) -> Any:
    return _rpc_module(backend).rpc_sync("worker2", _inner_raise_value_error)


def _echo(x: Any) -> Any:
    return x


_RAISERS = {
    "ValueError": _raise_value_error,
    "KeyError": _raise_key_error,
    "RemoteBoom": _raise_remote_boom,
    "TwoArgError": _raise_two_arg_error,
}


_rpc_module = rpc_module


def _invoke(ctx: Any, mode: str, to: str, fn: Any, args: tuple[Any, ...] = ()) -> Any:
    """Call ``fn`` on ``to`` through rpc_sync, rpc_async().wait() or remote().to_here()."""
    if mode == "rpc_sync":
        return ctx.rpc.rpc_sync(to, fn, args=args)
    if mode == "rpc_async":
        return ctx.rpc.rpc_async(to, fn, args=args).wait()
    if mode == "remote":
        return ctx.rpc.remote(to, fn, args=args).to_here()
    raise AssertionError(mode)


def _describe(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "is_runtime_error": isinstance(exc, RuntimeError),
        "is_type_error": isinstance(exc, TypeError),
        "message": str(exc),
    }


# ---------------------------------------------------------------------------------------------------
# Worker programs
# ---------------------------------------------------------------------------------------------------


def _prog_call_raiser(ctx: Any, mode: str, kind: str) -> dict[str, Any]:
    try:
        _invoke(ctx, mode, "worker1", _RAISERS[kind])
    except Exception as exc:
        return _describe(exc)
    return {"type": None}


def _prog_raise_then_echo(ctx: Any) -> Any:
    try:
        ctx.rpc.rpc_sync("worker1", _raise_value_error)
    except ValueError:
        pass
    return [ctx.rpc.rpc_sync("worker1", _echo, args=(i,)) for i in range(3)]


def _prog_builtin_op_error(ctx: Any) -> dict[str, Any]:
    import torch

    try:
        ctx.rpc.rpc_sync("worker1", torch.add, args=("not a tensor", 1))
    except Exception as exc:
        return _describe(exc)
    return {"type": None}


def _prog_nested(ctx: Any) -> dict[str, Any]:
    try:
        ctx.rpc.rpc_sync("worker1", _outer_calls_worker2, args=(ctx.backend,))
    except Exception as exc:
        return _describe(exc)
    return {"type": None}


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------

CALL_MODES = ["rpc_sync", "rpc_async", "remote"]


@pytest.mark.spec("ERR-1", "ERR-3")
@pytest.mark.parametrize("mode", CALL_MODES)
def test_udf_value_error_reaches_caller_with_type_worker_and_traceback(world, mode):
    got = world.run_on(0, _prog_call_raiser, mode, "ValueError")
    assert got["type"] == "ValueError"
    assert got["module"] == "builtins"
    message = got["message"]
    assert "On WorkerInfo(id=1, name=worker1)" in message
    assert "bad value 42" in message
    # The remote traceback is part of the message: it names the user function that raised.
    assert "_raise_value_error" in message
    assert "Traceback" in message


@pytest.mark.spec("ERR-1", "ERR-3")
@pytest.mark.parametrize("kind", ["RemoteBoom", "KeyError"])
def test_remote_udf_exception_keeps_its_exact_type_through_to_here(world, kind):
    got = world.run_on(0, _prog_call_raiser, "remote", kind)
    assert got["type"] == kind
    assert got["module"] == ("builtins" if kind == "KeyError" else __name__)
    assert "On WorkerInfo(id=1, name=worker1)" in got["message"]
    assert ("custom boom 9" if kind == "RemoteBoom" else "missing-key-7") in got["message"]
    assert _RAISERS[kind].__name__ in got["message"]


@pytest.mark.spec("ERR-1")
@pytest.mark.parametrize("kind", ["RemoteBoom", "KeyError"])
@pytest.mark.parametrize("mode", ["rpc_sync", "rpc_async"])
def test_rpc_call_reraises_custom_and_key_errors_with_their_own_type(world, mode, kind):
    """twinrpc keeps every single-string-constructible type; torch keeps only ValueError/TypeError here."""
    got = world.run_on(0, _prog_call_raiser, mode, kind)
    assert got["type"] == kind
    assert "On WorkerInfo(id=1, name=worker1)" in got["message"]
    assert _RAISERS[kind].__name__ in got["message"]


@pytest.mark.spec("ERR-2")
@pytest.mark.parametrize("mode", CALL_MODES)
def test_exception_that_cannot_be_rebuilt_becomes_runtime_error(world, mode):
    got = world.run_on(0, _prog_call_raiser, mode, "TwoArgError")
    assert got["is_runtime_error"], got
    message = got["message"]
    assert "Failed to create original exception type" in message
    # The original remote error is still described, with where it happened.
    assert "On WorkerInfo(id=1, name=worker1)" in message
    assert "TwoArgError" in message
    assert "two-arg detail" in message


@pytest.mark.spec("ERR-1")
def test_callee_keeps_serving_after_a_udf_raised(world):
    assert world.run_on(0, _prog_raise_then_echo) == [0, 1, 2]


@pytest.mark.spec("ERR-3")
def test_builtin_operator_error_is_a_runtime_error(world):
    # Called locally, torch.add("not a tensor", 1) raises TypeError; as an RPC builtin it is a RuntimeError.
    got = world.run_on(0, _prog_builtin_op_error)
    assert got["is_runtime_error"], got
    assert not got["is_type_error"], got


@pytest.mark.spec("ERR-1")
def test_exception_from_nested_rpc_names_both_remote_workers(world):
    got = world.run_on(0, _prog_nested, world_size=3)
    assert got["type"] == "ValueError"
    message = got["message"]
    assert "On WorkerInfo(id=1, name=worker1)" in message
    assert "On WorkerInfo(id=2, name=worker2)" in message
    assert "inner boom 5" in message
    assert "_inner_raise_value_error" in message
    assert "_outer_calls_worker2" in message
