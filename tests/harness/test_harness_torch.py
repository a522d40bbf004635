"""End-to-end tests of the torch backend: real processes running upstream torch.distributed.rpc.

They drive :class:`TorchBackend` directly (not through the plugin) so they can look at its pool and
processes. The worker programs are module-level so the children can import them by reference.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conformance.harness import BackendConfig, World
from conformance.harness._torch import TorchBackend


def add_on_peer(ctx: Any) -> tuple[int, list[float]]:
    peer = ctx.name((ctx.rank + 1) % ctx.world_size)
    return os.getpid(), ctx.rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), ctx.rank)).tolist()


def init_twice(ctx: Any) -> list[Any]:
    """Two full lifecycles in one spawn: the k-th ctx.options() must agree across ranks."""
    out: list[Any] = []
    for round_ in range(2):
        options = ctx.options(rpc_timeout=20)
        out.append((options.init_method, options.rpc_timeout))
        ctx.rpc.init_rpc(
            ctx.name(ctx.rank), rank=ctx.rank, world_size=ctx.world_size, rpc_backend_options=options
        )
        peer = ctx.name(1 - ctx.rank)
        out.append(ctx.rpc.rpc_sync(peer, torch.mul, args=(torch.ones(1), round_ + 2)).item())
        ctx.rpc.shutdown()
    return out


def init_with_helper(ctx: Any) -> str:
    ctx.init_rpc(num_worker_threads=4)
    name = ctx.rpc.get_worker_info().name
    ctx.rpc.shutdown()
    return name


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # rebuilt with one arg on unpickling: fails
        super().__init__(f"{a}/{b}")


def raise_on_rank_one(ctx: Any, kind: str) -> int:
    if ctx.rank == 1:
        if kind == "value":
            raise ValueError("bad value on one")
        raise Unpicklable(1, 2)
    return ctx.rank


def sleep_forever(ctx: Any) -> None:
    time.sleep(3600)


def die(ctx: Any) -> None:
    os._exit(3)


def shut_down_in_run(ctx: Any) -> None:
    ctx.rpc.shutdown()


def change_default_timeout(ctx: Any) -> float:
    ctx.rpc._set_rpc_timeout(0.5)
    return float(ctx.rpc.get_rpc_timeout())


def read_default_timeout(ctx: Any) -> float:
    return float(ctx.rpc.get_rpc_timeout())


def use_init_rpc_in_run(ctx: Any) -> None:
    ctx.init_rpc()


@pytest.fixture(scope="module")
def backend() -> Iterator[TorchBackend]:
    tmp = Path(tempfile.mkdtemp(prefix="twinrpc-harness-test-"))
    backend = TorchBackend(BackendConfig(tmp_dir=tmp, world_timeout=60.0, spares=2))
    yield backend
    pids = _all_pids(backend)
    backend.close()
    shutil.rmtree(tmp, ignore_errors=True)
    assert not [pid for pid in pids if _alive(pid)], "processes left behind after close()"


@pytest.fixture
def world(backend: TorchBackend) -> World:
    return World(backend, default_timeout=60.0)


def _all_pids(backend: TorchBackend) -> list[int]:
    workers = [w for pool in backend._pools.values() for w in pool.workers] + backend._spares
    return [w.pid for w in workers if w.pid is not None]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def test_pool_is_started_once_and_reused(world: World, backend: TorchBackend) -> None:
    first = world.run(add_on_peer)
    started = time.perf_counter()
    second = world.run(add_on_peer)
    elapsed = time.perf_counter() - started
    assert [r for _, r in first] == [[1.0, 1.0], [2.0, 2.0]] == [r for _, r in second]
    assert [pid for pid, _ in first] == [pid for pid, _ in second], "the second run used other processes"
    assert len([s for s in backend.pool_starts if s[0] == 2]) == 1
    assert elapsed < 0.5, f"a call on a started pool took {elapsed:.3f} s"


def test_run_on_leaves_other_ranks_serving(world: World) -> None:
    _pid, result = world.run_on(1, add_on_peer)
    assert result == [2.0, 2.0]
    assert world.run(add_on_peer, ranks=[0])[1] is None


def test_worker_exception_is_reraised_with_its_type_and_remote_traceback(world: World) -> None:
    with pytest.raises(ValueError, match="bad value on one") as info:
        world.run(raise_on_rank_one, "value")
    assert any("raised on rank 1" in note and "raise_on_rank_one" in note for note in info.value.__notes__)


def test_unpicklable_worker_exception_becomes_runtime_error_with_its_text(world: World) -> None:
    with pytest.raises(RuntimeError, match=r"Unpicklable.*1/2"):
        world.run(raise_on_rank_one, "unpicklable")


def test_ctx_init_rpc_is_refused_inside_run(world: World) -> None:
    from conformance.harness import HarnessUsageError

    with pytest.raises(HarnessUsageError, match=r"world\.spawn"):
        world.run_on(0, use_init_rpc_in_run)


def test_spawn_can_init_and_shut_down_twice_with_fresh_options(world: World) -> None:
    results = world.spawn(init_twice)
    assert results[0] == results[1]
    (method_a, timeout_a), product_a, (method_b, timeout_b), product_b = results[0]
    assert method_a != method_b and method_a.startswith("file://")
    assert (timeout_a, timeout_b, product_a, product_b) == (20, 20, 2.0, 3.0)


def test_spawn_ctx_init_rpc_uses_worker_names(world: World) -> None:
    assert world.spawn(init_with_helper, world_size=3) == ["worker0", "worker1", "worker2"]


def test_hung_program_fails_with_stacks_and_the_pool_restarts(world: World, backend: TorchBackend) -> None:
    before = world.run(add_on_peer)
    with pytest.raises(pytest.fail.Exception) as info:
        world.run_on(0, sleep_forever, timeout=2)
    message = str(info.value)
    assert "ranks [0] did not finish within 2 s" in message
    assert "sleep_forever" in message, "the failure should show where rank 0 hung"
    after = world.run(add_on_peer)
    assert after[0][1] == [1.0, 1.0]
    assert {pid for pid, _ in before}.isdisjoint(pid for pid, _ in after)
    assert not any(_alive(pid) for pid, _ in before)


def test_dead_worker_fails_the_test_and_the_pool_restarts(world: World) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"rank 1 \(worker1\) exited with code 3"):
        world.run_on(1, die, timeout=20)
    assert world.run(add_on_peer)[1][1] == [2.0, 2.0]


def test_program_that_shuts_rpc_down_gets_a_new_pool_next_time(world: World) -> None:
    before = world.run(add_on_peer)
    world.run(shut_down_in_run)
    after = world.run(add_on_peer)
    assert {pid for pid, _ in before}.isdisjoint(pid for pid, _ in after)


def test_default_rpc_timeout_changed_by_a_program_does_not_leak_into_the_next(world: World) -> None:
    assert world.run(change_default_timeout) == [0.5, 0.5]
    assert world.run(read_default_timeout) == [60.0, 60.0]
