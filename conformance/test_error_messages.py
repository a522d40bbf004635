"""PyTorch's words in error messages (LIFE-1, RPC-3, RPC-8, ERR-1, DAG-5).

Programs written for PyTorch match on fragments of its messages (``assertRaisesRegex`` in its own test
suite, ``except RuntimeError as e: if "..." in str(e)`` in user code). Each test here checks that the
fragment PyTorch 2.13 produces is in the message on every backend; twinrpc may add detail after it.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from conformance._support import outcome

NAME_RULE = (
    "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than 128 chars, but got "
)
NO_SCHEMA = "Overloaded torch operator invoked from Python failed to match any schema"
NOT_SERIALIZED = "RPC pickler does not serialize"
INCOMPATIBLE = "incompatible function arguments"


# -- LIFE-1: worker names ----------------------------------------------------------------------------
def _prog_bad_names(ctx: Any, names: list[str]) -> dict[str, Any]:
    return {name: outcome(lambda name=name: ctx.rpc.WorkerInfo(name, 0)) for name in names}


@pytest.mark.spec("LIFE-1")
def test_invalid_worker_name_message_starts_with_pytorchs_rule_and_the_name(world: Any) -> None:
    names = ["", "a b", "a.b", "x" * 128]
    got = world.run_on(0, _prog_bad_names, names)
    for name in names:
        kinds, message = got[name]
        assert "RuntimeError" in kinds, (name, got[name])
        assert message.startswith(NAME_RULE + name), (name, message)


# -- RPC-3: a builtin operator whose arguments match no schema --------------------------------------
def _prog_builtin_without_schema(ctx: Any) -> dict[str, Any]:
    rpc, to = ctx.rpc, ctx.name(1)
    args = (torch.ones(2), "x")
    return {
        # rpc_async and remote raise in the call itself, before anything is sent
        "rpc_sync": outcome(lambda: rpc.rpc_sync(to, torch.add, args=args)),
        "rpc_async": outcome(lambda: rpc.rpc_async(to, torch.add, args=args)),
        "remote": outcome(lambda: rpc.remote(to, torch.add, args=args)),
        "kwargs": outcome(
            lambda: rpc.rpc_sync(to, torch.add, args=(torch.ones(2), torch.ones(2)), kwargs={"bad": 1})
        ),
        "after": rpc.rpc_sync(to, torch.add, args=(torch.ones(2), 1)).tolist(),
    }


@pytest.mark.spec("RPC-3")
def test_builtin_with_arguments_matching_no_schema_raises_on_the_caller_with_pytorchs_words(
    world: Any,
) -> None:
    got = world.run_on(0, _prog_builtin_without_schema)
    for api in ("rpc_sync", "rpc_async", "remote", "kwargs"):
        kinds, message = got[api]
        assert "RuntimeError" in kinds and message.startswith(NO_SCHEMA), (api, got[api])
    assert "aten::add" in got["rpc_sync"][1]
    assert got["after"] == [2.0, 2.0]


# -- RPC-8: a function the callee does not have ------------------------------------------------------
def _worker_name() -> str | None:
    """The name of the worker running this code, on any backend."""
    for module in ("twinrpc.rpc", "torch.distributed.rpc"):
        try:
            return str(importlib.import_module(module).get_worker_info().name)
        except Exception:  # RPC of that library is not initialised in this process or task
            continue
    return None


def _defined_on_the_caller_only() -> str:
    return "ran"


# Pickled by reference as ``<this module>._missing_on_callee``: the module's ``__getattr__`` finds it
# only on worker0, so worker1 (a process of its own, or a simulated worker of the same process) cannot
# unpickle the request, as when the function is missing from the callee's copy of the module.
_defined_on_the_caller_only.__qualname__ = _defined_on_the_caller_only.__name__ = "_missing_on_callee"
_ON_CALLER = _defined_on_the_caller_only
del _defined_on_the_caller_only


def __getattr__(name: str) -> Any:
    if name == "_missing_on_callee" and _worker_name() == "worker0":
        return _ON_CALLER
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _echo(x: Any) -> Any:
    return x


def _prog_function_missing_on_callee(ctx: Any) -> dict[str, Any]:
    rpc, to = ctx.rpc, ctx.name(1)
    return {
        "local": _ON_CALLER(),
        "rpc_sync": outcome(lambda: rpc.rpc_sync(to, _ON_CALLER)),
        "rpc_async": outcome(lambda: rpc.rpc_async(to, _ON_CALLER).wait()),
        "after": rpc.rpc_sync(to, _echo, args=(7,)),
    }


@pytest.mark.spec("RPC-8")
def test_function_missing_on_the_callee_says_the_rpc_pickler_does_not_serialize_code(world: Any) -> None:
    got = world.run_on(0, _prog_function_missing_on_callee)
    assert got["local"] == "ran" and got["after"] == 7
    for api in ("rpc_sync", "rpc_async"):
        kinds, message = got[api]
        assert "RuntimeError" in kinds, (api, got[api])
        assert NOT_SERIALIZED in message and "_missing_on_callee" in message, (api, message)
        assert "AttributeError" in message and "WorkerInfo(id=1, name=worker1)" in message, (api, message)


# -- ERR-1: the remote error's text arrives as it was written ----------------------------------------
MESSAGE = 'he said "it\'s done"\n\tsecond line with a backslash \\ and \\n as text'


def _raise(message: str) -> None:
    raise ValueError(message)


def _prog_remote_error_text(ctx: Any, message: str = MESSAGE) -> dict[str, Any]:
    rpc, to = ctx.rpc, ctx.name(1)
    return {
        "rpc_sync": outcome(lambda: rpc.rpc_sync(to, _raise, args=(message,))),
        "rpc_async": outcome(lambda: rpc.rpc_async(to, _raise, args=(message,)).wait()),
        "to_here": outcome(lambda: rpc.remote(to, _raise, args=(message,)).to_here()),
    }


@pytest.mark.spec("ERR-1")
def test_remote_error_message_keeps_quotes_newlines_and_backslashes_as_written(world: Any) -> None:
    got = world.run_on(0, _prog_remote_error_text)
    for api, (kinds, message) in got.items():
        assert "ValueError" in kinds, (api, kinds)
        # PyTorch: "On WorkerInfo(...):\n" + repr(e) with its escapes undone, then the traceback
        assert f"On WorkerInfo(id=1, name=worker1):\nValueError('{MESSAGE}')\nTraceback" in message, (
            api,
            message,
        )


NON_ASCII = "naïve café: 東京 ✓"


@pytest.mark.spec("ERR-1")
def test_remote_error_message_keeps_non_ascii_text(world: Any) -> None:
    # DEV-7: PyTorch decodes the whole message as unicode_escape, which reads its UTF-8 bytes as Latin-1
    kinds, message = world.run_on(0, _prog_remote_error_text, NON_ASCII)["rpc_sync"]
    assert "ValueError" in kinds
    assert f"ValueError('{NON_ASCII}')" in message and f"ValueError: {NON_ASCII}" in message, message


# -- DAG-5: dist_autograd.backward with arguments of the wrong types --------------------------------
def _prog_backward_bad_types(ctx: Any) -> dict[str, Any]:
    da = ctx.dist_autograd
    t = torch.ones(1, requires_grad=True)
    root = (t * 2).sum()
    return {
        "str context": outcome(lambda: da.backward("x", [root])),
        "str roots": outcome(lambda: da.backward(0, "notalist")),
        "tensor roots": outcome(lambda: da.backward(0, root)),
        "float root": outcome(lambda: da.backward(0, [1.0])),
        "float context": outcome(lambda: da.backward(1.5, [root])),
        "str retain_graph": outcome(lambda: da.backward(0, [root], "x")),
        "unknown context": outcome(lambda: da.backward(12345, [root])),
    }


@pytest.mark.spec("DAG-5")
def test_backward_with_arguments_of_wrong_types_raises_type_error_before_any_context_lookup(
    world: Any,
) -> None:
    got = world.run_on(0, _prog_backward_bad_types)
    for case in (
        "str context",
        "str roots",
        "tensor roots",
        "float root",
        "float context",
        "str retain_graph",
    ):
        kinds, message = got[case]
        assert "TypeError" in kinds and INCOMPATIBLE in message, (case, got[case])
    kinds, message = got["unknown context"]  # the right types: the context is looked up
    assert "RuntimeError" in kinds and "Could not find autograd context with id: 12345" in message
