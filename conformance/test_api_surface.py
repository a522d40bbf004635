"""twinrpc's public API has torch.distributed.rpc's signatures, defaults and value semantics (RPC-18).

These tests compare the two libraries' objects directly in the pytest process and need no world, so they
run once, under the ``sim`` backend (on torch they would compare torch with itself).

Parameter names, kinds and defaults are compared, not annotations. torch's C++-bound methods (``PyRRef``'s
methods, ``WorkerInfo`` and ``RpcBackendOptions`` constructors) hide their signatures from ``inspect``; for
those the pybind11 docstring signature line (``to_here(self: PyRRef, timeout: float = -1.0) -> object``)
is parsed instead. twinrpc may add parameters, but only keyword-only ones with defaults (STYLE 14).
"""

from __future__ import annotations

import copy
import inspect
import pickle
import re
import typing
from typing import Any

import pytest
import torch
import torch.distributed.rpc as torch_rpc
import torch.futures as torch_futures
from torch.distributed.rpc import constants as torch_constants

pytestmark = pytest.mark.backends("sim")

Param = tuple[str, str, str | None]  # (name, kind, repr of default or None)

_POSITIONAL = "POSITIONAL_OR_KEYWORD"


def _twin() -> Any:
    import twinrpc.rpc

    return twinrpc.rpc


def _twin_futures() -> Any:
    import twinrpc.futures

    return twinrpc.futures


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _pybind_params(obj: Any) -> list[Param]:
    """Parameters from a pybind11 docstring; for overloads, the overload with the most parameters."""
    doc = obj.__doc__ or ""
    candidates = re.findall(r"^(?:\d+\. )?\w+\((.*)\) ->", doc, flags=re.MULTILINE)
    assert candidates, f"no signature line in the docstring of {obj!r}: {doc[:200]!r}"
    best: list[Param] = []
    for inner in candidates:
        params: list[Param] = []
        for part in _split_top_level(inner):
            name = part.split(":", 1)[0].split("=", 1)[0].strip()
            if name in ("self", "*args", "**kwargs"):
                continue
            default = part.split(" = ", 1)[1].strip() if " = " in part else None
            params.append((name, _POSITIONAL, default))
        if len(params) >= len(best):
            best = params
    return best


def _params(obj: Any, *, skip_self: bool = True) -> list[Param]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return _pybind_params(obj)
    # pybind11 methods show up as (self, /, *args, **kwargs); their docstring has the real signature.
    has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values())
    if has_varargs and "(self: " in (getattr(obj, "__doc__", None) or ""):
        return _pybind_params(obj)
    return [
        (
            p.name,
            p.kind.name,
            None if p.default is inspect.Parameter.empty else repr(p.default),
        )
        for p in sig.parameters.values()
        if not (skip_self and p.name == "self")
    ]


def _assert_same_params(torch_obj: Any, twin_obj: Any, what: str) -> None:
    expected = _params(torch_obj)
    actual = _params(twin_obj)
    assert actual[: len(expected)] == expected, f"{what}: twinrpc {actual} != torch {expected}"
    extra = actual[len(expected) :]
    bad = [p for p in extra if p[1] != "KEYWORD_ONLY" or p[2] is None]
    assert not bad, f"{what}: twinrpc's additions must be keyword-only with defaults, got {bad}"


@pytest.mark.spec("RPC-18")
@pytest.mark.parametrize(
    "name", ["init_rpc", "rpc_sync", "rpc_async", "remote", "shutdown", "get_worker_info", "is_available"]
)
def test_module_function_signature_matches_torch(name: str) -> None:
    """Compares twinrpc.rpc with torch.distributed.rpc directly; needs no world."""
    _assert_same_params(getattr(torch_rpc, name), getattr(_twin(), name), name)


@pytest.mark.spec("RPC-18")
@pytest.mark.parametrize(
    "method",
    [
        "to_here",
        "owner",
        "owner_name",
        "is_owner",
        "local_value",
        "confirmed_by_owner",
        "rpc_sync",
        "rpc_async",
        "remote",
        "backward",
        "__init__",
    ],
)
def test_rref_method_signature_matches_torch(method: str) -> None:
    """Compares twinrpc's RRef with torch's PyRRef (docstring signatures); needs no world."""
    _assert_same_params(getattr(torch_rpc.PyRRef, method), getattr(_twin().RRef, method), f"RRef.{method}")


@pytest.mark.spec("RPC-18")
def test_rref_method_defaults_match_documented_values() -> None:
    """Pins the documented defaults, so a broken docstring parser cannot make the comparison vacuous."""
    rref = _twin().RRef
    assert _params(rref.to_here) == [("timeout", _POSITIONAL, "-1.0")]
    assert _params(rref.backward) == [
        ("dist_autograd_ctx_id", _POSITIONAL, "-1"),
        ("retain_graph", _POSITIONAL, "False"),
    ]
    assert _params(torch_rpc.PyRRef.to_here) == [("timeout", _POSITIONAL, "-1.0")]
    assert _params(torch_rpc.PyRRef.__init__) == [
        ("value", _POSITIONAL, None),
        ("type_hint", _POSITIONAL, "None"),
    ]


@pytest.mark.spec("RPC-18")
@pytest.mark.parametrize("name", ["WorkerInfo", "RpcBackendOptions", "TensorPipeRpcBackendOptions"])
def test_constructor_signature_matches_torch(name: str) -> None:
    """Compares the value classes' constructors directly; needs no world."""
    torch_cls, twin_cls = getattr(torch_rpc, name), getattr(_twin(), name)
    pybind_init = "(self: " in (torch_cls.__init__.__doc__ or "")
    torch_init = torch_cls.__init__ if pybind_init else torch_cls
    _assert_same_params(torch_init, twin_cls, name)


@pytest.mark.spec("RPC-18")
def test_backend_options_defaults_match_torch() -> None:
    """Constructs both libraries' options objects and compares their default attribute values; no world."""
    twin = _twin()
    for cls_name in ("RpcBackendOptions", "TensorPipeRpcBackendOptions"):
        ours, theirs = getattr(twin, cls_name)(), getattr(torch_rpc, cls_name)()
        assert (ours.rpc_timeout, ours.init_method) == (theirs.rpc_timeout, theirs.init_method), cls_name
    ours, theirs = twin.TensorPipeRpcBackendOptions(), torch_rpc.TensorPipeRpcBackendOptions()
    assert ours.num_worker_threads == theirs.num_worker_threads == 16
    assert dict(ours.device_maps) == dict(theirs.device_maps) == {}
    assert list(ours.devices) == list(theirs.devices) == []


@pytest.mark.spec("RPC-18")
@pytest.mark.parametrize(
    "name",
    [
        "DEFAULT_RPC_TIMEOUT_SEC",
        "DEFAULT_INIT_METHOD",
        "DEFAULT_NUM_WORKER_THREADS",
        "UNSET_RPC_TIMEOUT",
        "DEFAULT_SHUTDOWN_TIMEOUT",
    ],
)
def test_rpc_constant_equals_torch(name: str) -> None:
    """torch keeps these in torch.distributed.rpc.constants; twinrpc.rpc re-exports them. No world needed."""
    expected = getattr(torch_constants, name)
    actual = getattr(_twin(), name)
    assert (type(actual), actual) == (type(expected), expected)


@pytest.mark.spec("RPC-18", "RPC-14")
def test_async_execution_and_future_api_signatures_match_torch() -> None:
    """Compares functions.async_execution, torch.futures' functions and Future methods; no world."""
    _assert_same_params(
        torch_rpc.functions.async_execution, _twin().functions.async_execution, "async_execution"
    )
    futures = _twin_futures()
    for fn in ("wait_all", "collect_all"):
        _assert_same_params(getattr(torch_futures, fn), getattr(futures, fn), fn)
    for method in ("then", "wait", "value", "done", "set_result", "set_exception", "add_done_callback"):
        _assert_same_params(
            getattr(torch_futures.Future, method), getattr(futures.Future, method), f"Future.{method}"
        )
    _assert_same_params(torch_futures.Future, futures.Future, "Future")


@pytest.mark.spec("RPC-18")
def test_rref_is_subscriptable_as_a_generic_type_like_torch() -> None:
    """``RRef[torch.Tensor]`` is valid in both libraries (used in annotations); no world needed."""
    twin_rref = _twin().RRef
    for rref in (torch_rpc.RRef, twin_rref):
        alias = rref[torch.Tensor]
        assert typing.get_args(alias) == (torch.Tensor,)
        assert typing.get_origin(alias) is rref
    assert _twin().PyRRef is not None


@pytest.mark.spec("RPC-18")
def test_worker_info_repr_equality_hash_and_pickle_match_torch() -> None:
    """Constructs WorkerInfo values of both libraries side by side; no world needed."""
    WorkerInfo = _twin().WorkerInfo
    ours, theirs = WorkerInfo("w1", 1), torch_rpc.WorkerInfo("w1", 1)
    assert repr(ours) == repr(theirs) == "WorkerInfo(id=1, name=w1)"
    assert str(ours) == str(theirs)
    assert (ours.name, ours.id, type(ours.id)) == (theirs.name, theirs.id, int)
    assert ours == WorkerInfo("w1", 1)
    assert hash(ours) == hash(WorkerInfo("w1", 1))
    assert ours != WorkerInfo("w1", 2)
    assert ours != WorkerInfo("w2", 1)
    assert len({ours, WorkerInfo("w1", 1), WorkerInfo("w2", 2)}) == 2
    for value in (ours, theirs):
        clone = pickle.loads(pickle.dumps(value))
        assert clone == value and hash(clone) == hash(value) and type(clone) is type(value)
    assert copy.deepcopy(ours) == ours


# -- the exported names, pinned (a name added or dropped is a decision: update the list here) ------
TWIN_RPC_NAMES = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_SEND_RECV_THREADS",  # PyTorch 1.6 (LIFE-8)
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
    "AuthenticationError",  # twinrpc's job keys (docs/howto/authenticate-workers.md)
    "BackendType",
    "NotInitializedError",
    "ProcessGroupRpcBackendOptions",  # PyTorch 1.4-1.7 (LIFE-8)
    "PyRRef",
    "RPCError",
    "RPCTimeoutError",
    "RRef",
    "RemoteError",
    "RpcBackendOptions",
    "SerializationError",
    "ShutdownError",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "WorkerUnavailableError",
    "_get_debug_info",
    "_rref_context_get_debug_info",
    "_set_rpc_timeout",
    "_wait_all",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "get_worker_infos",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
#: the names of torch.distributed.rpc.__all__ that are its user API (the rest of that list is its
#: backend registry's machinery: register_backend, BackendValue, AllGatherStates, ...)
TORCH_RPC_USER_NAMES = [
    "is_available",
    "init_rpc",
    "BackendType",
    "TensorPipeRpcBackendOptions",
    "shutdown",
    "get_worker_info",
    "remote",
    "rpc_sync",
    "rpc_async",
    "RRef",
]


@pytest.mark.spec("RPC-18", "LIFE-8")
def test_exported_names_are_pinned() -> None:
    """Pins twinrpc's ``__all__`` lists (httpx's test_exported_members); compares modules, no world."""
    import twinrpc.autograd
    import twinrpc.optim

    assert _twin().__all__ == TWIN_RPC_NAMES
    assert all(hasattr(_twin(), name) for name in TWIN_RPC_NAMES)
    assert twinrpc.autograd.__all__ == [
        "DistAutogradContext",
        "backward",
        "context",
        "get_gradients",
        "is_available",
    ]
    assert twinrpc.optim.__all__ == ["DistributedOptimizer", "register_functional_optim"]


@pytest.mark.spec("RPC-18")
def test_torch_rpc_user_names_are_all_exported() -> None:
    """Every user-facing name of torch.distributed.rpc.__all__ is in twinrpc.rpc.__all__; no world."""
    assert set(TORCH_RPC_USER_NAMES) <= set(torch_rpc.__all__), "torch's list changed: review this test"
    assert set(TORCH_RPC_USER_NAMES) <= set(_twin().__all__)


@pytest.mark.spec("RPC-18", "LIFE-8")
def test_process_group_names_have_pytorch_1_6_signature_and_values() -> None:
    """PyTorch 2.13 has no ProcessGroupRpcBackendOptions to compare with: the expected values are
    PyTorch 1.6's (torch/csrc/distributed/rpc/init.cpp of v1.6), pinned here; no world."""
    twin = _twin()
    params = _params(twin.ProcessGroupRpcBackendOptions)
    assert params[:3] == [
        ("num_send_recv_threads", _POSITIONAL, "4"),
        ("rpc_timeout", _POSITIONAL, "60.0"),
        ("init_method", _POSITIONAL, "'env://'"),
    ]
    assert all(kind == "KEYWORD_ONLY" and default is not None for _, kind, default in params[3:]), params
    assert issubclass(twin.ProcessGroupRpcBackendOptions, twin.RpcBackendOptions)
    assert [m.name for m in twin.BackendType] == ["TENSORPIPE", "PROCESS_GROUP"]
    assert repr(twin.BackendType.PROCESS_GROUP) == "BackendType.PROCESS_GROUP"
    assert repr(twin.BackendType.TENSORPIPE) == repr(torch_rpc.BackendType.TENSORPIPE)
    assert not hasattr(torch_rpc.BackendType, "PROCESS_GROUP"), "torch has it again: compare directly"


@pytest.mark.spec("RPC-18", "OPT-6", "DAG-13")
def test_older_forms_widen_torch_signatures_only_with_defaults() -> None:
    """The 1.4 forms make a required parameter optional (step's context_id, backward's roots); kinds
    and the other defaults are torch's (names aside: torch's binding calls backward's first parameter
    ``contextId``, its documentation ``context_id``, as twinrpc does). Compares directly; no world."""
    import torch.distributed.autograd as torch_autograd
    import torch.distributed.optim as torch_optim

    import twinrpc.autograd
    import twinrpc.optim

    assert _params(torch_optim.DistributedOptimizer.step) == [("context_id", _POSITIONAL, None)]
    assert _params(twinrpc.optim.DistributedOptimizer.step) == [("context_id", _POSITIONAL, "None")]
    ours = _params(twinrpc.autograd.backward)
    theirs = _params(torch_autograd.backward)
    assert [(kind, default) for _, kind, default in theirs] == [
        (_POSITIONAL, None),
        (_POSITIONAL, None),
        (_POSITIONAL, "False"),
    ]
    assert ours == [
        ("context_id", _POSITIONAL, None),
        ("roots", _POSITIONAL, "None"),
        ("retain_graph", _POSITIONAL, "False"),
    ]
