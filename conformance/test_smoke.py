"""Smoke tests: the simplest RPCs, proving the suite and its backends are wired up end to end."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def add_on_peer(ctx: Any) -> list[float]:
    peer = ctx.name((ctx.rank + 1) % ctx.world_size)
    return ctx.rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), 1)).tolist()


def add_async_on_peer(ctx: Any) -> tuple[bool, list[float]]:
    peer = ctx.name((ctx.rank + 1) % ctx.world_size)
    fut = ctx.rpc.rpc_async(peer, torch.add, args=(torch.ones(2), torch.full((2,), 3.0)))
    return fut.done() in (True, False), fut.wait().tolist()


def add_on_self(ctx: Any) -> list[float]:
    return ctx.rpc.rpc_sync(ctx.name(ctx.rank), torch.add, args=(torch.zeros(3), 5)).tolist()


@pytest.mark.spec("RPC-1")
def test_rpc_sync_runs_builtin_on_peer_and_returns_result(world: Any) -> None:
    assert world.run(add_on_peer) == [[2.0, 2.0], [2.0, 2.0]]


@pytest.mark.spec("RPC-1")
def test_rpc_async_returns_future_with_peer_result(world: Any) -> None:
    assert world.run_on(0, add_async_on_peer) == (True, [4.0, 4.0])


@pytest.mark.spec("RPC-6")
def test_rpc_to_self_runs_locally(world: Any) -> None:
    assert world.run(add_on_self, world_size=1) == [[5.0, 5.0, 5.0]]
