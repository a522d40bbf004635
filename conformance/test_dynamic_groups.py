"""Dynamic groups: ``init_rpc`` without ``world_size`` (LIFE-5, LIFE-2) and leaving them (SHUT-6).

Workers join at different times, existing and new members call each other, a member leaves and the
others keep working, and a worker cannot join a static group dynamically. The ranks of a program take
their steps in a set order: a rank marks each step it finished with a file in the test's directory
and another waits for that file (``_mark``/``_after``; in the simulator the wait is in virtual time),
so the order holds however late a process starts on a loaded machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conformance._support import outcome

#: seconds a rank polls for another's mark before it gives up
WAIT = 60.0


def _mark(where: str, step: str) -> None:
    Path(where, step).touch()


def _after(ctx: Any, where: str, *steps: str) -> None:
    """Wait until every one of ``steps`` is marked (another rank finished it)."""
    waited = 0.0
    while not all(os.path.exists(os.path.join(where, step)) for step in steps):
        if waited > WAIT:
            raise TimeoutError(f"rank {ctx.rank}: steps {steps} not all done after {WAIT:g} s")
        ctx.sleep(0.05)
        waited += 0.05


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


def _prog_join_late_then_leave(ctx: Any, where: str) -> dict[str, Any]:
    """Ranks 0 and 1 join, then rank 2; the old members call the new one; rank 1 leaves; the others
    call each other and the one that left."""
    rpc, b, r, out = ctx.rpc, ctx.backend, ctx.rank, {}
    if r == 2:
        _after(ctx, where, "0-in", "1-in")
    _dynamic_init(ctx)
    if r == 2:  # the new member sees every member, and calls the existing ones
        out["joined"] = _members(b)
        out["calls"] = [
            rpc.rpc_sync("worker0", _whoami, args=(b, "by name")),
            rpc.rpc_sync(1, _whoami, args=(b, "by rank")),
            rpc.rpc_sync(rpc.get_worker_info("worker1"), _whoami, args=(b, "by info")),
        ]
        out["worker0 sees"] = rpc.rpc_sync("worker0", _members, args=(b,))
    _mark(where, f"{r}-in")
    if r in (0, 1):  # the existing members call the new one
        _after(ctx, where, "2-in")
        out["members"] = _members(b)
        out["to new"] = rpc.rpc_sync("worker2", _whoami, args=(b, r))
        info = rpc.get_worker_info("worker2")
        out["new info"] = (info.name, info.id)
    _mark(where, f"{r}-called")
    if r == 1:  # rank 1 leaves; its shutdown returns without the others
        _after(ctx, where, "0-called", "2-called")
        rpc.shutdown()
        _mark(where, "1-left")
        return out
    _after(ctx, where, "1-left")
    # the others keep calling each other; the one that left is unknown
    out["after leave"] = _members(b)
    out["to other"] = rpc.rpc_sync(ctx.name(2 - r), _whoami, args=(b, "after"))
    out["to left"] = [
        outcome(lambda: rpc.rpc_sync("worker1", _whoami, args=(b, None))),
        outcome(lambda: rpc.rpc_sync(1, _whoami, args=(b, None))),
    ]
    _mark(where, f"{r}-done")
    _after(ctx, where, f"{2 - r}-done")
    rpc.shutdown()
    return out


@pytest.mark.spec("LIFE-5", "SHUT-6")
def test_dynamic_group_members_join_late_call_each_other_and_leave(world: Any, tmp_path: Path) -> None:
    w0, w1, w2 = ("worker0", 0), ("worker1", 1), ("worker2", 2)
    got = world.spawn(_prog_join_late_then_leave, str(tmp_path), world_size=3)
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


def _prog_world_size_in_the_environment(ctx: Any, where: str) -> list[tuple[str, int]]:
    """As under torchrun, WORLD_SIZE is set; init_rpc gets no world_size. Rank 1 joins after rank 0."""
    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(ctx.world_size)
    try:
        if ctx.rank == 1:
            _after(ctx, where, "0-in")
        _dynamic_init(ctx)
        seen = _members(ctx.backend)  # rank 0: nobody else yet, whatever WORLD_SIZE says
        _mark(where, f"{ctx.rank}-in")
        _after(ctx, where, "0-in", "1-in")
        ctx.rpc.shutdown()
        return seen
    finally:
        if before is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = before


@pytest.mark.spec("LIFE-5")
def test_init_rpc_without_world_size_is_dynamic_even_with_world_size_in_the_environment(
    world: Any, tmp_path: Path
) -> None:
    got = world.spawn(_prog_world_size_in_the_environment, str(tmp_path), world_size=2)
    assert got == [[("worker0", 0)], [("worker0", 0), ("worker1", 1)]]


def _prog_leave_without_telling(ctx: Any, where: str) -> dict[str, Any]:
    """Rank 1 stops with ``shutdown(graceful=False)``: it does not leave the group's list."""
    rpc, b, out = ctx.rpc, ctx.backend, {}
    if ctx.rank == 1:
        _after(ctx, where, "0-in")
    _dynamic_init(ctx)
    _mark(where, f"{ctx.rank}-in")
    if ctx.rank == 1:
        rpc.shutdown(graceful=False)
        _mark(where, "1-stopped")
        return out
    _after(ctx, where, "1-stopped")
    out["members"] = _members(b)
    out["to it"] = outcome(lambda: rpc.rpc_sync("worker1", _whoami, args=(b, None), timeout=5))
    out["to self"] = rpc.rpc_sync("worker0", _whoami, args=(b, "self"))
    rpc.shutdown(graceful=False)
    return out


@pytest.mark.spec("LIFE-5", "SHUT-6")
def test_dynamic_member_stopping_without_leaving_stays_listed_and_calls_to_it_fail(
    world: Any, tmp_path: Path
) -> None:
    got = world.spawn(_prog_leave_without_telling, str(tmp_path), world_size=2)
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


def _prog_join_past_a_stopped_member(ctx: Any, where: str) -> Any:
    """Rank 1 stops without leaving; rank 2 then tries to join the group that still lists it."""
    if ctx.rank == 2:
        _after(ctx, where, "1-stopped")
        got = _bounded(ctx.backend, lambda: _dynamic_init(ctx), 15.0)
        _mark(where, "2-tried")
        return got
    if ctx.rank == 1:
        _after(ctx, where, "0-in")
    _dynamic_init(ctx)
    _mark(where, f"{ctx.rank}-in")
    if ctx.rank == 1:
        ctx.rpc.shutdown(graceful=False)
        _mark(where, "1-stopped")
        return None
    _after(ctx, where, "2-tried")
    members = _members(ctx.backend)
    ctx.rpc.shutdown(graceful=False)
    return members


@pytest.mark.spec("LIFE-5")
def test_joining_past_a_member_that_stopped_without_leaving_fails_and_no_member_lists_the_joiner(
    world: Any, tmp_path: Path
) -> None:
    got = world.spawn(_prog_join_past_a_stopped_member, str(tmp_path), world_size=3)
    assert got[0] == [("worker0", 0), ("worker1", 1)]  # the failed joiner is nowhere
    assert got[2] != "still running", "init_rpc still blocked 15 s after it started"
    kinds, message = got[2]
    assert "RuntimeError" in kinds and "worker1" in message


def _prog_static_then_dynamic(ctx: Any, where: str) -> Any:
    """Ranks 0 and 1 form a static group of 2; rank 2 then tries to join it dynamically."""
    if ctx.rank < 2:
        ctx.init_rpc(world_size=2)
        _mark(where, f"{ctx.rank}-in")
        _after(ctx, where, "2-tried")
        got = ctx.rpc.rpc_sync(ctx.name(1 - ctx.rank), _whoami, args=(ctx.backend, "static"))
        ctx.rpc.shutdown()
        return got
    _after(ctx, where, "0-in", "1-in")
    got = outcome(lambda: _dynamic_init(ctx))
    _mark(where, "2-tried")
    return got


@pytest.mark.spec("LIFE-5")
def test_joining_a_static_group_dynamically_raises_pytorchs_error(world: Any, tmp_path: Path) -> None:
    got = world.spawn(_prog_static_then_dynamic, str(tmp_path), world_size=3)
    assert got[2] == (
        ("RuntimeError",),
        "RPC group mixes statically and dynamically initialized members which is not supported. ",
    )  # PyTorch's text, trailing space included
    assert got[:2] == [("worker1", "static"), ("worker0", "static")]  # the static group is unharmed


def _prog_duplicate_name_joins_late(ctx: Any, where: str) -> Any:
    if ctx.rank == 0:
        _dynamic_init(ctx, "same-name")
        _mark(where, "0-in")
        _after(ctx, where, "1-tried")
        members = _members(ctx.backend)
        # Not graceful: PyTorch's refused joiner never gives the membership token back (it raises
        # inside _group_membership_management), so a graceful leave would wait for it for ever.
        ctx.rpc.shutdown(graceful=False)
        return members
    _after(ctx, where, "0-in")
    got = outcome(lambda: _dynamic_init(ctx, "same-name"))
    _mark(where, "1-tried")
    return got


@pytest.mark.spec("LIFE-5", "LIFE-2")
def test_dynamic_joiner_with_a_members_name_is_refused(world: Any, tmp_path: Path) -> None:
    got = world.spawn(_prog_duplicate_name_joins_late, str(tmp_path), world_size=2)
    assert got[0] == [("same-name", 0)]
    kinds, message = got[1]
    assert kinds == ("RuntimeError",)
    assert message.startswith("RPC worker name same-name is not unique. Workers 1 and 0 share the same name.")
