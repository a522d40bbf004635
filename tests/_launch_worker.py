"""One worker of a launch test (tests/gloo/test_gloo_launch.py). Not a test module: run as a script.

``python tests/_launch_worker.py SCENARIO ARGS...`` with RANK and WORLD_SIZE (and MASTER_ADDR/PORT for
env://) in the environment. Each step prints ``rank R: STEP ok`` when it worked; any failure raises, so
the process exits non-zero with a traceback.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import twinrpc.rpc as rpc

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
PEER = f"w{(RANK + 1) % WORLD}"


def ok(step: str) -> None:
    print(f"rank {RANK}: {step} ok", flush=True)


def init_rpc(init_method: str, *, from_env: bool = False) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=60)
    if from_env:  # rank taken from RANK, as under torchrun (world_size makes the group static)
        rpc.init_rpc(f"w{RANK}", world_size=WORLD, rpc_backend_options=options)
    else:
        rpc.init_rpc(f"w{RANK}", rank=RANK, world_size=WORLD, rpc_backend_options=options)


def check_rpc(step: str) -> None:
    got = rpc.rpc_sync(PEER, torch.add, args=(torch.ones(3), RANK))
    assert got.tolist() == [RANK + 1.0] * 3, got
    assert rpc.rpc_sync(PEER, len, args=("abcd",)) == 4
    infos = rpc.api._get_current_rpc_agent().get_worker_infos()
    assert [i.name for i in infos] == [f"w{r}" for r in range(WORLD)], infos
    ok(step)


def shutdown() -> None:
    """rpc.shutdown(), after which no thread of twinrpc's may be left running: one still inside a gloo
    call when the program exits aborts the process ("terminate called without an active exception")."""
    rpc.shutdown()
    left = [t.name for t in threading.enumerate() if t.name.startswith("twinrpc-") and t.is_alive()]
    assert left == [], f"threads left running after shutdown: {left}"


def check_pg(step: str) -> None:
    t = torch.ones(2) * (RANK + 1)
    dist.all_reduce(t)
    assert t.tolist() == [WORLD * (WORLD + 1) / 2] * 2, t
    ok(step)


def reinit(directory: str, tcp_port: str) -> None:
    """env:// (rank and size from the environment), then tcp://, then two file:// worlds, in turn."""
    init_rpc("env://", from_env=True)
    check_rpc("env://")
    shutdown()
    for i, init_method in enumerate(
        [f"tcp://127.0.0.1:{tcp_port}", f"file://{directory}/a", f"file://{directory}/b"]
    ):
        init_rpc(init_method)
        try:
            init_rpc(init_method)
        except RuntimeError as exc:
            assert "already initialized" in str(exc), exc
        check_rpc(f"re-init {i + 1} {init_method.split(':')[0]}://")
        shutdown()


def pg_same_file(directory: str) -> None:
    """The user's default group and RPC on the same file://, in both orders."""
    shared = f"file://{directory}/pg-then-rpc"
    dist.init_process_group("gloo", init_method=shared, rank=RANK, world_size=WORLD)
    init_rpc(shared)
    check_pg("pg-then-rpc: pg")
    check_rpc("pg-then-rpc: rpc")
    shutdown()
    check_pg("pg-then-rpc: pg after rpc shutdown")
    dist.destroy_process_group()

    shared = f"file://{directory}/rpc-then-pg"
    init_rpc(shared)
    dist.init_process_group("gloo", init_method=shared, rank=RANK, world_size=WORLD)
    check_rpc("rpc-then-pg: rpc")
    check_pg("rpc-then-pg: pg")
    dist.barrier()
    dist.destroy_process_group()
    check_rpc("rpc-then-pg: rpc after destroy_process_group")
    shutdown()


def pg_same_port(second_port: str, third_port: str) -> None:
    """The user's default group and RPC on the same MASTER_ADDR:MASTER_PORT, in both orders, then
    a default group over the user's own (not multi-tenant) TCPStore on that port."""
    dist.init_process_group("gloo", init_method="env://", rank=RANK, world_size=WORLD)
    init_rpc("env://")
    check_pg("pg-then-rpc: pg")
    check_rpc("pg-then-rpc: rpc")
    dist.barrier()
    dist.destroy_process_group()
    check_rpc("pg-then-rpc: rpc after destroy_process_group")
    shutdown()

    os.environ["MASTER_PORT"] = second_port
    init_rpc("env://")
    dist.init_process_group("gloo", init_method="env://", rank=RANK, world_size=WORLD)
    check_rpc("rpc-then-pg: rpc")
    check_pg("rpc-then-pg: pg")
    shutdown()
    check_pg("rpc-then-pg: pg after rpc shutdown")
    dist.destroy_process_group()

    # PyTorch's RPC fails here with EADDRINUSE (its own server cannot bind the user's port).
    os.environ["MASTER_PORT"] = third_port
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(third_port),
        WORLD,
        is_master=RANK == 0,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD)
    init_rpc("env://")
    check_pg("own-store: pg")
    check_rpc("own-store: rpc")
    assert store.timeout == datetime.timedelta(seconds=60), "twinrpc changed the user's store timeout"
    dist.barrier()
    dist.destroy_process_group()
    del store
    check_rpc("own-store: rpc after destroy_process_group")
    shutdown()


def network_namespace() -> str:
    """This process's network namespace (``net:[inode]``): differs between two hosts."""
    return os.readlink("/proc/self/ns/net")


def two_hosts() -> None:
    """One worker per network namespace: env:// to the other namespace's address, a few RPCs."""
    init_rpc("env://", from_env=True)
    mine, theirs = network_namespace(), rpc.rpc_sync(PEER, network_namespace)
    assert mine != theirs, (mine, theirs)
    ok("peer in another network namespace")
    x = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB: more than one small frame
    assert torch.equal(rpc.rpc_sync(PEER, torch.mul, args=(x, 2)), x * 2)
    futs = [rpc.rpc_async(PEER, torch.add, args=(x, k)) for k in range(4)]
    assert all(torch.equal(f.wait(), x + k) for k, f in enumerate(futs))
    rref = rpc.remote(PEER, torch.ones, args=([3],))
    assert rref.to_here().tolist() == [1.0, 1.0, 1.0]
    ok("tensors")
    shutdown()
    ok("shutdown")


class _SlowFinalizer:
    """Held by a module global: its ``__del__`` runs while the interpreter finalizes and keeps that
    phase open, so a peer's frames (heartbeats every 50 ms, its connection closing) arrive in it."""

    def __del__(self) -> None:
        time.sleep(0.5)


_slow: _SlowFinalizer | None = None
_checked = threading.Event()


def _wait_checked() -> bool:
    """Run on rank 1 for rank 0: returns once rank 1's own calls are done."""
    return _checked.wait(60)


def exit_without_shutdown() -> None:
    """Both workers exit without rpc.shutdown(), rank 0 first, while rank 1 still sends heartbeats:
    twinrpc closes its links and waits for its threads at exit, so no receiver returns from gloo
    while the interpreter finalizes (that aborts the process)."""
    global _slow
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=60, heartbeat_interval=0.05)
    rpc.init_rpc(f"w{RANK}", rank=RANK, world_size=WORLD, rpc_backend_options=options)
    check_rpc("rpc")
    _checked.set()
    if RANK == 0:
        assert rpc.rpc_sync("w1", _wait_checked)  # no call of rank 1's is left for rank 0 to answer
        _slow = _SlowFinalizer()
    else:
        time.sleep(1.0)  # serving (and sending heartbeats) while rank 0 exits
    ok("exiting without shutdown")


SCENARIOS = {
    "reinit": reinit,
    "pg-same-file": pg_same_file,
    "pg-same-port": pg_same_port,
    "two-hosts": two_hosts,
    "exit-without-shutdown": exit_without_shutdown,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
