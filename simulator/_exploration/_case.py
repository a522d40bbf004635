"""One run: a *case* (seed, fault plan, network and compute models), its outcome, and :func:`replay`.

A run is a pure function of (program, world size, args, case): that is what makes a cache of
verdicts sound during shrinking, and a replay exact.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import greenlet

from .._config import SimConfig
from .._model._compute import ComputeModel
from .._model._files import plan_of
from .._model._network import NetworkModel
from .._model._plan import FaultPlan
from .._simulation import RunResult
from ._signature import _first_line, _short_type


@dataclass(frozen=True, slots=True)
class Case:
    """One run's inputs besides the program: what :func:`explore` draws, shrinks and replays.

    A case is the part of a :class:`~twinrpc.simulator.SimConfig` that differs from run to run;
    :meth:`config` puts it over the settings every run shares (world size, trace, monitors, time limit).

    Attributes:
        seed: the simulation's seed (latency jitter, ties between events).
        faults: the fault plan (an empty plan: none).
        network: the network model; ``None`` is the default :class:`NetworkModel`.
        compute: the compute model; ``None``: computing is free (:class:`ComputeModel`).
    """

    seed: int
    faults: FaultPlan = dataclasses.field(default_factory=FaultPlan)
    network: NetworkModel | None = None
    compute: ComputeModel | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): ``{"seed": ..., "faults": {...}, "network": {...} | None,
        "compute": {...} | None}``."""
        return {
            "seed": self.seed,
            "faults": self.faults.to_dict(),
            "network": None if self.network is None else self.network.to_dict(),
            "compute": None if self.compute is None else self.compute.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        """The inverse of :meth:`to_dict` (a missing ``network`` or ``compute``: the default)."""
        network = data.get("network")
        compute = data.get("compute")
        return cls(
            seed=int(data["seed"]),
            faults=FaultPlan.from_dict(data.get("faults") or {}),
            network=None if network is None else NetworkModel.from_dict(network),
            compute=None if compute is None else ComputeModel.from_dict(compute),
        )

    def config(self, base: SimConfig) -> SimConfig:
        """The settings of this case's run: ``base`` with this case's seed, plan, network and compute
        models (each of the case's, ``None`` included, replaces the base's)."""
        return dataclasses.replace(
            base, seed=self.seed, faults=self.faults, network=self.network, compute=self.compute
        )

    @classmethod
    def of(cls, config: SimConfig) -> Case:
        """The case of ``config`` (its swarm, if it has one, resolved into the plan it draws)."""
        return cls(config.seed, config.plan() or FaultPlan(), config.network, config.compute)


def case_key(case: Case) -> str:
    """A case as canonical JSON text: equal keys, equal runs."""
    return json.dumps(case.to_dict(), sort_keys=True)


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one run did: its result, or the error that failed it and where it came from."""

    result: RunResult | None
    error: BaseException | None = None
    #: the worker whose program raised ``error`` (None: the simulation or ``check`` raised it)
    rank: int | None = None
    #: virtual time at which ``error`` was raised (None when unknown)
    time: float | None = None
    #: what the simulation did afterwards (e.g. deadlocked because the failed worker never shut down)
    then: BaseException | None = None
    #: who raised ``error`` when no worker did: "the simulation", "the check", "the test"
    source: str = "the simulation"
    #: how long the run took in virtual seconds (None: unknown)
    duration: float | None = None

    def where(self) -> str:
        if self.error is None:
            return "passed"
        who = self.source if self.rank is None else f"worker {self.rank}"
        when = "" if self.time is None else f" at t={self.time:.6f} s"
        text = f"{_short_type(self.error)} raised by {who}{when}"
        if self.then is not None:
            text += f"; then {_short_type(self.then)}: {_first_line(str(self.then))}"
        return text


def _run(
    program: Callable[..., Any],
    config: SimConfig,
    args: Sequence[Any] = (),
    *,
    check: Callable[[RunResult], object] | None = None,
) -> _Outcome:
    """Run ``program`` once as ``config`` says. The failure, if any, is the *first* error: a worker's
    exception comes before the deadlock it causes (its peers then wait for it forever at shutdown)."""
    sim = config.build()
    raised: list[tuple[int, float, BaseException]] = []

    def worker(rank: int, *worker_args: Any) -> Any:
        try:
            return program(rank, *worker_args)
        except greenlet.GreenletExit:
            raise
        except BaseException as exc:
            raised.append((rank, sim.now, exc))
            raise

    try:
        result = sim.run(worker, *args, check=False)
    except Exception as exc:  # deadlock, monitor violation, a protocol task failed, max_time
        if raised:
            rank, when, first = raised[0]
            return _Outcome(None, first, rank, when, then=exc, duration=sim.now)
        at = getattr(exc, "time", None)
        return _Outcome(None, exc, None, at if isinstance(at, float) else sim.now, duration=sim.now)
    if raised:
        rank, when, first = raised[0]
        return _Outcome(result, first, rank, when, duration=result.virtual_time)
    if check is not None:
        try:
            verdict = check(result)
        except Exception as exc:
            return _Outcome(result, exc, source="the check", duration=result.virtual_time)
        if verdict is False:
            name = getattr(check, "__qualname__", repr(check))
            error = AssertionError(f"check {name}(result) returned False")
            return _Outcome(result, error, source="the check", duration=result.virtual_time)
    return _Outcome(result, duration=result.virtual_time)


def replay(
    program: Callable[..., Any],
    world_size: int | None = None,
    *,
    seed: int | None = None,
    faults: FaultPlan | dict[str, Any] | str | None = None,
    network: NetworkModel | dict[str, Any] | None = None,
    compute: ComputeModel | dict[str, Any] | None = None,
    config: SimConfig | None = None,
    args: Sequence[Any] = (),
    check: Callable[[RunResult], object] | None = None,
    trace: bool | None = None,
    monitors: bool | None = None,
    max_time: float | None = None,
) -> RunResult:
    """Run ``program(rank, *args)`` once under exactly the case :func:`explore` reports.

    ``faults`` may be a :class:`FaultPlan`, its data form or that data as JSON text; ``network`` and
    ``compute`` a :class:`NetworkModel` and a :class:`ComputeModel` or their fields. The settings
    not given here come from ``config`` (a :class:`~twinrpc.simulator.SimConfig`; by default seed 0,
    no faults, a trace, the monitors on); ``world_size`` is needed unless ``config`` gives it. The
    run fails the way :func:`explore` judged it: the first worker error is re-raised (before the
    deadlock it may cause), else the simulation's own error, else ``check(result)``'s (a ``False``
    verdict raises ``AssertionError``).

    Returns:
        The run's :class:`RunResult` (with a trace, unless ``trace=False``).
    """
    if world_size is None and config is None:
        raise TypeError("replay() needs a world_size (or a config=SimConfig(world_size=...))")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    given = SimConfig.merged(
        config,
        world_size=world_size,
        seed=seed,
        faults=_plan_of(faults),
        network=_model_of(network, NetworkModel, "network"),
        compute=_model_of(compute, ComputeModel, "compute"),
        trace=trace,
        monitors=monitors,
        max_time=max_time,
    )
    outcome = _run(program, Case.of(given).config(given), args, check=check)
    if outcome.error is not None:
        if hasattr(outcome.error, "add_note"):
            outcome.error.add_note(f"twinrpc.simulator.replay: {outcome.where()}")
        raise outcome.error
    assert outcome.result is not None
    return outcome.result


def _plan_of(faults: FaultPlan | dict[str, Any] | str | None) -> FaultPlan | None:
    """A plan given as a :class:`FaultPlan`, its data, or that data as JSON text."""
    if faults is None or isinstance(faults, FaultPlan):
        return faults
    if isinstance(faults, dict | str):
        return plan_of(faults, "faults")
    raise TypeError(f"faults must be a FaultPlan, its data (dict) or JSON text, got {faults!r}")


def _model_of(value: Any, kind: type[Any], name: str) -> Any:
    """A network or compute model given as itself or as a dict of its fields."""
    if value is None or isinstance(value, kind):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a {kind.__name__} or a dict of its fields, got {value!r}")
    return kind.from_dict(value)
