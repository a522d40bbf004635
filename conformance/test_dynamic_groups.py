"""Dynamic groups: ``init_rpc`` without ``world_size`` (LIFE-5, LIFE-2) and leaving them (SHUT-6).

Workers join at different times (a later one sleeps first: wall-clock on torch/gloo, virtual on sim),
existing and new members call each other, a member leaves and the others keep working, and a worker
cannot join a static group dynamically. The programs space their steps ``STEP`` seconds apart so that
each step on real processes starts after the previous one ended; no step depends on finer timing.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance._support import outcome

#: seconds between the steps of a program (wall-clock on torch/gloo)
STEP = 1.5


def _rpc_module(backend: str) -> Any:
    if backend == "torch":
        import torch.distributed.rpc as rpc
    else:
        import twinrpc.rpc as rpc
    return rpc


def _members(backend: str) -> list[tuple[str, int]]:
    """This worker's view of the group, as ``(name, id)`` sorted (PyTorch lists it in no set order)."""
    agent = _rpc_module(backend).api._get_current_rpc_agent()
    return sorted((w.name, w.id) for w in agent.get_worker_infos())


def _whoami(backend: str, tag: Any) -> tuple[str, Any]:
    """Runs on the callee: its own name (proves where the call ran) and ``tag``."""
    return (_rpc_module(backend).get_worker_info().name, tag)


def _dynamic_init(ctx: Any, name: str | None = None) -> None:
    ctx.rpc.init_rpc(
        name if name is not None else ctx.name(ctx.rank), rank=ctx.rank, rpc_backend_options=ctx.options()
    )


def _prog_join_late_then_leave(ctx: Any) -> dict[str, Any]:
    """Ranks 0 and 1 join at once, rank 2 one step later; rank 1 leaves at step 3."""
    rpc, b, out = ctx.rpc, ctx.backend, {}
    if ctx.rank == 2:
        ctx.sleep(STEP)
    _dynamic_init(ctx)
    if ctx.rank == 2:  # the new member sees every member, and calls the existing ones
        out["joined"] = _members(b)
        out["calls"] = [
            rpc.rpc_sync("worker0", _whoami, args=(b, "by name")),
            rpc.rpc_sync(1, _whoami, args=(b, "by rank")),
            rpc.rpc_sync(rpc.get_worker_info("worker1"), _whoami, args=(b, "by info")),
        ]
        out["worker0 sees"] = rpc.rpc_sync("worker0", _members, args=(b,))
        ctx.sleep(STEP)
    else:
        ctx.sleep(2 * STEP)
    # step 2: the existing members call the new one
    if ctx.rank in (0, 1):
        out["members"] = _members(b)
        out["to new"] = rpc.rpc_sync("worker2", _whoami, args=(b, ctx.rank))
        info = rpc.get_worker_info("worker2")
        out["new info"] = (info.name, info.id)
    ctx.sleep(STEP)
    if ctx.rank == 1:  # step 3: rank 1 leaves; its shutdown returns without the others
        rpc.shutdown()
        return out
    ctx.sleep(STEP)
    # step 4: the others keep calling each other; the one that left is unknown
    out["after leave"] = _members(b)
    out["to other"] = rpc.rpc_sync(ctx.name(2 - ctx.rank), _whoami, args=(b, "after"))
    out["to left"] = [
        outcome(lambda: rpc.rpc_sync("worker1", _whoami, args=(b, None))),
        outcome(lambda: rpc.rpc_sync(1, _whoami, args=(b, None))),
    ]
    ctx.sleep(STEP)
    rpc.shutdown()
    return out


@pytest.mark.spec("LIFE-5", "SHUT-6")
def test_dynamic_group_members_join_late_call_each_other_and_leave(world: Any) -> None:
    w0, w1, w2 = ("worker0", 0), ("worker1", 1), ("worker2", 2)
    got = world.spawn(_prog_join_late_then_leave, world_size=3)
    assert got[2]["joined"] == [w0, w1, w2]
    assert got[2]["calls"] == [("worker0", "by name"), ("worker1", "by rank"), ("worker1", "by info")]
    assert got[2]["worker0 sees"] == [w0, w1, w2]  # init_rpc returned once every member knew it
    for r in (0, 1):
        assert got[r]["members"] == [w0, w1, w2]
        assert got[r]["to new"] == ("worker2", r)
        assert got[r]["new info"] == w2
    assert got[0]["after leave"] == got[2]["after leave"] == [w0, w2]
    assert got[0]["to other"] == ("worker2", "after")
    assert got[2]["to other"] == ("worker0", "after")
    for r in (0, 2):
        by_name, by_rank = got[r]["to left"]
        assert by_name[0] == by_rank[0] == ("RuntimeError",)
        assert by_name[1] == f"name:worker{r},rank:{r} could not find destination name worker1"
        assert by_rank[1] == f"name:worker{r},rank:{r} could not find destination id 1"


def _prog_world_size_in_the_environment(ctx: Any) -> list[tuple[str, int]]:
    """As under torchrun, WORLD_SIZE is set; init_rpc gets no world_size. Rank 1 joins a step later."""
    import os

    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(ctx.world_size)
    try:
        if ctx.rank == 1:
            ctx.sleep(STEP)
        _dynamic_init(ctx)
        alone = _members(ctx.backend)  # rank 0: nobody else yet, whatever WORLD_SIZE says
        ctx.sleep(2 * STEP)
        ctx.rpc.shutdown()
        return alone
    finally:
        if before is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = before


@pytest.mark.spec("LIFE-5")
def test_init_rpc_without_world_size_is_dynamic_even_with_world_size_in_the_environment(world: Any) -> None:
    got = world.spawn(_prog_world_size_in_the_environment, world_size=2)
    assert got == [[("worker0", 0)], [("worker0", 0), ("worker1", 1)]]


def _prog_leave_without_telling(ctx: Any) -> dict[str, Any]:
    """Rank 1 stops with ``shutdown(graceful=False)``: it does not leave the group's list."""
    rpc, b, out = ctx.rpc, ctx.backend, {}
    if ctx.rank == 1:
        ctx.sleep(STEP)
    _dynamic_init(ctx)
    ctx.sleep(2 * STEP)
    if ctx.rank == 1:
        rpc.shutdown(graceful=False)
        return out
    ctx.sleep(2 * STEP)  # rank 0 is one step ahead of rank 1: wait until rank 1 has stopped
    out["members"] = _members(b)
    out["to it"] = outcome(lambda: rpc.rpc_sync("worker1", _whoami, args=(b, None), timeout=5))
    out["to self"] = rpc.rpc_sync("worker0", _whoami, args=(b, "self"))
    rpc.shutdown(graceful=False)
    return out


@pytest.mark.spec("LIFE-5", "SHUT-6")
def test_dynamic_member_stopping_without_leaving_stays_listed_and_calls_to_it_fail(world: Any) -> None:
    got = world.spawn(_prog_leave_without_telling, world_size=2)
    assert got[0]["members"] == [("worker0", 0), ("worker1", 1)]
    kinds, _ = got[0]["to it"]
    assert "RuntimeError" in kinds
    assert got[0]["to self"] == ("worker0", "self")


def _bounded(backend: str, fn: Any, seconds: float) -> Any:
    """``outcome(fn)``; on torch on a thread, or ``"still running"`` after ``seconds`` (PyTorch hangs
    there: DEV-10). twinrpc's worlds run it directly (a simulated program starts no threads)."""
    import threading

    if backend != "torch":
        return outcome(fn)
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(outcome(fn)), daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else "still running"


def _prog_join_past_a_stopped_member(ctx: Any) -> Any:
    """Rank 1 stops without leaving; rank 2 then tries to join the group that still lists it."""
    if ctx.rank == 2:
        ctx.sleep(2 * STEP)
        return _bounded(ctx.backend, lambda: _dynamic_init(ctx), 15.0)
    if ctx.rank == 1:
        ctx.sleep(STEP / 2)
    _dynamic_init(ctx)
    if ctx.rank == 1:
        ctx.rpc.shutdown(graceful=False)
        return None
    ctx.sleep(6 * STEP)  # well after rank 2's attempt, even if its process started late
    members = _members(ctx.backend)
    ctx.rpc.shutdown(graceful=False)
    return members


@pytest.mark.spec("LIFE-5")
def test_joining_past_a_member_that_stopped_without_leaving_fails_and_no_member_lists_the_joiner(
    world: Any,
) -> None:
    got = world.spawn(_prog_join_past_a_stopped_member, world_size=3)
    assert got[0] == [("worker0", 0), ("worker1", 1)]  # the failed joiner is nowhere
    assert got[2] != "still running", "init_rpc still blocked 15 s after it started"
    kinds, message = got[2]
    assert "RuntimeError" in kinds and "worker1" in message


def _prog_static_then_dynamic(ctx: Any) -> Any:
    """Ranks 0 and 1 form a static group of 2; rank 2 then tries to join it dynamically."""
    if ctx.rank < 2:
        ctx.init_rpc(world_size=2)
        ctx.sleep(2 * STEP)
        got = ctx.rpc.rpc_sync(ctx.name(1 - ctx.rank), _whoami, args=(ctx.backend, "static"))
        ctx.rpc.shutdown()
        return got
    ctx.sleep(STEP)
    return outcome(lambda: _dynamic_init(ctx))


@pytest.mark.spec("LIFE-5")
def test_joining_a_static_group_dynamically_raises_pytorchs_error(world: Any) -> None:
    got = world.spawn(_prog_static_then_dynamic, world_size=3)
    assert got[2] == (
        ("RuntimeError",),
        "RPC group mixes statically and dynamically initialized members which is not supported. ",
    )  # PyTorch's text, trailing space included
    assert got[:2] == [("worker1", "static"), ("worker0", "static")]  # the static group is unharmed


def _prog_duplicate_name_joins_late(ctx: Any) -> Any:
    if ctx.rank == 0:
        _dynamic_init(ctx, "same-name")
        ctx.sleep(2 * STEP)
        members = _members(ctx.backend)
        # Not graceful: PyTorch's refused joiner never gives the membership token back (it raises
        # inside _group_membership_management), so a graceful leave would wait for it for ever.
        ctx.rpc.shutdown(graceful=False)
        return members
    ctx.sleep(STEP)
    return outcome(lambda: _dynamic_init(ctx, "same-name"))


@pytest.mark.spec("LIFE-5", "LIFE-2")
def test_dynamic_joiner_with_a_members_name_is_refused(world: Any) -> None:
    got = world.spawn(_prog_duplicate_name_joins_late, world_size=2)
    assert got[0] == [("same-name", 0)]
    kinds, message = got[1]
    assert kinds == ("RuntimeError",)
    assert message.startswith("RPC worker name same-name is not unique. Workers 1 and 0 share the same name.")
