"""Restricted unpickling (``RpcBackendOptions(unpickle_allow=...)``, src/twinrpc/_unpickle_allow.py):
a message naming a global outside the allowlist is refused before anything in it runs, in the
simulator and in the gloo world alike."""

from __future__ import annotations

import io
import pickle
import re

import _unpickle_allow_program as program
import pytest
import torch
from _launch import first_worker_json
from twinrpc.simulator import Simulation

import twinrpc._serialize as serialize
import twinrpc.rpc as rpc
from twinrpc._errors import SerializationError
from twinrpc._unpickle_allow import UnpickleAllowlist, UnpickleRefused

SIDE_EFFECTS: list[str] = []


def record(what: str) -> str:
    SIDE_EFFECTS.append(what)
    return what


class _Calls:
    """Unpickles as ``record(what)``: a payload that runs code."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (record, (self.what,))


def _loads(obj: object, allow: UnpickleAllowlist) -> object:
    payload, storages = serialize.dumps(obj)
    return serialize.loads(payload, serialize.copy_storages(storages), allow=allow)[0]


def test_a_global_outside_the_allowlist_is_refused_before_it_runs() -> None:
    SIDE_EFFECTS.clear()
    allow = UnpickleAllowlist(["torch.add"])
    with pytest.raises(UnpickleRefused, match=rf"{__name__}\.record") as info:
        _loads([1, _Calls("ran")], allow)
    assert SIDE_EFFECTS == []
    assert isinstance(info.value, SerializationError)
    assert "unpickle_allow" in str(info.value) and "'torch.add'" in str(info.value)


def test_patterns_match_full_dotted_names_and_bare_modules() -> None:
    SIDE_EFFECTS.clear()
    assert _loads(_Calls("a"), UnpickleAllowlist([f"{__name__}.record"])) == "a"
    assert _loads(_Calls("b"), UnpickleAllowlist([f"{__name__}.*"])) == "b"
    assert _loads(_Calls("c"), UnpickleAllowlist([__name__])) == "c"  # the module's own globals
    assert SIDE_EFFECTS == ["a", "b", "c"]
    with pytest.raises(UnpickleRefused):  # a bare module name does not reach into submodules
        _loads(rpc.rpc_sync, UnpickleAllowlist(["twinrpc"]))
    with pytest.raises(UnpickleRefused):
        _loads(_Calls("d"), UnpickleAllowlist([f"{__name__}.rec"]))  # no prefix matching


def test_builtin_operators_and_methods_are_checked_by_their_full_name() -> None:
    allow = UnpickleAllowlist(["torch.add"])
    assert _loads(torch.add, allow) is torch.add
    with pytest.raises(UnpickleRefused, match=r"torch\.sub"):
        _loads(torch.sub, allow)
    with pytest.raises(UnpickleRefused, match=r"builtins\.str\.join"):
        _loads(",".join, UnpickleAllowlist(["builtins.str"]))  # the method, not just its class


def _payload_naming(module: str, name: str) -> bytes:
    """A pickle that loads ``module.name`` with STACK_GLOBAL (as protocol 4 does for dotted names)."""
    return (
        b"\x80\x04"
        + pickle.dumps(module, 4)[2:-1]
        + pickle.dumps(name, 4)[2:-1]
        + b"\x93."  # STACK_GLOBAL, STOP
    )


def test_an_allowed_module_does_not_open_the_modules_it_imported_or_dunders() -> None:
    allow = UnpickleAllowlist([f"{__name__}.*"])
    for name in ("pickle.loads", "record.__globals__", "SIDE_EFFECTS.__class__"):
        with pytest.raises(UnpickleRefused, match=re.escape(f"{__name__}.{name}")):
            allow.loads(_payload_naming(__name__, name))
    assert allow.loads(_payload_naming(__name__, "record")) is record
    with pytest.raises(UnpickleRefused, match=re.escape(f"{__name__}._Calls.__init__")):
        _loads(_Calls.__init__, allow)  # by qualified name, through a dunder
    with pytest.raises(UnpickleRefused, match=re.escape("builtins.list.__len__")):
        _loads([1, 2].__len__, UnpickleAllowlist(["builtins.*"]))  # getattr(owner, dunder)


def _tagged_parameter() -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(2))
    p.tag = "encoder"  # type: ignore[attr-defined]
    return p


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(6.0).reshape(2, 3).t(),
        torch.ones(2, dtype=torch.bfloat16, requires_grad=True),
        torch.randn(3, 3).to_sparse(),
        torch.Size([2, 3]),
        (torch.float64, torch.sparse_coo),
        ValueError("remote"),
        serialize.SerializationError("remote"),
        torch.nn.Parameter(torch.ones(2), requires_grad=False),
        _tagged_parameter(),
    ],
    ids=[
        "strided view",
        "bfloat16 requiring grad",
        "sparse",
        "Size",
        "dtype and layout",
        "builtin error",
        "twinrpc error",
        "parameter",
        "parameter with attributes",
    ],
)
def test_what_twinrpc_itself_sends_needs_no_pattern(value: object) -> None:
    out = _loads(value, UnpickleAllowlist([]))
    if isinstance(value, torch.Tensor):
        assert type(out) is type(value) and out.requires_grad == value.requires_grad
        assert getattr(out, "tag", None) == getattr(value, "tag", None)
        assert torch.equal(out.detach().to_dense(), value.detach().to_dense())
    elif isinstance(value, BaseException):
        assert type(out) is type(value) and out.args == value.args
    else:
        assert out == value


def test_optimizer_classes_are_twinrpc_needs_but_other_torch_globals_are_not() -> None:
    allow = UnpickleAllowlist([])
    assert _loads(torch.optim.SGD, allow) is torch.optim.SGD
    with pytest.raises(UnpickleRefused, match=r"torch\.serialization\.load"):  # where it is defined
        _loads(torch.load, allow)
    with pytest.raises(UnpickleRefused, match=r"torch\.nn\.modules\.linear\.Linear"):
        _loads(torch.nn.Linear, allow)


def test_options_refuse_a_single_string_or_empty_patterns() -> None:
    with pytest.raises(TypeError, match="unpickle_allow"):
        rpc.RpcBackendOptions(unpickle_allow="mypkg.*")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unpickle_allow"):
        rpc.RpcBackendOptions(unpickle_allow=["mypkg.*", ""])
    assert rpc.TensorPipeRpcBackendOptions(unpickle_allow=("a.*",)).unpickle_allow == ["a.*"]
    assert rpc.RpcBackendOptions().unpickle_allow is None


def test_without_an_allowlist_any_global_is_unpickled_as_pytorch_does() -> None:
    SIDE_EFFECTS.clear()
    payload, _ = serialize.dumps(_Calls("free"))
    assert serialize.loads(payload, [])[0] == "free" and SIDE_EFFECTS == ["free"]
    assert pickle.Unpickler(io.BytesIO(payload)).load() == "free"


def _check_outcomes(out: dict[str, str]) -> None:
    assert out["allowed"] == "ok: 2" and out["torch.add"] == "ok: [2.0, 2.0]"
    assert out["forbidden"].startswith("SerializationError: ")
    assert f"{program.ME}.forbidden" in out["forbidden"] and "unpickle_allow" in out["forbidden"]
    assert out["torch.sub"].startswith("SerializationError: ") and "torch.sub" in out["torch.sub"]
    assert out["ran_forbidden"] == "ok: False"  # the refused request ran nothing on worker1
    unlisted = out["unlisted reply"]
    assert unlisted.startswith("SerializationError: ") and f"{program.ME}.Unlisted" in unlisted
    assert out["remote"] == "ok: 6" and out["allowed after"] == "ok: 3"


def test_a_refused_request_or_reply_fails_only_that_call_in_the_simulator() -> None:
    program.RAN.clear()
    result = Simulation(world_size=2, seed=0).run(program.program)
    _check_outcomes(result.values()[0])


def test_the_gloo_world_refuses_the_same_calls_as_the_simulator() -> None:
    program.RAN.clear()
    sim = Simulation(world_size=2, seed=0).run(program.program).values()[0]
    gloo = first_worker_json("_unpickle_allow_program.py")
    _check_outcomes(gloo)
    assert gloo == sim


def _remote_linear(rank: int) -> object:
    """worker1 allows only the module class it builds; worker0 nothing: RemoteModule's own calls and
    forwarding (twinrpc.nn's functions) need no pattern."""
    allow = ["torch.nn.modules.linear.Linear"] if rank == 1 else []
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=2,
        rpc_backend_options=rpc.RpcBackendOptions(unpickle_allow=allow),
    )
    out = None
    if rank == 0:
        from twinrpc.nn import RemoteModule

        rm = RemoteModule("worker1/cpu", torch.nn.Linear, args=(2, 1))
        out = (tuple(rm(torch.ones(3, 2)).shape), [tuple(p.to_here().shape) for p in rm.remote_parameters()])
    rpc.shutdown()
    return out


def test_a_remote_module_needs_only_its_module_class_allowed() -> None:
    result = Simulation(world_size=2, seed=0).run(_remote_linear)
    assert result.values()[0] == ((3, 1), [(1, 2), (1,)])


@pytest.mark.parametrize("pattern", ["_reexporting_module.*", "_reexporting_module"])
def test_a_pattern_matches_where_a_global_is_defined_not_where_it_was_imported(pattern: str) -> None:
    import _reexporting_module

    allow = UnpickleAllowlist([pattern])
    assert allow.loads(_payload_naming("_reexporting_module", "step")) is _reexporting_module.step
    assert allow.loads(_payload_naming("_reexporting_module", "LEARNING_RATE")) == 0.1
    for name, defined in (
        ("system", "posix.system"),
        ("SerializationError", "twinrpc._errors.SerializationError"),
    ):
        with pytest.raises(UnpickleRefused) as info:
            allow.loads(_payload_naming("_reexporting_module", name))
        text = str(info.value)
        assert f"_reexporting_module.{name}, which is {defined}" in text, text
        assert f"add {defined!r}" in text and "nothing in the message was run" in text
    with pytest.raises(UnpickleRefused, match="does not say where it is defined"):
        allow.loads(_payload_naming("_reexporting_module", "quiet_system"))
    # allowed where it is defined, the re-exported name loads too
    both = UnpickleAllowlist([pattern, "posix.system"])
    assert both.loads(_payload_naming("_reexporting_module", "system")) is _reexporting_module.system
