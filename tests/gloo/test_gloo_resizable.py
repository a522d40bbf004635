"""Tensors a program sends or receives stay resizable, as in PyTorch: the copies to and from the wire
and the job key's MACs never take a NumPy view of them (``Tensor.numpy()`` marks a storage
non-resizable for good; impl/_byte_view.py). The one exception is named in spec/simulator.md: a
storage of 1 MiB or more received from a process on the same host lives in shared memory, which
cannot grow, unless ``TWINRPC_SHM_IN_PLACE=0``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from _spawn_world import run_keyed_world

WORLD_TIMEOUT = 120.0
#: floats: a storage inline in the header, one through the ring (or a gloo data frame), one of 4 MiB
SIZES = (4, 1000, 1 << 20)


def _ident(t: Any) -> Any:
    return t


def _grows(t: Any) -> bool:
    n = t.numel()
    try:
        t.resize_(2 * n)
    except RuntimeError as exc:
        assert "not resizable" in str(exc), exc
        return False
    t[-1] = 7.0  # the grown part is the tensor's own
    return t.numel() == 2 * n and float(t[n - 1]) == 1.0


def _program(rank: int, init_file: str, shared: dict[str, Any]) -> Any:
    import torch

    import twinrpc.rpc as rpc

    if not shared["in_place"]:
        os.environ["TWINRPC_SHM_IN_PLACE"] = "0"
    options = rpc.RpcBackendOptions(init_method=f"file://{init_file}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out = {}
    if rank == 0:
        for n in SIZES:
            sent = torch.ones(n)
            back = rpc.rpc_sync("worker1", _ident, args=(sent,))
            added = rpc.rpc_sync("worker1", torch.add, args=(sent, 0))
            out[n] = {"sent": _grows(sent), "udf": _grows(back), "builtin": _grows(added)}
    rpc.shutdown()
    return out


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
@pytest.mark.parametrize("key", [None, "the job's key"], ids=["no-key", "job-key"])
def test_sent_and_received_tensors_grow_but_large_ones_received_in_place_on_one_host(
    in_place: bool, key: str | None, tmp_path: Any
) -> None:
    got = run_keyed_world(_program, [key, key], str(tmp_path / "init"), WORLD_TIMEOUT, in_place=in_place)
    print(got)
    same_host = os.environ.get("TWINRPC_SHM") != "0"
    for n, grew in got[0].items():
        large_in_place = same_host and in_place and n * 4 >= 1 << 20
        assert grew == {"sent": True, "udf": not large_in_place, "builtin": not large_in_place}, (n, grew)
