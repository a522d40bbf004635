"""``SimConfig``: everything a simulation is made of, as one frozen value that every entry point takes.

:class:`~twinrpc.simulator.Simulation`, :func:`~twinrpc.simulator.explore`,
:func:`~twinrpc.simulator.replay`, an exploration's ``Case``, ``python -m twinrpc.simulator
run/explore/replay`` and the pytest fixture all build their simulation from a :class:`SimConfig`.
Their keyword arguments (``seed=``, ``network=``, ``compute=``...) are merged into one by
:meth:`SimConfig.merged`, the one place where they meet, so a setting reaches the run whichever
path it took.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._model._compute import ComputeModel
from ._model._network import NetworkModel
from ._model._plan import FaultPlan
from ._model._swarm import Swarm

if TYPE_CHECKING:
    from ._simulation import Simulation


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The settings of one simulation; ``SimConfig(3).with_seed(7).build()`` makes it.

    Each ``with_*`` method returns a copy with one setting changed; the value itself never changes, so
    a config can be shared between runs (an exploration varies the seed and the fault plan of a base
    config, run by run).

    Args:
        world_size: number of workers.
        seed: seeds every choice the simulation makes (latency jitter, ties between events).
        network: the network model; ``None``: the default :class:`NetworkModel`.
        faults: a :class:`FaultPlan`, or a :class:`Swarm` resolved into one with ``seed``; ``None``:
            no faults (the fault verbs can still add some to a running simulation).
        compute: virtual time for the torch operators tasks run (:class:`ComputeModel`); ``None``:
            computing is free.
        trace: record a trace (needed for digests and timelines).
        monitors: check the RRef invariants online (``MonitorViolation`` fails the run).
        max_time: fail the run once virtual time passes this many seconds; ``None``: no limit.

    Raises:
        ValueError: ``world_size`` is below 1, or ``max_time`` is negative.
        TypeError: a setting has the wrong type (e.g. a file name where a model belongs).
    """

    world_size: int = 1
    seed: int = 0
    network: NetworkModel | None = None
    faults: FaultPlan | Swarm | None = None
    compute: ComputeModel | None = None
    trace: bool = True
    monitors: bool = True
    max_time: float | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"SimConfig.{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))  # e.g. a NumPy integer: a plain int from here on
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        for name, kind in (
            ("network", NetworkModel),
            ("faults", (FaultPlan, Swarm)),
            ("compute", ComputeModel),
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                expected = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
                raise TypeError(f"SimConfig.{name} must be a {expected} or None, got {value!r}")
        for name in ("trace", "monitors"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SimConfig.{name} must be a bool, got {getattr(self, name)!r}")
        limit = self.max_time
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0
        ):
            raise ValueError(f"SimConfig.max_time must be a number of seconds >= 0 or None, got {limit!r}")

    # -- fluent copies -------------------------------------------------------------------------------
    def with_world_size(self, world_size: int) -> SimConfig:
        """A copy with ``world_size`` workers."""
        return dataclasses.replace(self, world_size=world_size)

    def with_seed(self, seed: int) -> SimConfig:
        """A copy with seed ``seed``."""
        return dataclasses.replace(self, seed=seed)

    def with_network(self, network: NetworkModel | None) -> SimConfig:
        """A copy with network model ``network`` (``None``: the default model)."""
        return dataclasses.replace(self, network=network)

    def with_faults(self, faults: FaultPlan | Swarm | None) -> SimConfig:
        """A copy with fault plan (or swarm) ``faults`` (``None``: no faults)."""
        return dataclasses.replace(self, faults=faults)

    def with_compute(self, compute: ComputeModel | None) -> SimConfig:
        """A copy with compute model ``compute`` (``None``: computing is free)."""
        return dataclasses.replace(self, compute=compute)

    def with_trace(self, trace: bool = True) -> SimConfig:
        """A copy that records a trace, or not."""
        return dataclasses.replace(self, trace=trace)

    def with_monitors(self, monitors: bool = True) -> SimConfig:
        """A copy that runs the online RRef monitors, or not."""
        return dataclasses.replace(self, monitors=monitors)

    def with_max_time(self, max_time: float | None) -> SimConfig:
        """A copy that fails once virtual time passes ``max_time`` seconds (``None``: no limit)."""
        return dataclasses.replace(self, max_time=max_time)

    # -- entry points --------------------------------------------------------------------------------
    def build(self) -> Simulation:
        """A new :class:`~twinrpc.simulator.Simulation` with these settings (each runs once)."""
        from ._simulation import Simulation  # at call time: the engine stands on this config, not under it

        return Simulation(config=self)

    @classmethod
    def merged(cls, config: SimConfig | None = None, **settings: Any) -> SimConfig:
        """``config`` (default: ``SimConfig()``) with every setting of ``settings`` that is not
        ``None`` put in: how an entry point's keyword arguments and its ``config=`` become one value.
        An explicit keyword wins over the config's value.

        Raises:
            TypeError: a name that is not a setting.
        """
        base = cls() if config is None else config
        if not isinstance(base, SimConfig):
            raise TypeError(f"config must be a SimConfig, got {base!r}")
        unknown = set(settings) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"not a SimConfig setting: {', '.join(sorted(unknown))}")
        given = {name: value for name, value in settings.items() if value is not None}
        return dataclasses.replace(base, **given) if given else base

    def plan(self) -> FaultPlan | None:
        """The fault plan of the run: :attr:`faults`, a :class:`Swarm` resolved with the seed."""
        if isinstance(self.faults, Swarm):
            return self.faults.plan(self.seed, self.world_size)
        return self.faults
