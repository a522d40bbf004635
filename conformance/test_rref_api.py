"""The RRef user API: to_here, local_value, owner, confirmed_by_owner, pickling, passing RRefs around.

Requirements RREF-4..RREF-8 and RREF-11, with ERR-3 for ``remote()`` errors. Values held by RRefs are
instances of :class:`Box` (a plain Python class) where identity matters: PyTorch converts JIT-typable
values such as ``dict``/``list`` on every ``to_here``/``local_value`` call, so only opaque Python
objects and tensors keep their identity on the owner.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from conformance._support import backend_sleep, outcome, rpc_module


class Box:
    """An opaque Python value; compares by content so copies can be checked."""

    def __init__(self, items: list[int]) -> None:
        self.items = items

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Box) and other.items == self.items

    __hash__ = None  # type: ignore[assignment]


class RRefBoom(Exception):
    """Raised by a remote() user function; must come back from to_here() as this very type."""


_sleep = backend_sleep


_rpc_module = rpc_module


def _make_box(items: list[int]) -> Box:
    return Box(items)


def _slow_make_box(backend: str, seconds: float, items: list[int]) -> Box:
    _sleep(backend, seconds)
    return Box(items)


def _raise_rref_boom() -> None:
    raise RRefBoom("rref boom 13")


def _owner_view(rref: Any) -> dict[str, Any]:
    """What the receiving worker sees of an RRef passed to it as an argument."""
    out: dict[str, Any] = {"is_owner": rref.is_owner(), "owner_name": rref.owner_name()}
    out["value"] = (rref.local_value() if rref.is_owner() else rref.to_here()).items
    out["fetched"] = rref.to_here().items
    out["confirmed"] = rref.confirmed_by_owner()
    return out


_HELD: dict[str, Any] = {}


def _hold_box_in_local_rref(items: list[int]) -> Any:
    """Runs on the owner: keeps both the object and an RRef to it, returns the RRef to the caller."""
    _HELD["obj"] = Box(items)
    _HELD["rref"] = _rpc_module_of_held().RRef(_HELD["obj"])
    return _HELD["rref"]


def _rpc_module_of_held() -> Any:
    return _rpc_module(_HELD["backend"])


def _set_held_backend(backend: str) -> None:
    _HELD.clear()
    _HELD["backend"] = backend


def _check_held_identity() -> tuple[bool, bool, bool, bool]:
    rref, obj = _HELD["rref"], _HELD["obj"]
    return (rref.to_here() is obj, rref.local_value() is obj, rref.is_owner(), rref.confirmed_by_owner())


def _clear_held() -> None:
    _HELD.clear()


_outcome = outcome


# ---------------------------------------------------------------------------------------------------
# Worker programs
# ---------------------------------------------------------------------------------------------------


def _prog_local_owner_rref(ctx: Any, kind: str) -> dict[str, Any]:
    import torch

    value = Box([1, 2]) if kind == "python object" else torch.ones(3)
    rref = ctx.rpc.RRef(value)
    return {
        "is_owner": rref.is_owner(),
        "to_here_is_value": rref.to_here() is value,
        "local_value_is_value": rref.local_value() is value,
        "confirmed": rref.confirmed_by_owner(),
        "owner": (rref.owner().name, rref.owner().id),
        "owner_name": rref.owner_name(),
    }


def _prog_owner_rref_made_by_remote_worker(ctx: Any) -> dict[str, Any]:
    ctx.rpc.rpc_sync("worker1", _set_held_backend, args=(ctx.backend,))
    try:
        user = ctx.rpc.rpc_sync("worker1", _hold_box_in_local_rref, args=([4, 5],))
        return {
            "owner_side": ctx.rpc.rpc_sync("worker1", _check_held_identity),
            "user_is_owner": user.is_owner(),
            "fetched": user.to_here().items,
        }
    finally:
        ctx.rpc.rpc_sync("worker1", _clear_held)


def _prog_user_to_here_copies(ctx: Any) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_box, args=([1, 2, 3],))
    first = rref.to_here()
    first.items.append(99)
    second = rref.to_here()
    return {
        "is_owner": rref.is_owner(),
        "first": first.items,
        "second": second.items,
        "same_object": first is second,
        "owner_sees": ctx.rpc.rpc_sync("worker1", _owner_view, args=(rref,))["value"],
    }


def _prog_local_value_on_user(ctx: Any) -> tuple[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_box, args=([1],))
    rref.to_here()
    return _outcome(rref.local_value)


def _prog_confirmed_by_owner(ctx: Any) -> dict[str, Any]:
    user = ctx.rpc.remote("worker1", _make_box, args=([7],))
    value = user.to_here().items
    # The creation acknowledgement (REMOTE_RET) and the to_here reply are not ordered, so poll (bounded).
    polls = 0
    while not user.confirmed_by_owner() and polls < 40:
        ctx.sleep(0.05)
        polls += 1
    local = ctx.rpc.RRef(Box([8]))
    return {
        "value": value,
        "user_eventually": user.confirmed_by_owner(),
        "local_owner": local.confirmed_by_owner(),
        "owner_side": ctx.rpc.rpc_sync("worker1", _owner_view, args=(user,))["confirmed"],
    }


def _prog_user_rref_from_owner_stays_unconfirmed(ctx: Any) -> dict[str, Any]:
    ctx.rpc.rpc_sync("worker1", _set_held_backend, args=(ctx.backend,))
    try:
        user = ctx.rpc.rpc_sync("worker1", _hold_box_in_local_rref, args=([3],))
        before = user.confirmed_by_owner()
        fetched = user.to_here().items
        ctx.sleep(0.3)
        return {"before": before, "fetched": fetched, "after": user.confirmed_by_owner()}
    finally:
        ctx.rpc.rpc_sync("worker1", _clear_held)


def _prog_pickle_rref(ctx: Any, which: str) -> tuple[str, Any]:
    if which == "user":
        rref = ctx.rpc.remote("worker1", _make_box, args=([1],))
        rref.to_here()
    else:
        rref = ctx.rpc.RRef(Box([1]))
    return _outcome(lambda: pickle.dumps(rref))


def _prog_owner_equality(ctx: Any) -> dict[str, Any]:
    a = ctx.rpc.remote("worker1", _make_box, args=([1],))
    b = ctx.rpc.remote("worker1", _make_box, args=([2],))
    c = ctx.rpc.remote("worker2", _make_box, args=([3],))
    local = ctx.rpc.RRef(Box([4]))
    w1 = ctx.rpc.get_worker_info("worker1")
    out = {
        "a_eq_b": a.owner() == b.owner(),
        "a_eq_info": a.owner() == w1,
        "hash_eq": hash(a.owner()) == hash(b.owner()) == hash(w1),
        "a_ne_c": a.owner() != c.owner(),
        "distinct_owners": len({a.owner(), b.owner(), c.owner(), local.owner()}),
        "local_is_self": local.owner() == ctx.rpc.get_worker_info(),
        "owner_names": [r.owner_name() for r in (a, b, c, local)],
        "owner_ids": [r.owner().id for r in (a, b, c, local)],
    }
    for r in (a, b, c):
        r.to_here()
    return out


def _prog_remote_raises(ctx: Any) -> list[Any]:
    rref = ctx.rpc.remote("worker1", _raise_rref_boom)
    results = []
    for _ in range(2):
        try:
            rref.to_here()
            results.append(None)
        except Exception as exc:
            results.append((type(exc).__name__, type(exc).__module__, "rref boom 13" in str(exc)))
    # The failed remote() does not poison the owner.
    results.append(ctx.rpc.remote("worker1", _make_box, args=([6],)).to_here().items)
    return results


def _prog_generic_rref(ctx: Any) -> dict[str, Any]:
    import typing

    import torch

    alias = ctx.rpc.RRef[torch.Tensor]
    rref = ctx.rpc.RRef(torch.zeros(2))
    return {
        "origin_is_rref": typing.get_origin(alias) is ctx.rpc.RRef,
        "args": [a.__name__ for a in typing.get_args(alias)],
        "instance": isinstance(rref, ctx.rpc.RRef),
    }


def _prog_pass_user_rref(ctx: Any) -> dict[str, Any]:
    rref = ctx.rpc.remote("worker1", _make_box, args=([1, 2, 3],))
    return {
        "to_owner": ctx.rpc.rpc_sync("worker1", _owner_view, args=(rref,)),
        "to_third": ctx.rpc.rpc_sync("worker2", _owner_view, args=(rref,)),
        "here": rref.to_here().items,
    }


def _prog_to_here_waits_for_creation(ctx: Any) -> Any:
    rref = ctx.rpc.remote("worker1", _slow_make_box, args=(ctx.backend, 0.5, [9]))
    return rref.to_here().items


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


@pytest.mark.spec("RREF-4", "RREF-6", "RREF-11")
@pytest.mark.parametrize("kind", ["python object", "tensor"])
def test_local_rref_owner_returns_the_held_object_itself(world, kind):
    got = world.run_on(0, _prog_local_owner_rref, kind)
    assert got == {
        "is_owner": True,
        "to_here_is_value": True,
        "local_value_is_value": True,
        "confirmed": True,
        "owner": ("worker0", 0),
        "owner_name": "worker0",
    }


@pytest.mark.spec("RREF-4", "RREF-6")
def test_owner_to_here_returns_held_object_for_rref_it_handed_out(world):
    got = world.run_on(0, _prog_owner_rref_made_by_remote_worker)
    assert got["owner_side"] == (True, True, True, True)
    assert got["user_is_owner"] is False
    assert got["fetched"] == [4, 5]


@pytest.mark.spec("RREF-4")
def test_user_to_here_returns_an_independent_copy(world):
    got = world.run_on(0, _prog_user_to_here_copies)
    assert got["is_owner"] is False
    assert got["first"] == [1, 2, 3, 99]
    assert got["second"] == [1, 2, 3]
    assert got["same_object"] is False
    assert got["owner_sees"] == [1, 2, 3]


@pytest.mark.spec("RREF-4")
def test_to_here_waits_for_a_slow_remote_creation(world):
    assert world.run_on(0, _prog_to_here_waits_for_creation) == [9]


@pytest.mark.spec("RREF-5")
def test_local_value_on_user_raises_naming_user_and_owner(world):
    kind, message = world.run_on(0, _prog_local_value_on_user)
    assert "RuntimeError" in kind
    assert "can't call localValue() on user" in message
    assert "WorkerInfo(id=0, name=worker0)" in message
    assert "WorkerInfo(id=1, name=worker1)" in message


@pytest.mark.spec("RREF-6")
def test_confirmed_by_owner_becomes_true_for_remote_user_and_is_true_on_owner(world):
    got = world.run_on(0, _prog_confirmed_by_owner)
    assert got == {"value": [7], "user_eventually": True, "local_owner": True, "owner_side": True}


@pytest.mark.spec("RREF-6")
def test_user_rref_received_directly_from_owner_reports_unconfirmed(world):
    got = world.run_on(0, _prog_user_rref_from_owner_stays_unconfirmed)
    assert got == {"before": False, "fetched": [3], "after": False}


@pytest.mark.spec("RREF-8")
@pytest.mark.parametrize("which", ["user", "owner"])
def test_pickling_rref_outside_rpc_raises(world, which):
    kind, message = world.run_on(0, _prog_pickle_rref, which)
    assert "RuntimeError" in kind
    assert "Can not pickle rref" in message


@pytest.mark.spec("RREF-11")
def test_rref_owner_worker_infos_compare_and_hash_by_value(world):
    got = world.run_on(0, _prog_owner_equality, world_size=3)
    assert got == {
        "a_eq_b": True,
        "a_eq_info": True,
        "hash_eq": True,
        "a_ne_c": True,
        "distinct_owners": 3,
        "local_is_self": True,
        "owner_names": ["worker1", "worker1", "worker2", "worker0"],
        "owner_ids": [1, 1, 2, 0],
    }


@pytest.mark.spec("ERR-3", "RREF-4")
def test_remote_udf_exception_is_reraised_with_its_type_on_every_to_here(world):
    got = world.run_on(0, _prog_remote_raises)
    assert got == [("RRefBoom", __name__, True), ("RRefBoom", __name__, True), [6]]


@pytest.mark.spec("RREF-4")
def test_rref_class_supports_generic_subscription(world):
    got = world.run_on(0, _prog_generic_rref)
    assert got == {"origin_is_rref": True, "args": ["Tensor"], "instance": True}


@pytest.mark.spec("RREF-4", "RREF-9", "RREF-6")
def test_user_rref_passed_to_owner_and_third_worker_resolves_to_the_value(world):
    got = world.run_on(0, _prog_pass_user_rref, world_size=3)
    assert got["to_owner"] == {
        "is_owner": True,
        "owner_name": "worker1",
        "value": [1, 2, 3],
        "fetched": [1, 2, 3],
        "confirmed": True,
    }
    assert got["to_third"] == {
        "is_owner": False,
        "owner_name": "worker1",
        "value": [1, 2, 3],
        "fetched": [1, 2, 3],
        "confirmed": True,
    }
    assert got["here"] == [1, 2, 3]
