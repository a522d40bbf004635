"""Hypothesis strategies for fault plans, network models and schedules.

For any program: :func:`fault_plans` draws :class:`~twinrpc.simulator.FaultPlan` values for a world of
a given size (by default only faults a correct program must survive), and :func:`network_models`
draws :class:`~twinrpc.simulator.NetworkModel` values. Both shrink towards fewer and milder faults and
towards the default network, so the example hypothesis reports for a failing property is a minimal
plan::

    @given(plan=fault_plans(3), seed=st.integers(0, 2**16))
    def test_training_survives(plan, seed):
        Simulation(3, seed=seed, faults=plan).run(program).values()

For the RRef protocol, :func:`rref_fault_plans` draws the schedules its property tests run under (per-
message delays, drops and duplicates of retried control messages, link holds, the delay before a dead
user RRef's delete goes out) in a world of three workers, and :func:`schedules` adds the simulation
seed.

This module imports hypothesis; ``import twinrpc.simulator`` does not.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hypothesis import strategies as st

from ._exploration._rref_workload import WORLD_SIZE as _RREF_WORLD_SIZE
from ._model._network import NetworkModel
from ._model._plan import (
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

__all__ = ["fault_plans", "network_models", "rref_fault_plans", "schedules"]

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
    world_size: int = 3,
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
        src=st.integers(0, _RREF_WORLD_SIZE - 1),
        dst=st.integers(0, _RREF_WORLD_SIZE - 1),
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
