"""RRef workloads: lists of RRef operations run by worker 0 of a three-worker simulation, monitors on.

The RRef property tests (``tests/properties/test_rref_properties.py``, ``nox -s explore``) draw a *workload*
with :func:`workloads` and a *schedule* with :func:`twinrpc.simulator.strategies.rref_fault_plans`
(per-message delays, drops and duplicates of retried control messages, link holds, the delay before a
dead user RRef's delete goes out) plus the simulation seed. :func:`run_workload` runs one pair with the
online monitors on; it raises :class:`~twinrpc.simulator.MonitorViolation` the moment G1, G2 or "no
owner value freed while a user exists" breaks, and ``AssertionError`` when a value read back is wrong or
an owner keeps state after every user died. Any failure is replayed exactly by calling
:func:`run_workload` with the same three arguments (:func:`replay_source` prints that call)::

    from twinrpc.simulator._exploration._rref_workload import *
    run_workload([Create(owner=1), Send(slot=0, holder=2)], FaultPlan(), seed=0)

Operations refer to the driver's live RRefs by ``slot`` modulo their number, so every list of
operations is valid and hypothesis can shrink freely (an operation with nothing to act on is a no-op).
This is twinrpc's own test machinery for its RRef protocol, not a strategy of a simulator concept, so
it is private; :mod:`twinrpc.simulator.strategies` has the public strategies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

import twinrpc.rpc as rpc

from .._model._plan import FaultPlan
from .._simulation import Simulation, sleep

__all__ = [
    "WORLD_SIZE",
    "Create",
    "Delete",
    "Local",
    "Nested",
    "Release",
    "RemoteWrap",
    "Return",
    "Send",
    "Share",
    "ShareMany",
    "ToHere",
    "replay_source",
    "run_workload",
    "workloads",
]

WORLD_SIZE = 3
#: virtual seconds the driver waits at the end for deletes (and their retries) to settle
_SETTLE = 120.0


# -- operations (plain data; reprs are valid Python) ----------------------------------------------
@dataclass(frozen=True)
class Create:
    """``rpc.remote(owner, make_value)``: a new slot (a user RRef, or an owner RRef if owner is 0)."""

    owner: int


@dataclass(frozen=True)
class Local:
    """``RRef(value)`` on the driver: a new slot owned locally (RREF-3)."""


@dataclass(frozen=True)
class Share:
    """``rpc_sync(holder, keep, (rref,))``: fork to another worker (the owner or a third worker),
    which keeps it until :class:`Release`."""

    slot: int
    holder: int


@dataclass(frozen=True)
class ShareMany:
    """Concurrent forks of one RRef: ``rpc_async`` to several holders at once, then wait for all."""

    slot: int
    holders: tuple[int, ...]


@dataclass(frozen=True)
class Send:
    """Fire and forget: ``rpc_async(holder, keep, (rref,))`` and drop the driver's slot at once, so
    the parent dies while its child may still be unconfirmed (the G2 situation)."""

    slot: int
    holder: int


@dataclass(frozen=True)
class Return:
    """``rpc_sync(via, echo, (rref,))``: the RRef travels to ``via`` and comes back as a return
    value (a new slot)."""

    slot: int
    via: int


@dataclass(frozen=True)
class Nested:
    """``rpc_sync(via, forward, (rref, holder))``: ``via`` forwards the RRef to ``holder`` with a
    fire-and-forget RPC and drops its own copy (an unconfirmed grandchild)."""

    slot: int
    via: int
    holder: int


@dataclass(frozen=True)
class RemoteWrap:
    """``rpc.remote(via, wrap, (rref,))``: a value on ``via`` that holds the RRef (nested remote; a
    new slot whose value contains a fork)."""

    slot: int
    via: int


@dataclass(frozen=True)
class ToHere:
    """``rref.to_here()`` on the driver; checks the value (unwrapping nested RRefs)."""

    slot: int


@dataclass(frozen=True)
class Delete:
    """Drop the driver's reference to a slot."""

    slot: int


@dataclass(frozen=True)
class Release:
    """``rpc_sync(holder, release)``: the holder drops every RRef it keeps."""

    holder: int


Op = Create | Local | Share | ShareMany | Send | Return | Nested | RemoteWrap | ToHere | Delete | Release


# -- user functions (module level: they are pickled by reference) ----------------------------------
_KEPT: dict[int, list[Any]] = {}
_FORGOTTEN: dict[int, list[Any]] = {}


def _me() -> int:
    return rpc.get_worker_info().id


def _make_value(i: int) -> tuple[str, int]:
    return ("v", i)


def _keep(rref: Any) -> None:
    _KEPT.setdefault(_me(), []).append(rref)


def _echo(rref: Any) -> Any:
    return rref


def _forward(rref: Any, holder: int) -> None:
    _FORGOTTEN.setdefault(_me(), []).append(rpc.rpc_async(holder, _keep, args=(rref,)))


def _settle() -> None:
    """Wait for this worker's fire-and-forget forwards (so a final release comes after them)."""
    for fut in _FORGOTTEN.pop(_me(), []):
        fut.wait()


def _wrap(rref: Any) -> list[Any]:
    return [rref]


def _release() -> None:
    _KEPT.pop(_me(), None)


def _rref_stats() -> dict[str, int]:
    return rpc.api._get_current_rpc_agent().rrefs.statistics()


# -- the driver ------------------------------------------------------------------------------------
def _materialize(value: Any) -> Any:
    if isinstance(value, list):
        return ["wrap", *(_materialize(v.to_here()) for v in value)]
    return value


def _drive(workload: list[Op]) -> None:
    slots: list[tuple[Any, Any]] = []  # (rref, expected materialized value)
    pending: list[Any] = []
    counter = 0

    def pick(slot: int) -> int | None:
        return slot % len(slots) if slots else None

    for op in workload:
        if isinstance(op, Create):
            counter += 1
            slots.append((rpc.remote(op.owner, _make_value, args=(counter,)), ("v", counter)))
        elif isinstance(op, Local):
            counter += 1
            slots.append((rpc.RRef(("v", counter)), ("v", counter)))
        elif isinstance(op, Delete | Send):
            i = pick(op.slot)
            if i is None:
                continue
            rref, _ = slots.pop(i)
            if isinstance(op, Send):
                pending.append(rpc.rpc_async(op.holder, _keep, args=(rref,)))
            del rref
        elif isinstance(op, Release):
            rpc.rpc_sync(op.holder, _release)
        else:
            i = pick(op.slot)
            if i is None:
                continue
            rref, expect = slots[i]
            if isinstance(op, Share):
                rpc.rpc_sync(op.holder, _keep, args=(rref,))
            elif isinstance(op, ShareMany):
                futs = [rpc.rpc_async(h, _keep, args=(rref,)) for h in op.holders]
                for f in futs:
                    f.wait()
            elif isinstance(op, Return):
                slots.append((rpc.rpc_sync(op.via, _echo, args=(rref,)), expect))
                assert slots[-1][0].owner().id == rref.owner().id, (slots[-1], rref)
            elif isinstance(op, Nested):
                rpc.rpc_sync(op.via, _forward, args=(rref, op.holder))
            elif isinstance(op, RemoteWrap):
                slots.append((rpc.remote(op.via, _wrap, args=(rref,)), ["wrap", expect]))
            elif isinstance(op, ToHere):
                got = _materialize(rref.to_here())
                assert got == expect, f"{op}: to_here() gave {got!r}, expected {expect!r}"
            del rref
    for f in pending:
        f.wait()
    for rank in range(1, WORLD_SIZE):
        rpc.rpc_sync(rank, _settle)
    for holder in range(1, WORLD_SIZE):
        rpc.rpc_sync(holder, _release)
    _release()  # forks forwarded to the driver itself (Nested with holder 0)
    slots.clear()
    sleep(_SETTLE)  # deferred deletes and their retries settle (virtual time)
    for rank in range(WORLD_SIZE):
        stats = rpc.rpc_sync(rank, _rref_stats) if rank else _rref_stats()
        held = {k: stats[k] for k in ("num_owner_rrefs", "num_forks", "num_pending_users")}
        held["num_pending_children"] = stats["num_pending_children"]
        assert not any(held.values()), (
            f"worker {rank} keeps RRef state after every user RRef died (RREF-D1): {held}"
        )


def run_workload(workload: list[Op], plan: FaultPlan, seed: int, *, trace: bool = False) -> Simulation:
    """Run ``workload`` on a fresh 3-worker simulation under ``plan`` with ``seed`` (monitors on).

    Raises:
        MonitorViolation: an RRef invariant broke (its requirement ID and message say which).
        AssertionError: a value read back was wrong, or state was left behind after all users died.
        SimulationError: deadlock or a protocol task failed.
    """
    _KEPT.clear()
    _FORGOTTEN.clear()
    sim = Simulation(WORLD_SIZE, seed=seed, faults=plan, monitors=True, trace=trace, max_time=10_000.0)

    def program(rank: int) -> None:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD_SIZE)
        try:
            if rank == 0:
                _drive(list(workload))
        finally:
            rpc.shutdown()

    try:
        sim.run(program).values()
    finally:
        _KEPT.clear()
        _FORGOTTEN.clear()
    return sim


def replay_source(workload: list[Op], plan: FaultPlan, seed: int) -> str:
    """The Python that replays one run exactly."""
    return (
        "from twinrpc.simulator._exploration._rref_workload import *\n"
        "from twinrpc.simulator import *\n"
        f"run_workload({workload!r}, {plan!r}, seed={seed})"
    )


# -- strategies ------------------------------------------------------------------------------------
_others = st.integers(1, WORLD_SIZE - 1)
_anyone = st.integers(0, WORLD_SIZE - 1)
_slot = st.integers(0, 7)


def workloads(max_ops: int = 12) -> st.SearchStrategy[list[Op]]:
    """Lists of RRef operations (see the operation classes)."""
    op: st.SearchStrategy[Op] = st.one_of(
        st.builds(Create, owner=_anyone),
        st.builds(Local),
        st.builds(Share, slot=_slot, holder=_others),
        st.builds(ShareMany, slot=_slot, holders=st.lists(_others, min_size=2, max_size=3).map(tuple)),
        st.builds(Send, slot=_slot, holder=_others),
        st.builds(Return, slot=_slot, via=_others),
        st.builds(Nested, slot=_slot, via=_others, holder=_anyone),
        st.builds(RemoteWrap, slot=_slot, via=_anyone),
        st.builds(ToHere, slot=_slot),
        st.builds(Delete, slot=_slot),
        st.builds(Release, holder=_others),
    )
    return st.lists(op, max_size=max_ops)
