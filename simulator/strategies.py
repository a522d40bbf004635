"""Hypothesis strategies for fault plans and network models, and for RRef workloads.

For any program: :func:`fault_plans` draws :class:`~twinrpc.simulator.FaultPlan` values for a world of
a given size (by default only faults a correct program must survive), and :func:`network_models`
draws :class:`~twinrpc.simulator.NetworkModel` values. Both shrink towards fewer and milder faults and
towards the default network, so the example hypothesis reports for a failing property is a minimal
plan::

    @given(plan=fault_plans(3), seed=st.integers(0, 2**16))
    def test_training_survives(plan, seed):
        Simulation(3, seed=seed, faults=plan).run(program).values()

For the RRef protocol: a *workload* is a list of RRef operations that worker 0 (the driver) performs
in a world of three workers; a *schedule* is a plan of :func:`rref_fault_plans` (per-message delays,
drops and duplicates of retried control messages, link holds, the delay before a dead user RRef's
delete goes out) plus the simulation seed. :func:`run_workload` runs one pair with the online monitors
on; it raises :class:`~twinrpc.simulator.MonitorViolation` the moment G1, G2 or "no owner value freed
while a user exists" breaks, and ``AssertionError`` when a value read back is wrong or an owner keeps
state after every user died. Any failure is replayed exactly by calling :func:`run_workload` with the
same three arguments (:func:`replay_source` prints that call)::

    from twinrpc.simulator.strategies import *
    run_workload([Create(owner=1), Send(slot=0, holder=2)], FaultPlan(), seed=0)

Operations refer to the driver's live RRefs by ``slot`` modulo their number, so every list of
operations is valid and hypothesis can shrink freely (an operation with nothing to act on is a no-op).

This module imports hypothesis; ``import twinrpc.simulator`` does not.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from ._faults._plan import (
    FAULT_KINDS,
    KIND_NAMES,
    MESSAGE_CLASSES,
    PARTITION_MODES,
    RETRIED_MESSAGES,
    SURVIVABLE_KINDS,
    Crash,
    Delay,
    Deliver,
    Drop,
    Duplicate,
    FaultPlan,
    Hold,
    Partition,
    Pause,
)
from ._network._model import NetworkModel
from ._simulation import Simulation, sleep

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
    "fault_plans",
    "network_models",
    "replay_source",
    "rref_fault_plans",
    "run_workload",
    "schedules",
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
    import twinrpc.rpc as rpc

    return rpc.get_worker_info().id


def _make_value(i: int) -> tuple[str, int]:
    return ("v", i)


def _keep(rref: Any) -> None:
    _KEPT.setdefault(_me(), []).append(rref)


def _echo(rref: Any) -> Any:
    return rref


def _forward(rref: Any, holder: int) -> None:
    import twinrpc.rpc as rpc

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
    import twinrpc.rpc as rpc

    return rpc.api._get_current_rpc_agent().rrefs.statistics()


# -- the driver ------------------------------------------------------------------------------------
def _materialize(value: Any) -> Any:
    if isinstance(value, list):
        return ["wrap", *(_materialize(v.to_here()) for v in value)]
    return value


def _drive(workload: list[Op]) -> None:
    import twinrpc.rpc as rpc

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
    import twinrpc.rpc as rpc

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
        "from twinrpc.simulator.strategies import *\n"
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


# Value grids, smallest (or mildest) first: hypothesis shrinks towards the first element, so a shrunk
# plan has the smallest delays, the earliest and shortest windows, and "any" for kinds and links.
_EXTRAS = (10e-6, 100e-6, 1e-3, 10e-3, 0.1, 0.5)
_FRACTIONS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5)
_LENGTHS = (0.001, 0.01, 0.1, 0.5)
_GC_DELAYS = (50e-6, 0.0, 1e-3, 0.05)


def _names(values: Collection[Any], allowed: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    if isinstance(values, str):
        values = (values,)
    out = tuple(values)
    bad = [v for v in out if v not in allowed]
    if bad:
        raise ValueError(f"{what}: {bad[0]!r} is not one of {', '.join(map(str, allowed))}")
    return out


def network_models() -> st.SearchStrategy[NetworkModel]:
    """Network models from fast and even to slow and jittery; shrinks towards the default model.

    ``heartbeat_timeout`` is ``None`` (each worker's heartbeat options decide, the default) or a bound
    of 10, 1 or 0.1 s for every worker, so that silent peers are declared dead sooner or later than
    the program's options say.
    """
    return st.builds(
        NetworkModel,
        latency=st.sampled_from((50e-6, 1e-6, 500e-6, 5e-3)),
        jitter=st.sampled_from((20e-6, 0.0, 200e-6, 5e-3)),
        bandwidth=st.sampled_from((2e9, 1e8, 1e10)),
        loopback_latency=st.sampled_from((5e-6, 0.0, 50e-6)),
        failure_detection=st.sampled_from((1e-3, 1e-4, 0.1, 1.0)),
        heartbeat_timeout=st.sampled_from((None, 10.0, 1.0, 0.1)),
    )


def fault_plans(
    world_size: int = WORLD_SIZE,
    *,
    kinds: Collection[str] = SURVIVABLE_KINDS,
    messages: Collection[str | None] | None = None,
    lossy: Collection[str | None] = RETRIED_MESSAGES,
    partition_modes: Collection[str] = ("hold",),
    max_faults: int = 4,
    max_actions: int = 0,
    max_nth: int = 8,
    horizon: float = 1.0,
) -> st.SearchStrategy[FaultPlan]:
    """Fault plans for a world of ``world_size``; examples shrink towards fewer and milder faults
    (a list of faults shrinks by deleting entries; each fault towards the first message, "any" kind
    and link, the smallest delay, the earliest and shortest window), so a shrunk failing plan is
    minimal.

    The defaults draw only faults a correct program must survive (``SURVIVABLE_KINDS``; drops and
    duplicates of retried RRef control messages only; partitions that hold and heal within
    ``horizon``): a failure under them is a bug. Widen them to test failure handling, e.g.
    ``kinds=FAULT_KINDS, lossy=(None,), partition_modes=("hold", "drop")``.

    Args:
        world_size: ranks faults may name.
        kinds: fault kinds to draw from, of ``FAULT_KINDS`` (delay, duplicate, hold, partition,
            pause, drop, crash); shrinking prefers the earlier ones of ``FAULT_KINDS``.
        messages: what delays address: message classes or Kind names, ``None`` for any message
            (default: any message, or one of ``MESSAGE_CLASSES``).
        lossy: what drops, duplicates and crash triggers address (``None``: any message).
        partition_modes: ``"hold"`` (heal delivers late) and/or ``"drop"`` (cut messages are lost).
        max_faults: the most faults in a plan.
        max_actions: the length of the positional ``actions`` (0: none); their drops and
            duplicates address ``lossy`` too.
        max_nth: the largest ``nth`` (which matching message a fault hits).
        horizon: virtual seconds over which windows (holds, partitions, pauses, timed crashes) are
            placed: about the length of the program under test.
    """
    kinds = _names(kinds, FAULT_KINDS, "fault_plans(kinds=...)")
    allowed = (None, *MESSAGE_CLASSES, *KIND_NAMES)
    messages = _names(
        (None, *MESSAGE_CLASSES) if messages is None else messages, allowed, "fault_plans(messages=...)"
    )
    lossy = _names(lossy, allowed, "fault_plans(lossy=...)")
    modes = _names(partition_modes, PARTITION_MODES, "fault_plans(partition_modes=...)")
    if world_size < 1:
        raise ValueError(f"fault_plans: world_size must be >= 1, got {world_size}")
    if max_faults < 0 or max_actions < 0 or max_nth < 1 or horizon <= 0:
        raise ValueError("fault_plans: max_faults and max_actions must be >= 0, max_nth >= 1, horizon > 0")
    rank = st.integers(0, world_size - 1)
    link_end = st.one_of(st.none(), rank)
    nth = st.integers(1, max_nth)
    extra = st.sampled_from(_EXTRAS)
    at = st.sampled_from(tuple(horizon * f for f in _FRACTIONS))
    length = st.sampled_from(tuple(horizon * f for f in _LENGTHS))
    msg = st.sampled_from(messages) if messages else st.nothing()
    lossy_msg = st.sampled_from(lossy) if lossy else st.nothing()
    crash_kinds = tuple(m for m in lossy if m is not None) or MESSAGE_CLASSES

    def window(build: Any) -> Any:
        return st.builds(lambda s, n, **kw: build(start=s, end=s + n, **kw), at, length)

    options: dict[str, st.SearchStrategy[Any]] = {
        "delay": st.builds(Delay, extra, msg, link_end, link_end, nth),
        "duplicate": st.builds(Duplicate, extra, lossy_msg, link_end, link_end, nth),
        "hold": st.builds(lambda src, dst, s, n: Hold(src, dst, s, s + n), rank, rank, at, length),
        "partition": st.builds(
            lambda a, s, n, oneway, mode: Partition(tuple(a), None, s, s + n, oneway, mode),
            st.sets(rank, min_size=1, max_size=max(1, world_size - 1)),
            at,
            length,
            st.booleans(),
            st.sampled_from(modes),
        ),
        "pause": st.builds(Pause, rank, length, at),
        "drop": st.builds(Drop, lossy_msg, link_end, link_end, nth),
        "crash": st.one_of(
            st.builds(lambda w, t: Crash(w, at=t), rank, at),
            st.builds(lambda w, k, n: Crash(w, on_receive=k, nth=n), rank, st.sampled_from(crash_kinds), nth),
        ),
    }
    if world_size < 2:
        options.pop("partition")
    chosen = [options[k] for k in FAULT_KINDS if k in kinds and k in options]
    fault = st.one_of(*chosen) if chosen else st.nothing()
    action = st.one_of(
        st.just(Deliver()),
        st.builds(Delay, extra, msg),
        st.builds(Drop, lossy_msg),
        st.builds(Duplicate, extra, lossy_msg),
    )
    return st.builds(
        FaultPlan,
        faults=st.lists(fault, max_size=max_faults).map(tuple) if chosen else st.just(()),
        actions=st.lists(action, max_size=max_actions).map(tuple) if max_actions else st.just(()),
        gc_delay=st.sampled_from(_GC_DELAYS),
    )


def rref_fault_plans(max_actions: int = 40) -> st.SearchStrategy[FaultPlan]:
    """The RRef property tests' network schedules: per-message delays of any message (they reorder),
    drops and duplicates of RRef control messages and their acks (the sender's retry recovers, the
    receiver deduplicates), up to two link holds that heal, and the GC delete delay."""
    action = st.one_of(
        st.just(Deliver()),
        st.builds(Delay, extra=st.sampled_from(_RREF_EXTRAS)),
        st.just(Drop(kind="rref-control")),
        st.builds(Duplicate, extra=st.sampled_from(_RREF_EXTRAS), kind=st.just("rref-control")),
    )
    hold = st.builds(
        lambda src, dst, start, length: Hold(src, dst, start, start + length),
        src=_anyone,
        dst=_anyone,
        start=st.sampled_from([0.0, 1.1e-3, 1.3e-3, 2e-3, 5e-3]),
        length=st.sampled_from([1e-4, 1e-3, 0.05, 2.0]),
    )
    return st.builds(
        FaultPlan,
        faults=st.lists(hold, max_size=2).map(tuple),
        actions=st.lists(action, max_size=max_actions).map(tuple),
        gc_delay=st.sampled_from([0.0, 50e-6, 1e-3, 0.05]),
    )


_RREF_EXTRAS = (10e-6, 100e-6, 1e-3, 0.5)


def schedules() -> st.SearchStrategy[tuple[FaultPlan, int]]:
    """An RRef fault plan (:func:`rref_fault_plans`) and a simulation seed."""
    return st.tuples(rref_fault_plans(), st.integers(0, 2**16))
