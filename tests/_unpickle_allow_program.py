"""One program run in both worlds by tests/security/test_unpickle_allow.py: worker1 unpickles only what its
``unpickle_allow`` names, worker0 only what twinrpc itself needs. Run as a script it is one gloo
worker (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) and prints its outcomes as JSON."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

import twinrpc.rpc as rpc

#: what ran in this process (the simulator's workers share it: worker1 alone runs these functions)
RAN: list[str] = []
ME = __name__


def allowed(x: int) -> int:
    return x + 1


def forbidden(x: int) -> int:
    RAN.append("forbidden")
    return x


class Unlisted:
    """A reply type that worker0 does not allow."""

    def __init__(self, v: int) -> None:
        self.v = v


def make_unlisted(v: int) -> Unlisted:
    return Unlisted(v)


def ran_forbidden() -> bool:
    return "forbidden" in RAN


ALLOW = {
    0: [],
    1: [f"{ME}.allowed", f"{ME}.make_unlisted", f"{ME}.ran_forbidden", "torch.add"],
}


def _outcome(call: Any) -> str:
    try:
        value = call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"ok: {value.tolist() if isinstance(value, torch.Tensor) else value}"


def program(rank: int) -> dict[str, str]:
    """worker0's outcomes (worker1 serves); the same in both worlds."""
    options = rpc.RpcBackendOptions(unpickle_allow=ALLOW[rank])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out: dict[str, str] = {}
    if rank == 0:
        to = "worker1"
        out["allowed"] = _outcome(lambda: rpc.rpc_sync(to, allowed, args=(1,)))
        out["torch.add"] = _outcome(lambda: rpc.rpc_sync(to, torch.add, args=(torch.ones(2), 1)))
        out["forbidden"] = _outcome(lambda: rpc.rpc_sync(to, forbidden, args=(1,)))
        out["torch.sub"] = _outcome(lambda: rpc.rpc_sync(to, torch.sub, args=(torch.ones(2), 1)))
        out["ran_forbidden"] = _outcome(lambda: rpc.rpc_sync(to, ran_forbidden))
        out["unlisted reply"] = _outcome(lambda: rpc.rpc_sync(to, make_unlisted, args=(3,)))
        out["remote"] = _outcome(lambda: rpc.remote(to, allowed, args=(5,)).to_here())
        out["allowed after"] = _outcome(lambda: rpc.rpc_sync(to, allowed, args=(2,)))
    rpc.shutdown()
    return out


if __name__ == "__main__":
    # by its module name, so its functions travel under the names they have in the simulator
    import _unpickle_allow_program as by_name

    print(json.dumps(by_name.program(int(os.environ["RANK"]))))
