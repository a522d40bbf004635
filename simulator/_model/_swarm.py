"""Swarm testing: the fault parameters themselves drawn from the seed.

A fixed fault plan explores one adversity; running many seeds under it explores timings, not
adversities. FoundationDB's simulation and TigerBeetle's VOPR (``options_swarm``) draw *which* faults
are on, at what rates and when, from the seed of each run, so that many seeds together explore
combinations nobody wrote down. :class:`Swarm` does that for twinrpc: ``Swarm(...).plan(seed,
world_size)`` is a concrete :class:`~twinrpc.simulator.FaultPlan`, printable and replayable, and the
same seed always gives the same plan. ``Simulation(faults=Swarm(...), seed=s)`` resolves it with the
simulation's own seed, so the seed alone replays the run.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._codec import build, plain
from ._errors import FaultPlanError
from ._plan import (
    FAULT_KINDS,
    KIND_NAMES,
    MESSAGE_CLASSES,
    RETRIED_MESSAGES,
    SURVIVABLE_KINDS,
    Crash,
    Delay,
    Drop,
    Duplicate,
    Fault,
    FaultPlan,
    Hold,
    Partition,
    Pause,
)

_GC_DELAYS = (0.0, 50e-6, 1e-3, 0.05)


def _names(values: Iterable[str], allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    if isinstance(values, str):
        values = (values,)
    out = tuple(values)
    for v in out:
        if v not in allowed:
            raise FaultPlanError(f"Swarm.{what}: {v!r} is not one of {', '.join(allowed)}")
    return out


@dataclass(frozen=True, slots=True)
class Swarm:
    """Fault parameters drawn per seed (see the module docstring).

    Each kind in ``kinds`` is switched on with probability 1/2 per seed; what is on gets rates,
    delays, windows and victims drawn from the seed too.

    Args:
        kinds: fault kinds that may be switched on (of ``delay``, ``duplicate``, ``hold``,
            ``partition``, ``pause``, ``drop``, ``crash``). The default leaves out ``crash``: the
            faults a correct program must survive.
        duration: virtual seconds over which timed faults (partitions, holds, pauses, crashes) are
            placed: about the length of the run under test.
        messages: message classes or Kind names that delays address (one drawn per delay rule).
        lossy: message classes or Kind names that drops and duplicates address. The default,
            ``rref-control``, is the traffic the RRef protocol retries and deduplicates.
        max_rate: the largest per-message probability of a delay, drop or duplicate rule.
        max_window: the longest partition, hold or pause, as a fraction of ``duration``.
    """

    kinds: tuple[str, ...] = SURVIVABLE_KINDS
    duration: float = 1.0
    messages: tuple[str, ...] = MESSAGE_CLASSES
    lossy: tuple[str, ...] = RETRIED_MESSAGES
    max_rate: float = 0.3
    max_window: float = 0.25

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", _names(self.kinds, FAULT_KINDS, "kinds"))
        allowed = MESSAGE_CLASSES + KIND_NAMES
        object.__setattr__(self, "messages", _names(self.messages, allowed, "messages"))
        object.__setattr__(self, "lossy", _names(self.lossy, allowed, "lossy"))
        for name in ("duration", "max_rate", "max_window"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise FaultPlanError(f"Swarm.{name} must be a number > 0, got {value!r}")
        if self.max_rate > 1 or self.max_window > 1:
            raise FaultPlanError("Swarm.max_rate and Swarm.max_window are fractions: at most 1")
        if ("delay" in self.kinds and not self.messages) or (
            ({"drop", "duplicate"} & set(self.kinds)) and not self.lossy
        ):
            raise FaultPlanError("Swarm: a message fault kind is on but no message class is given for it")

    def plan(self, seed: int, world_size: int) -> FaultPlan:
        """The concrete plan of ``seed`` in a world of ``world_size`` (same arguments, same plan)."""
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise FaultPlanError(f"Swarm.plan: seed must be an int, got {seed!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise FaultPlanError(f"Swarm.plan: world_size must be an int >= 1, got {world_size!r}")
        rng = random.Random(f"twinrpc-swarm-{seed}-{world_size}")
        on = [k for k in FAULT_KINDS if k in self.kinds and rng.random() < 0.5]
        faults: list[Fault] = []
        span = self.duration
        window = self.duration * self.max_window

        def rate() -> float:
            return round(rng.uniform(0.01, self.max_rate), 3)

        def when() -> float:
            return round(rng.uniform(0.0, span), 6)

        for kind in on:
            if kind == "delay":
                for _ in range(rng.randint(1, 2)):
                    extra = rng.choice((10e-6, 100e-6, 1e-3, 10e-3)) * rng.choice((1, 2, 5))
                    faults.append(Delay(extra, rng.choice(self.messages), count=None, rate=rate()))
            elif kind == "duplicate":
                extra = rng.choice((0.0, 10e-6, 1e-3))
                faults.append(Duplicate(extra, rng.choice(self.lossy), count=None, rate=rate()))
            elif kind == "drop":
                faults.append(Drop(rng.choice(self.lossy), count=None, rate=rate()))
            elif kind in ("partition", "hold") and world_size > 1:
                for _ in range(rng.randint(1, 2)):
                    start = when()
                    end = round(start + rng.uniform(window / 100, window), 6)
                    if kind == "hold":
                        src, dst = rng.sample(range(world_size), 2)
                        faults.append(Hold(src, dst, start, end))
                    else:
                        a = tuple(rng.sample(range(world_size), rng.randint(1, max(1, world_size // 2))))
                        faults.append(Partition(a, None, start, end, rng.random() < 0.5))
            elif kind == "pause":
                worker = rng.randrange(world_size)
                faults.append(Pause(worker, round(rng.uniform(window / 100, window), 6), when()))
            elif kind == "crash":
                worker = rng.randrange(world_size)
                if rng.random() < 0.5:
                    faults.append(Crash(worker, at=when()))
                else:
                    faults.append(Crash(worker, on_receive=rng.choice(self.messages), nth=rng.randint(1, 5)))
        gc_delay = rng.choice(_GC_DELAYS)
        return FaultPlan(tuple(faults), gc_delay=gc_delay)

    # -- plain data --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``{"swarm": {...}}`` (the form a ``--faults`` file takes for a swarm)."""
        return swarm_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Swarm:
        """The swarm a dict of the :meth:`to_dict` form describes."""
        return swarm_from_dict(data)


def swarm_to_dict(swarm: Swarm) -> dict[str, Any]:
    return {"swarm": plain(swarm, include_defaults=True)}


def swarm_from_dict(data: Any, where: str = "") -> Swarm:
    if not isinstance(data, dict) or set(data) != {"swarm"}:
        raise FaultPlanError(f"{where or 'swarm'}: expected exactly one table, 'swarm'")
    return build(Swarm, data["swarm"], f"{where}swarm")  # type: ignore[no-any-return]
