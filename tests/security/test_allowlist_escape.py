"""No remote entry point of twinrpc's own walks around a worker's ``unpickle_allow`` (issue 30): each
always-allowed helper, aimed by a peer at what the victim does not allow, is refused and runs nothing,
in the simulator and in the gloo world alike; no generated sequence of always-allowed calls reaches
a global outside the allowlist; without an allowlist the helpers behave as PyTorch's."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import _allowlist_escape_program as program
import pytest
import torch
from _launch import first_worker_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twinrpc.simulator import Simulation

import twinrpc.rpc as rpc
from twinrpc._dist_autograd import _open_envelope, rref_backward_on_owner
from twinrpc._errors import NotInitializedError
from twinrpc._membership import update_group_membership
from twinrpc._rref_proxy import _local_invoke, _local_invoke_async
from twinrpc.nn._remote_module import _param_rrefs, _remote_forward, _set_training
from twinrpc.optim import _local_optimizer_step, _new_local_optimizer

REFUSED = "SerializationError (unpickle_allow)"
#: each entry point's outcome on the victim: refused by the allowlist, or by the helper's own check
EXPECTED = {
    "proxy chain": REFUSED,
    "proxy async chain": REFUSED,
    "proxy allowed method": "ok: 2",
    "proxy unlisted method": REFUSED,
    "proxy instance attribute": REFUSED,
    "proxy on a non-RRef": REFUSED,
    "optimizer step": REFUSED,
    "optimizer over a non-tensor": REFUSED,
    "backward on a non-RRef": REFUSED,
    "backward on a non-tensor": "RuntimeError",  # "RRef should contain a tensor", as PyTorch
    "membership with a non-WorkerInfo": REFUSED,
    "envelope with a non-int": REFUSED,
    "tensor record outside a message": "SerializationError",
    "remote module forward on a non-module": REFUSED,
    "remote module parameters of a non-module": REFUSED,
    "remote module train of a non-module": REFUSED,
    "ran": "ok: []",  # nothing of the attacks ran on the victim
    "workers": "ok: ['worker0', 'worker1']",  # and its group is as it was
}


@pytest.fixture(scope="module")
def sim_outcomes() -> dict[str, str]:
    program.RAN.clear()
    out: dict[str, str] = Simulation(world_size=2, seed=0).run(program.program).values()[0]
    assert program.RAN == []
    return out


@pytest.fixture(scope="module")
def gloo_outcomes() -> dict[str, str]:
    out: dict[str, str] = first_worker_json("_allowlist_escape_program.py")
    return out


@pytest.mark.parametrize("entry_point", list(EXPECTED))
def test_an_always_allowed_helper_reaches_nothing_the_simulated_victim_does_not_allow(
    sim_outcomes: dict[str, str], entry_point: str
) -> None:
    assert sim_outcomes[entry_point] == EXPECTED[entry_point]


@pytest.mark.parametrize("entry_point", list(EXPECTED))
def test_an_always_allowed_helper_reaches_nothing_the_gloo_victim_does_not_allow(
    gloo_outcomes: dict[str, str], entry_point: str
) -> None:
    assert gloo_outcomes[entry_point] == EXPECTED[entry_point]


def _no_allowlist_program(rank: int) -> dict[str, str]:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: dict[str, str] = {}
    if rank == 0:
        counter = rpc.remote("worker1", program.make_counter)
        out["method"] = program._outcome(lambda: counter.rpc_sync().reset())
        out["dunder"] = program._outcome(
            lambda: rpc.rpc_sync("worker1", _local_invoke, args=(counter, "__sizeof__", (), {})) > 0
        )
    rpc.shutdown()
    return out


def test_without_an_allowlist_the_proxy_calls_any_method_as_pytorch_does() -> None:
    program.RAN.clear()
    out = Simulation(world_size=2, seed=0).run(_no_allowlist_program).values()[0]
    assert out == {"method": "ok: None", "dunder": "ok: True"}
    assert program.RAN == ["Counter.reset"]


# -- the property: no sequence of always-allowed calls reaches a global outside the allowlist ----------

#: attribute names an attacker tries: the walk's dunders, the victim's unlisted methods, its one allowed
NAMES = [
    "__getattribute__",
    "__init__",
    "__globals__",
    "__getitem__",
    "__call__",
    "__class__",
    "__subclasses__",
    "__reduce_ex__",
    "__dict__",
    "with_traceback",
    "args",
    "total",
    "step",
    "reset",
    "add",
    "local_value",
    "exec",
]
#: what a step's arguments may be: a name, an earlier step's RRef, plain data, or the escape itself
_ARGS = st.one_of(
    st.sampled_from(NAMES).map(lambda n: ("name", n)),
    st.integers(0, 12).map(lambda i: ("rref", i)),
    st.sampled_from([1, "x", program.ESCAPE]).map(lambda v: ("plain", v)),
)
#: each always-allowed entry point a step may call with ``rpc.remote`` (the result stays on the victim)
_HELPERS: dict[str, Callable[[Any, str, tuple[Any, ...]], tuple[Any, tuple[Any, ...], dict[str, Any]]]] = {
    "invoke": lambda rref, name, args: (_local_invoke, (rref, name, args, {}), {}),
    "invoke_async": lambda rref, name, args: (_local_invoke_async, (rref, name, args, {}), {}),
    "optimizer step": lambda rref, name, args: (_local_optimizer_step, (rref, 0), {}),
    "new optimizer": lambda rref, name, args: (_new_local_optimizer, (torch.optim.SGD, [rref]), {"lr": 0.1}),
    "backward": lambda rref, name, args: (rref_backward_on_owner, (rref, -1, False), {}),
    "membership": lambda rref, name, args: (update_group_membership, (args[0] if args else rref, True), {}),
    "envelope": lambda rref, name, args: (_open_envelope, (rref, 1, 0, False), {}),
    "an own error": lambda rref, name, args: (NotInitializedError, args, {}),
    "a builtin error": lambda rref, name, args: (ValueError, args, {}),
    "a Size": lambda rref, name, args: (torch.Size, args[:1], {}),
    "remote module forward": lambda rref, name, args: (_remote_forward, (rref, "cpu", False, *args), {}),
    "remote module parameters": lambda rref, name, args: (_param_rrefs, (rref, True), {}),
    "remote module train": lambda rref, name, args: (_set_training, (rref, True), {}),
}
_STEP = st.tuples(
    st.sampled_from(sorted(_HELPERS)),
    st.integers(0, 12),  # which earlier RRef the step is aimed at
    st.sampled_from(NAMES),
    st.lists(_ARGS, max_size=2),
)
#: the types the victim's values may have: what the always-allowed classes and the allowed names make
_CREATABLE = {
    "builtins.int",
    "builtins.str",
    "builtins.NoneType",
    "twinrpc._errors.NotInitializedError",
    "builtins.ValueError",
    "torch.Size",
    f"{program.ME}.Counter",
}


def _attack_sequence(steps: list[tuple[str, int, str, list[tuple[str, Any]]]]) -> Any:
    def run(rank: int) -> list[str]:
        options = rpc.RpcBackendOptions(unpickle_allow=program.VICTIM_ALLOW if rank == 1 else None)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
        census: list[str] = []
        if rank == 0:
            to = "worker1"
            rrefs: list[rpc.RRef[Any]] = [
                rpc.remote(to, NotInitializedError, args=("x",)),
                rpc.remote(to, ValueError, args=(1,)),
                rpc.remote(to, program.make_counter),
            ]
            for kind, target, name, raw in steps:
                rref = rrefs[target % len(rrefs)]
                args = tuple(rrefs[v % len(rrefs)] if k == "rref" else v for k, v in raw)
                helper, helper_args, kwargs = _HELPERS[kind](rref, name, args)
                try:
                    rrefs.append(rpc.remote(to, helper, args=helper_args, kwargs=kwargs))
                except RuntimeError:  # refused by the caller itself (torch.Size's schema): nothing sent
                    pass
            census = rpc.rpc_sync(to, program.census, args=(rrefs,))
        rpc.shutdown()
        return census

    return run


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_STEP, min_size=1, max_size=8))
def test_no_sequence_of_always_allowed_calls_reaches_a_global_outside_the_allowlist(
    steps: list[tuple[str, int, str, list[tuple[str, Any]]]],
) -> None:
    program.RAN.clear()
    events: list[str] = []
    _AUDIT.append(events)
    try:
        census = Simulation(world_size=2, seed=0).run(_attack_sequence(steps)).values()[0]
    finally:
        _AUDIT.remove(events)
    reached = {c for c in census if not c.startswith("error ")}
    assert reached <= _CREATABLE, f"the victim holds {reached - _CREATABLE}"
    assert program.RAN == [] and events == []


#: lists that record the audit events of code execution while a property example runs
_AUDIT: list[list[str]] = []
_WATCHED = frozenset({"exec", "compile", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn"})


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _AUDIT and event in _WATCHED:
        _AUDIT[-1].append(event)


sys.addaudithook(_audit)  # an audit hook cannot be removed; it does nothing outside the property
