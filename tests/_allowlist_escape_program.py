"""Attacks on a worker's ``unpickle_allow`` through twinrpc's own always-allowed helpers, run in both
worlds by tests/security/test_allowlist_escape.py. worker1 (the victim) allows only a few names of this module;
worker0 (a keyed peer that wants to run code on it) calls the helpers as an attacker would, with
``rpc.remote`` and ``rpc.rpc_sync`` aimed at them directly. Run as a script it is one gloo worker
(RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) and prints worker0's outcomes as JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

import twinrpc.rpc as rpc
from twinrpc._current import current_agent
from twinrpc._dist_autograd import _open_envelope, rref_backward_on_owner
from twinrpc._errors import NotInitializedError
from twinrpc._membership import update_group_membership
from twinrpc._rref_proxy import _local_invoke, _local_invoke_async
from twinrpc._serialize import _rebuild_tensor
from twinrpc.nn._remote_module import _param_rrefs, _remote_forward, _set_training
from twinrpc.optim import _local_optimizer_step, _new_local_optimizer

#: what ran in the victim (the simulator's workers share it: only the victim runs these functions)
RAN: list[str] = []
ME = __name__
#: what the chain's last step runs on the victim if the allowlist lets it through
ESCAPE = f"import {ME} as p; p.RAN.append('escaped')"


class Counter:
    """A value the victim allows one method of (``add``); ``step`` and ``reset`` it does not allow."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, n: int) -> int:
        self.total += n
        return self.total

    def step(self, *args: Any) -> None:
        RAN.append("Counter.step")

    def reset(self) -> None:
        RAN.append("Counter.reset")


def make_counter() -> Counter:
    return Counter()


def ran() -> list[str]:
    return list(RAN)


def census(rrefs: list[rpc.RRef[Any]]) -> list[str]:
    """The type of each RRef's value on the victim (its owner), or what creating it raised."""
    out = []
    for rref in rrefs:
        try:
            value = rref.local_value()
        except Exception as exc:
            out.append(f"error {type(exc).__name__}")
        else:
            out.append(f"{type(value).__module__}.{type(value).__qualname__}")
    return out


def workers() -> list[str]:
    return sorted(w.name for w in current_agent().get_worker_infos())


VICTIM_ALLOW = [f"{ME}.{name}" for name in ("make_counter", "ran", "census", "workers", "Counter.add")]
#: the walk of issue 30: each step's result stays on the victim as an RRef
CHAIN = [
    ("__getattribute__", ("__init__",)),
    ("__getattribute__", ("__globals__",)),
    ("__getitem__", ("__builtins__",)),
    ("__getitem__", ("exec",)),
    ("__call__", (ESCAPE,)),
]


def _outcome(call: Callable[[], Any]) -> str:
    try:
        value = call()
    except Exception as exc:
        text = str(exc)
        refused = "unpickle_allow" in text
        return f"{type(exc).__name__}{' (unpickle_allow)' if refused else ''}"
    return f"ok: {value.tolist() if isinstance(value, torch.Tensor) else value}"


def _walk(to: str, start: rpc.RRef[Any], helper: Any) -> str:
    """The chain from ``start`` through ``helper``, one ``rpc.remote`` per step (no value comes back
    until the last); the last step's outcome."""
    rref = start
    for name, args in CHAIN:
        rref = rpc.remote(to, helper, args=(rref, name, args, {}))
    return _outcome(rref.to_here)


def attacks(to: str) -> dict[str, str]:
    """Each always-allowed entry point aimed at what the victim does not allow; then what ran."""
    out: dict[str, str] = {}
    own_error = rpc.remote(to, NotInitializedError, args=("x",))  # an always-allowed class
    counter = rpc.remote(to, make_counter)
    out["proxy chain"] = _walk(to, own_error, _local_invoke)
    out["proxy async chain"] = _walk(to, own_error, _local_invoke_async)
    out["proxy allowed method"] = _outcome(lambda: counter.rpc_sync().add(2))
    out["proxy unlisted method"] = _outcome(lambda: counter.rpc_sync().reset())
    out["proxy instance attribute"] = _outcome(
        lambda: rpc.rpc_sync(to, _local_invoke, args=(counter, "total", (), {}))
    )
    out["proxy on a non-RRef"] = _outcome(
        lambda: rpc.rpc_sync(to, _local_invoke, args=(rpc.WorkerInfo("x", 0), "add", (1,), {}))
    )
    out["optimizer step"] = _outcome(lambda: rpc.rpc_sync(to, _local_optimizer_step, args=(counter, 0)))
    out["optimizer over a non-tensor"] = _outcome(
        lambda: rpc.rpc_sync(to, _new_local_optimizer, args=(torch.optim.SGD, [counter]), kwargs={"lr": 0.1})
    )
    out["backward on a non-RRef"] = _outcome(
        lambda: rpc.rpc_sync(to, rref_backward_on_owner, args=(own_error.to_here(), -1, False))
    )
    out["backward on a non-tensor"] = _outcome(
        lambda: rpc.rpc_sync(to, rref_backward_on_owner, args=(counter, -1, False))
    )
    out["membership with a non-WorkerInfo"] = _outcome(
        lambda: rpc.rpc_sync(to, update_group_membership, args=(ValueError("x"), True))
    )
    out["envelope with a non-int"] = _outcome(
        lambda: rpc.rpc_sync(to, _open_envelope, args=(ValueError("x"), 1, 0, False))
    )
    out["tensor record outside a message"] = _outcome(
        lambda: rpc.rpc_sync(to, _rebuild_tensor, args=(0, torch.float32, (1,), (1,), 0, False))
    )
    out["remote module forward on a non-module"] = _outcome(
        lambda: rpc.rpc_sync(to, _remote_forward, args=(counter, "cpu", False, 1))
    )
    out["remote module parameters of a non-module"] = _outcome(
        lambda: rpc.rpc_sync(to, _param_rrefs, args=(own_error, True))
    )
    out["remote module train of a non-module"] = _outcome(
        lambda: rpc.rpc_sync(to, _set_training, args=(counter, True))
    )
    out["ran"] = _outcome(lambda: rpc.rpc_sync(to, ran))
    out["workers"] = _outcome(lambda: rpc.rpc_sync(to, workers))
    return out


def program(rank: int) -> dict[str, str]:
    """worker0's outcomes (worker1 is the victim); the same in both worlds."""
    allow = VICTIM_ALLOW if rank == 1 else None
    options = rpc.RpcBackendOptions(unpickle_allow=allow)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out = attacks("worker1") if rank == 0 else {}
    rpc.shutdown()
    return out


if __name__ == "__main__":
    # by its module name, so its functions travel under the names they have in the simulator
    import _allowlist_escape_program as by_name

    print(json.dumps(by_name.program(int(os.environ["RANK"]))))
