"""Exploration: run a program under many seeds and fault plans, shrink the first failure, replay it.

:func:`explore` is a search with hypothesis over *cases* (a simulation seed, a fault plan and a
network model). The search is seeded, and writes no example database, so the same call explores the
same cases in the same order on every machine. The first run that fails (a worker raises, a monitor
fires, the run deadlocks, or ``check(result)`` fails) fixes what "the same failure" means: the same
exception type and a message that matches the first one's pattern (numbers, addresses and times may
differ). Hypothesis then shrinks the case to the smallest one it can find that still fails that way:
fewer faults, smaller delays, a smaller seed. The :class:`Failure` it raises carries the minimal case,
the original error, a one-line replay command and :meth:`Failure.to_pytest`, the source of a
regression test that replays exactly that run.

Why hypothesis: its shrinker works on the choices that produced a case, so it shrinks any strategy a
user composes (their own fault vocabulary, their own network models) without a hand-written
minimizer, and it is deterministic under a fixed seed.

A run is a pure function of (program, world size, args, case): that is what makes a cache of verdicts
sound during shrinking, and a replay exact.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import importlib
import json
import pprint
import random
import re
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .._config import SimConfig
from .._errors import SimulationError
from .._faults._plan import FaultPlan
from .._kernel._compute import ComputeModel
from .._network._model import NetworkModel
from .._simulation import RunResult

if TYPE_CHECKING:
    from hypothesis.strategies import DataObject, SearchStrategy

__all__ = ["Case", "Exploration", "Failure", "explore", "replay"]

#: simulation seeds are drawn from [0, SEED_RANGE)
SEED_RANGE = 2**32
#: characters of the first failure's message that its pattern keeps (the head says what went wrong)
_PATTERN_CHARS = 300
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_NUMBER_PATTERN = r"\d[\d.eE+-]*"


# -- one run --------------------------------------------------------------------------------------------
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
            "faults": plan_to_data(self.faults),
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
            faults=plan_from_data(data.get("faults") or {}),
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


def plan_to_data(plan: FaultPlan) -> dict[str, Any]:
    """A fault plan as plain data (:meth:`FaultPlan.to_dict`)."""
    return plan.to_dict()


def plan_from_data(data: dict[str, Any] | str) -> FaultPlan:
    """A fault plan from :func:`plan_to_data`'s data, or from its JSON text."""
    if isinstance(data, str):
        data = json.loads(data)
        if not isinstance(data, dict):
            raise ValueError(f"a fault plan in JSON is an object, got {type(data).__name__}")
    return FaultPlan.from_dict(data)


def fault_count(plan: FaultPlan) -> int:
    """How many faults a plan holds (what shrinking minimizes): its faults and every positional
    action that is not a plain delivery."""
    from .._faults._plan import Deliver

    return len(plan.faults) + sum(1 for a in plan.actions if not isinstance(a, Deliver))


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
    import greenlet

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
        result = sim.run(worker, *args)
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
        return plan_from_data(faults)
    raise TypeError(f"faults must be a FaultPlan, its data (dict) or JSON text, got {faults!r}")


def _model_of(value: Any, kind: type[Any], name: str) -> Any:
    """A network or compute model given as itself or as a dict of its fields."""
    if value is None or isinstance(value, kind):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a {kind.__name__} or a dict of its fields, got {value!r}")
    return kind.from_dict(value)


# -- what "the same failure" means ---------------------------------------------------------------------
def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _head(message: str) -> str:
    """The part of a message that says what went wrong: up to its first traceback or stack."""
    lines = []
    for line in message.splitlines():
        if line.startswith(("Traceback (most recent call last)", "  File ")):
            break
        lines.append(line)
    return "\n".join(lines).strip()[:_PATTERN_CHARS]


def message_pattern(message: str) -> str:
    """A regex matching ``message`` with its numbers and addresses free: the same failure in another
    run has other times, ids and tensor versions. It matches from the start (``re.match``)."""
    head = _head(message)
    out: list[str] = []
    pos = 0
    for m in re.finditer(f"{_HEX.pattern}|{_NUMBER.pattern}", head):
        out.append(re.escape(head[pos : m.start()]))
        out.append("0x[0-9a-fA-F]+" if m.group().startswith("0x") else _NUMBER_PATTERN)
        pos = m.end()
    out.append(re.escape(head[pos:]))
    return "".join(out)


def _type_name(exc: BaseException) -> str:
    # by name, not identity: a program run with per-worker module copies raises per-worker classes;
    # an error known only by its printed traceback (a simulated process's) carries its type's name
    named = getattr(exc, "type_name", None)
    if isinstance(named, str):
        return named
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def _short_type(exc: BaseException) -> str:
    return _type_name(exc).rpartition(".")[2]


@dataclass(frozen=True, slots=True)
class _Signature:
    type_name: str
    pattern: str

    @classmethod
    def of(cls, exc: BaseException, match: str | None) -> _Signature:
        return cls(_type_name(exc), match if match is not None else message_pattern(str(exc)))

    def matches(self, exc: BaseException) -> bool:
        return _type_name(exc) == self.type_name and re.match(self.pattern, str(exc), re.DOTALL) is not None


# -- the result ------------------------------------------------------------------------------------------
class Failure(AssertionError):
    """A failure :func:`explore` found, shrunk to a minimal case that still fails the same way.

    Attributes:
        seed: the minimal case's simulation seed.
        faults: the minimal fault plan (``faults.describe()`` reads it; :attr:`faults_data` is its
            plain-data form).
        network: the minimal case's network model (``None``: the default).
        compute: the minimal case's compute model (``None``: computing is free).
        error: the error of the first failing run, as it was raised.
        minimal_error: the error the minimal case raises (same type, same message pattern).
        rank: the worker whose program raised ``minimal_error`` (``None``: the simulation or the check).
        original: the first failing case, before shrinking.
        runs: how many runs it took to find the failure (the failing run included).
        shrink_runs: how many more runs shrinking made.
        exception_type: the qualified name of the error's type.
        pattern: the regex the message of "the same failure" matches (``re.match``).
        replay_command: one line that replays the minimal case.
    """

    def __init__(
        self,
        *,
        case: Case,
        original: Case,
        error: BaseException,
        minimal: _Outcome,
        signature: _Signature,
        runs: int,
        shrink_runs: int,
        world_size: int,
        program: Callable[..., Any] | None,
        args: Sequence[Any],
        check: Callable[[RunResult], object] | None,
        command: Callable[[Case], str],
        exporter: Callable[[Failure, str, str], str] | None = None,
    ) -> None:
        self.case = case
        self.seed = case.seed
        self.faults = case.faults
        self.network = case.network
        self.compute = case.compute
        self.original = original
        self.error = error
        assert minimal.error is not None
        self.minimal_error = minimal.error
        self.rank = minimal.rank
        self._where = minimal.where()
        self.runs = runs
        self.shrink_runs = shrink_runs
        self.exception_type = signature.type_name
        self.pattern = signature.pattern
        self.world_size = world_size
        self.program = program
        self.program_args = tuple(args)
        self.check = check
        self.replay_command = command(case)
        self._exporter = exporter
        super().__init__(self.describe())

    @property
    def faults_data(self) -> dict[str, Any]:
        """The minimal fault plan as plain data (JSON-ready)."""
        return plan_to_data(self.faults)

    def describe(self) -> str:
        """What failed, the minimal case, and how to replay it; several lines."""
        message = _head(str(self.minimal_error)).replace("\n", " ")
        lines = [
            f"twinrpc.simulator.explore: run {self.runs} failed; shrunk in {self.shrink_runs} more runs "
            f"to seed {self.seed} and {_faults_text(fault_count(self.faults))}",
            f"  error: {self._where}",
            f"         {message}",
            f"  minimal faults: {self.faults.describe()}",
        ]
        if self.network is not None:
            lines.append(f"  network: {self.network!r}")
        if self.compute is not None:
            lines.append(f"  compute: {self.compute!r}")
        lines.append(f"  replay: {self.replay_command}")
        if self.original != self.case:
            lines.append(
                f"  first failing run: seed {self.original.seed}, "
                f"{_faults_text(fault_count(self.original.faults))}: {self.original.faults.describe()}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The failure as plain data: the minimal case, what failed, and how long it took."""
        return {
            "case": self.case.to_dict(),
            "original": self.original.to_dict(),
            "exception_type": self.exception_type,
            "pattern": self.pattern,
            "message": str(self.minimal_error),
            "rank": self.rank,
            "runs": self.runs,
            "shrink_runs": self.shrink_runs,
            "replay": self.replay_command,
        }

    def to_pytest(self, name: str = "test_regression", *, expect: Literal["pass", "fail"] = "pass") -> str:
        """The source of a pytest file that replays exactly the minimal case.

        With ``expect="pass"`` (the default) the test asserts the run now passes: commit it with the
        fix. With ``expect="fail"`` it asserts the run still fails the known way (same exception type,
        same message pattern): commit it to pin a known bug until it is fixed.

        Raises:
            ValueError: ``name`` is not a test function name, or the program (or ``check``, or an
                argument) cannot be named from another module (a lambda, a local function, a
                function of ``__main__``).
        """
        if not re.fullmatch(r"test_?\w*", name) or not name.isidentifier():
            raise ValueError(f"to_pytest(name={name!r}): a pytest test function name starts with 'test'")
        if expect not in ("pass", "fail"):
            raise ValueError(f"to_pytest(expect={expect!r}): expected 'pass' or 'fail'")
        if self._exporter is not None:
            return self._exporter(self, name, expect)
        return _export_explore(self, name, expect)


Failure.__module__ = "twinrpc.simulator"  # what pytest prints as the failing test's error: the public name


@dataclass(frozen=True, slots=True)
class Exploration:
    """What :func:`explore` did.

    Attributes:
        runs: runs made, shrinking included.
        seed: the exploration's own seed (the same seed explores the same cases).
        failure: the shrunk failure, or ``None`` when every run passed.
    """

    runs: int
    seed: int
    failure: Failure | None = None


# -- the search ------------------------------------------------------------------------------------------
class _Cached(BaseException):
    """Raised out of a run whose case has a known verdict (cheaper than running it again)."""

    def __init__(self, verdict: bool) -> None:
        super().__init__(verdict)
        self.verdict = verdict


@dataclass
class _Search:
    """One hypothesis search over cases (shared by :func:`explore` and the pytest plugin).

    ``body(draw)`` runs the program or test once; it calls ``draw(world_size)`` for its case (one
    case per run, every call returns it) and returns an :class:`_Outcome`.
    """

    body: Callable[[Callable[[int], Case]], _Outcome]
    #: the strategy of cases for a world size and the program's measured length (None: unknown)
    cases: Callable[[int, float | None], SearchStrategy[Case]]
    runs: int
    seed: int
    shrink: bool = True
    max_shrink_runs: int = 500
    match: str | None = None
    #: first run once fault-free with seed 0 (a failure there is already minimal), measuring how long
    #: the program runs in virtual time: the default fault plans place their windows over that span
    calibrate: bool = False
    #: whether a failure of that first run counts (not when the user chose which seeds to explore)
    baseline_counts: bool = True
    #: after a failure, remove faults one at a time while it still fails the same way (for plans
    #: hypothesis cannot shrink: swarm plans, drawn whole from a seed)
    minimize: bool = False
    #: the calibration run's case (seed 0, no faults; the models every run has, if fixed)
    baseline: Case = dataclasses.field(default_factory=lambda: Case(0))

    def __post_init__(self) -> None:
        #: the program's virtual duration, measured by the calibration run
        self.horizon: float | None = None
        self.calls = 0  # runs made (cache hits are not runs)
        self.found_at: int | None = None
        self.signature: _Signature | None = None
        self.first: tuple[Case, _Outcome] | None = None
        self.best: tuple[Case, _Outcome] | None = None
        self._verdicts: dict[str, bool] = {}  # by case_key(): a plan need not be hashable
        self._recent: collections.OrderedDict[str, _Outcome] = collections.OrderedDict()

    def _condition(self, data: DataObject) -> bool:
        drawn: list[Case] = []

        def draw(world_size: int) -> Case:
            if drawn:
                return drawn[0]
            case = data.draw(self.cases(world_size, self.horizon), label="case")
            drawn.append(case)
            key = case_key(case)
            verdict = self._verdicts.get(key)
            if verdict is False or (verdict is True and key in self._recent):
                raise _Cached(verdict)
            if self.found_at is None and self.calls >= self.runs:
                raise _Cached(False)  # ``runs`` cases ran (hypothesis may draw some case twice)
            if self.found_at is not None and self.calls - self.found_at >= self.max_shrink_runs:
                raise _Cached(False)  # shrink budget spent: nothing new counts as smaller
            self.calls += 1
            return case

        try:
            outcome = self.body(draw)
        except _Cached as cached:
            known = self._recent.get(case_key(drawn[0])) if cached.verdict and drawn else None
            if known is not None:
                self.best = (drawn[0], known)
            return cached.verdict
        if not drawn:
            raise SimulationError("the explored program or test never ran a simulation")
        case = drawn[0]
        verdict = self._judge(case, outcome)
        self._verdicts[case_key(case)] = verdict
        return verdict

    def _judge(self, case: Case, outcome: _Outcome) -> bool:
        error = outcome.error
        if error is None:
            return False
        if self.signature is None:
            self.signature = _Signature.of(error, self.match)
            if not self.signature.matches(error):
                self.signature = None  # the user's match= does not fit this failure: go on
                return False
            self.found_at = self.calls
            self.first = (case, outcome)
        elif not self.signature.matches(error):
            return False  # another failure: not the one being shrunk
        _drop_frames(error)
        self._recent[case_key(case)] = outcome
        while len(self._recent) > 8:
            self._recent.popitem(last=False)
        self.best = (case, outcome)
        return True

    def _baseline(self) -> bool:
        """The calibration run; True when it failed (and counts)."""
        case = self.baseline
        self.calls += 1
        outcome = self.body(lambda world_size: case)
        if outcome.error is None and outcome.duration is not None and outcome.duration > 0:
            self.horizon = round_up(outcome.duration)
        found = outcome.error is not None and self.baseline_counts and self._judge(case, outcome)
        self._verdicts[case_key(case)] = found
        return found

    def _try(self, case: Case) -> _Outcome | None:
        """Run ``case`` (within the shrink budget); its outcome if it fails the same way."""
        assert self.found_at is not None and self.signature is not None
        key = case_key(case)
        if self._verdicts.get(key) is False or self.calls - self.found_at >= self.max_shrink_runs:
            return None
        self.calls += 1
        outcome = self.body(lambda world_size: case)
        found = outcome.error is not None and self._judge(case, outcome)
        self._verdicts[key] = found
        return outcome if found else None

    def _remove_faults(self) -> None:
        """Greedy delta debugging: drop each fault (and positional action) while the failure stays."""
        assert self.best is not None
        case = self.best[0]
        progress = True
        while progress:
            progress = False
            plan = case.faults
            candidates = [
                FaultPlan(plan.faults[:i] + plan.faults[i + 1 :], plan.actions, plan.gc_delay)
                for i in range(len(plan.faults))
            ]
            if plan.actions:
                candidates.append(FaultPlan(plan.faults, (), plan.gc_delay))
            if plan.gc_delay != FaultPlan().gc_delay:
                candidates.append(FaultPlan(plan.faults, plan.actions))
            for candidate in candidates:
                smaller = dataclasses.replace(case, faults=candidate)
                if self._try(smaller) is not None:
                    case, progress = smaller, True
                    break

    def run(self) -> bool:
        """Explore; True when a failure was found (then :attr:`first` and :attr:`best` say which)."""
        found = self._explore()
        if found and self.minimize:
            self._remove_faults()
        return found

    def failure(
        self,
        *,
        world_size: int,
        program: Callable[..., Any] | None,
        args: Sequence[Any],
        check: Callable[[RunResult], object] | None,
        command: Callable[[Case], str],
        exporter: Callable[[Failure, str, str], str] | None = None,
        case: Case | None = None,
    ) -> Failure:
        """The :class:`Failure` :meth:`run` found, caused by the minimal run's error (one place for
        :func:`explore`, the pytest plugin and the ``explore`` command). ``case`` reports the minimal
        case as its caller states it (the command line may give part of it)."""
        assert self.first is not None and self.best is not None and self.signature is not None
        assert self.found_at is not None
        original, first = self.first
        best, minimal = self.best
        assert first.error is not None
        failure = Failure(
            case=best if case is None else case,
            original=original,
            error=first.error,
            minimal=minimal,
            signature=self.signature,
            runs=self.found_at,
            shrink_runs=self.calls - self.found_at,
            world_size=world_size,
            program=program,
            args=args,
            check=check,
            command=command,
            exporter=exporter,
        )
        failure.__cause__ = minimal.error
        return failure

    def _explore(self) -> bool:
        _require_hypothesis()
        if self.calibrate and self._baseline():
            return True  # seed 0 without faults fails: nothing is smaller
        from hypothesis import HealthCheck, Phase, find, settings
        from hypothesis import strategies as st
        from hypothesis.errors import NoSuchExample

        phases = (Phase.generate, Phase.shrink) if self.shrink else (Phase.generate,)
        conf = settings(
            # a little more than ``runs``: a case drawn twice runs once, and runs stop at ``runs``
            max_examples=self.runs + self.runs // 4 + 10,
            database=None,
            deadline=None,
            phases=phases,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )
        try:
            find(st.data(), self._condition, settings=conf, random=random.Random(self.seed))
        except NoSuchExample:
            return False
        return self.first is not None


def _require_hypothesis() -> None:
    """Exploration searches with hypothesis, a test dependency: say so plainly when it is missing."""
    try:
        import hypothesis  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "twinrpc.simulator.explore searches with hypothesis, which is not installed: "
            "pip install 'twinrpc[test]' (or pip install hypothesis)"
        ) from exc


def round_up(seconds: float) -> float:
    """``seconds`` rounded up to one significant digit (3.8 ms -> 4 ms): plans timed over it read well."""
    import math

    scale = 10.0 ** math.floor(math.log10(seconds))
    return float(f"{math.ceil(seconds / scale - 1e-9) * scale:.1g}")


def _drop_frames(exc: BaseException) -> None:
    """Keep a kept error's traceback printable but free its frames' locals (whole simulations)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def cases(
    world_size: int,
    faults: SearchStrategy[FaultPlan] | Callable[[int], SearchStrategy[FaultPlan]] | None = None,
    network: SearchStrategy[NetworkModel] | None = None,
    seeds: SearchStrategy[int] | None = None,
    horizon: float | None = None,
    swarm: bool = False,
    compute: ComputeModel | None = None,
) -> SearchStrategy[Case]:
    """The strategy of cases :func:`explore` draws: a seed from ``seeds`` (``None``: any 32-bit
    seed), a plan from ``faults`` (a strategy, or a function of the world size returning one;
    ``None``: :func:`default_faults` over ``horizon``) and a network model from ``network``
    (``None``: the default model, not explored); every case has the compute model ``compute``. With
    ``swarm``, the plan is the seed's swarm plan (:class:`~twinrpc.simulator.Swarm` over
    ``horizon``): the seed alone draws the faults too."""
    from hypothesis import strategies as st

    if swarm:
        from .._faults._swarm import Swarm

        maker = Swarm() if horizon is None else Swarm(duration=horizon)
        return st.builds(
            lambda seed, net: Case(seed, maker.plan(seed, world_size), net, compute),
            st.integers(0, SEED_RANGE - 1) if seeds is None else seeds,
            st.none() if network is None else network,
        )
    if faults is None:
        plans = default_faults(world_size, horizon)
    elif callable(faults) and not isinstance(faults, st.SearchStrategy):
        plans = faults(world_size)
    else:
        plans = faults
    return st.builds(
        Case,
        seed=st.integers(0, SEED_RANGE - 1) if seeds is None else seeds,
        faults=plans,
        network=st.none() if network is None else network,
        compute=st.just(compute),
    )


def default_faults(world_size: int, horizon: float | None = None) -> SearchStrategy[FaultPlan]:
    """The fault plans :func:`explore` draws unless told otherwise:
    :func:`twinrpc.simulator.strategies.fault_plans`, faults a correct program must survive (delays,
    holds and partitions that heal, pauses, lost or duplicated RRef control messages that are resent;
    no crash), with their time windows placed over ``horizon`` virtual seconds (the program's length,
    measured by a fault-free run; ``None``: one second)."""
    from ..strategies import fault_plans

    return fault_plans(world_size) if horizon is None else fault_plans(world_size, horizon=horizon)


# -- explore ---------------------------------------------------------------------------------------------
def explore(
    program: Callable[..., Any],
    world_size: int | None = None,
    *,
    args: Sequence[Any] = (),
    runs: int = 200,
    faults: SearchStrategy[FaultPlan] | Callable[[int], SearchStrategy[FaultPlan]] | None = None,
    network: SearchStrategy[NetworkModel] | None = None,
    compute: ComputeModel | None = None,
    config: SimConfig | None = None,
    seeds: SearchStrategy[int] | None = None,
    swarm: bool = False,
    seed: int | None = None,
    check: Callable[[RunResult], object] | None = None,
    match: str | None = None,
    shrink: bool = True,
    max_shrink_runs: int = 500,
    monitors: bool | None = None,
    max_time: float | None = None,
    raise_on_failure: bool = True,
) -> Exploration:
    """Run ``program(rank, *args)`` as ``world_size`` workers under many seeds and fault plans;
    shrink the first failure to a minimal case that still fails the same way.

    A run fails when a worker's program raises, an online monitor fires, the simulation deadlocks or
    fails, or ``check(result)`` raises or returns ``False``. "The same way" is the first failure's
    exception type and message pattern (its head, with numbers and addresses free), or ``match``, a
    regex its message must match (``re.match``) for a failure to count at all.

    Args:
        program: the worker program, as for :meth:`Simulation.run`.
        world_size: number of workers.
        args: extra arguments passed to every worker's program.
        runs: cases to try before giving up (shrinking runs come on top).
        faults: a hypothesis strategy of :class:`FaultPlan` (or a function of the world size returning
            one). ``None``: :func:`twinrpc.simulator.strategies.fault_plans`, faults a correct
            program survives, their windows placed over the program's length as a first fault-free
            run with seed 0 measures it (it counts as a run). To explore seeds only, pass
            ``hypothesis.strategies.just(FaultPlan())``.
        network: a strategy of :class:`NetworkModel`; ``None``: ``config``'s model, else the default.
        compute: the :class:`ComputeModel` of every run (``None``: ``config``'s, else free computing).
        config: the settings every run shares (a :class:`~twinrpc.simulator.SimConfig`: world size,
            network and compute models, monitors, time limit); the keyword arguments override it.
            Each run's seed and fault plan are drawn, so the config must leave them at their defaults.
            Runs record no trace (:func:`replay` one for its trace).
        seeds: a strategy of simulation seeds; ``None``: any 32-bit seed. ``st.just(0)`` explores
            fault plans under one seed (every failure is then explained by its faults alone).
        swarm: swarm testing: each run's faults are its seed's :class:`Swarm` plan (which kinds are
            on, their rates, windows and victims all drawn from the seed), over the program's
            measured length; a failure is then minimized by removing faults one at a time.
        seed: the exploration's seed; the same seed tries the same cases in the same order
            (``None``: 0). No example database is read or written.
        check: judges each passing run's :class:`RunResult`.
        match: only failures whose message matches this regex count.
        shrink: shrink the first failure (else report it as found).
        max_shrink_runs: at most this many runs while shrinking; the smallest failure so far wins.
        monitors: run with the online RRef monitors (:class:`RRefMonitor`); on unless turned off.
        max_time: fail a run whose virtual time passes this many seconds.
        raise_on_failure: raise the :class:`Failure` (else return it in the :class:`Exploration`).

    Raises:
        Failure: the shrunk failure (unless ``raise_on_failure=False``).
    """
    if world_size is None and config is None:
        raise TypeError("explore() needs a world_size (or a config=SimConfig(world_size=...))")
    if world_size is not None and world_size < 1:
        raise ValueError(f"explore(world_size={world_size}): at least one worker")
    if config is not None and config.seed != SimConfig().seed:
        raise ValueError(
            f"explore draws each run's seed: config=SimConfig(seed={config.seed}) would be replaced; "
            "pass seeds=hypothesis.strategies.just(seed) to explore one seed"
        )
    if config is not None and config.faults is not None:
        raise ValueError(
            "explore draws each run's fault plan: config.faults would be replaced; pass "
            "faults=hypothesis.strategies.just(plan) to explore one plan, or swarm=True"
        )
    if network is not None and config is not None and config.network is not None:
        raise ValueError("explore(network=...) draws the network model: do not give config.network too")
    base = SimConfig.merged(
        config, world_size=world_size, compute=compute, monitors=monitors, max_time=max_time, trace=False
    )
    world_size = base.world_size
    if swarm and faults is not None:
        raise ValueError("explore(swarm=True) draws its plans from the seeds: do not pass faults= too")
    if runs < 1:
        raise ValueError(f"explore(runs={runs}): at least one run")
    if not callable(program):
        raise TypeError(f"explore(program={program!r}): expected a function program(rank, *args)")
    args = tuple(args)
    seed = 0 if seed is None else seed

    networks = network
    if networks is None and base.network is not None:
        from hypothesis import strategies as st

        networks = st.just(base.network)

    def body(draw: Callable[[int], Case]) -> _Outcome:
        return _run(program, draw(base.world_size).config(base), args, check=check)

    search = _Search(
        body,
        lambda n, horizon: cases(n, faults, networks, seeds, horizon, swarm, base.compute),
        runs=runs,
        seed=seed,
        shrink=shrink and not swarm,
        max_shrink_runs=max_shrink_runs,
        match=match,
        calibrate=faults is None,
        baseline_counts=seeds is None,
        minimize=shrink and swarm,
        baseline=Case(0, network=base.network, compute=base.compute),
    )
    if not search.run():
        return Exploration(search.calls, seed)
    failure = search.failure(
        world_size=world_size,
        program=program,
        args=args,
        check=check,
        command=lambda c: replay_command(program, world_size, c, args=args, check=check),
    )
    if raise_on_failure:
        raise failure
    return Exploration(search.calls, seed, failure)


# -- replay commands and exported tests ----------------------------------------------------------------
def importable_name(obj: Any) -> str | None:
    """``"package.module:qualname"`` when ``obj`` can be imported by that name from another process
    (a module-level function or class of an importable module), else ``None``."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module == "__main__":
        module = _main_module_name()
    if not module or not qualname or "<" in qualname:
        return None
    if getattr(obj, "__module__", None) == "__main__":
        return f"{module}:{qualname}"  # found by its file: importing it would run the script again
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is obj else None


def _main_module_name() -> str | None:
    """The name under which the running script (``__main__``) imports, if it does: its file's stem,
    when that name finds that very file on ``sys.path``."""
    import importlib.util
    import os

    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main_file or not main_file.endswith(".py"):
        return None
    name = os.path.splitext(os.path.basename(main_file))[0]
    if not name.isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not os.path.samefile(spec.origin, main_file):
        return None
    return str(name)


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=False)


def replay_command(
    program: Callable[..., Any],
    world_size: int,
    case: Case,
    *,
    args: Sequence[Any] = (),
    check: Callable[[RunResult], object] | None = None,
) -> str:
    """One line that replays ``case``: ``python -m twinrpc.simulator replay module:function ...`` for
    a program importable by name, else the :func:`replay` call to make where the program lives."""
    target = importable_name(program)
    if getattr(program, "__module__", None) == "__main__":
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        qualname = getattr(program, "__qualname__", "")
        target = None
        if main_file and "<" not in qualname:
            import os

            target = f"{os.path.relpath(main_file)}:{qualname}"
    check_name = None if check is None else importable_name(check)
    if target is not None and (check is None or check_name is not None) and _is_json(list(args)):
        parts = [
            "python -m twinrpc.simulator replay",
            shlex.quote(target),
            f"--world-size {world_size}",
            f"--seed {case.seed}",
            f"--faults {shlex.quote(_json(plan_to_data(case.faults)))}",
        ]
        if case.network is not None:
            parts.append(f"--network {shlex.quote(_json(case.network.to_dict()))}")
        if case.compute is not None:
            parts.append(f"--compute {shlex.quote(_json(case.compute.to_dict()))}")
        if args:
            parts.append(f"--args {shlex.quote(_json(list(args)))}")
        if check_name is not None:
            parts.append(f"--check {shlex.quote(check_name)}")
        return " ".join(parts)
    name = getattr(program, "__qualname__", "program")
    call = f"replay({name}, {world_size}, seed={case.seed}, faults={_json(plan_to_data(case.faults))}"
    if case.network is not None:
        call += f", network={case.network.to_dict()!r}"
    if case.compute is not None:
        call += f", compute={case.compute.to_dict()!r}"
    if args:
        call += f", args={tuple(args)!r}"
    if check is not None:
        call += f", check={getattr(check, '__qualname__', 'check')}"
    return "twinrpc.simulator." + call + ")"


def _is_json(value: Any) -> bool:
    try:
        return bool(json.loads(json.dumps(value)) == value)
    except (TypeError, ValueError):
        return False


def _is_literal(value: Any) -> bool:
    """Whether ``repr(value)`` reads back as an equal value (so an exported test can write it)."""
    try:
        return bool(ast.literal_eval(repr(value)) == value)
    except (ValueError, SyntaxError):
        return False


def _import_line(name: str, alias: str) -> str:
    module, _, qualname = name.partition(":")
    top, _, rest = qualname.partition(".")
    if rest:
        return f"from {module} import {top} as _{alias}_owner\n{alias} = _{alias}_owner.{rest}"
    return f"from {module} import {top} as {alias}" if top != alias else f"from {module} import {top}"


def exception_reference(type_name: str) -> tuple[str | None, str]:
    """(import line or None, expression) naming an exception type by its qualified name, or
    (None, "") when it cannot be imported."""
    module, _, qualname = type_name.rpartition(".")
    if module == "builtins":
        return None, qualname
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError):
        return None, ""
    if "." in qualname:
        return None, ""
    return f"from {module} import {qualname}", qualname


def raises_block(type_name: str, pattern: str, indent: str, body: list[str]) -> tuple[list[str], list[str]]:
    """(imports, lines) of a ``pytest.raises`` block asserting the known failure around ``body``."""
    imports: list[str] = []
    line, expr = exception_reference(type_name)
    if line is not None:
        imports.append(line)
    lines = []
    if expr:
        lines.append(f"{indent}with pytest.raises({expr}, match=PATTERN):")
        lines.extend(f"{indent}    {b}" for b in body)
    else:
        lines.append(f"{indent}with pytest.raises(BaseException, match=PATTERN) as info:")
        lines.extend(f"{indent}    {b}" for b in body)
        module, _, qualname = type_name.rpartition(".")
        lines.append(
            f"{indent}assert (type(info.value).__module__, type(info.value).__qualname__) == "
            f"({module!r}, {qualname!r})"
        )
    return imports, lines


def regression_header(failure: Failure) -> list[str]:
    """The docstring lines of an exported regression test: what failed, and how it was found."""
    message = _head(str(failure.minimal_error)).replace("\n", " ")[:200]
    return [
        '"""Regression test exported by twinrpc.simulator (explore, then shrink).',
        "",
        f"Found by run {failure.runs}, shrunk in {failure.shrink_runs} more runs to seed {failure.seed} and "
        f"{_faults_text(fault_count(failure.faults))}:",
        f"{failure.faults.describe()}",
        "",
        f"It failed with {failure.exception_type}: {message}",
        '"""',
    ]


def _faults_text(n: int) -> str:
    return f"{n} fault{'' if n == 1 else 's'}"


def _export_explore(failure: Failure, name: str, expect: str) -> str:
    program = failure.program
    target = None if program is None else importable_name(program)
    if target is None:
        raise ValueError(
            f"to_pytest: the program {program!r} cannot be imported by name from a test module; "
            "define it at module level in an importable module (not __main__, not a lambda)"
        )
    check_name = None
    if failure.check is not None:
        check_name = importable_name(failure.check)
        if check_name is None:
            raise ValueError(
                f"to_pytest: check={failure.check!r} cannot be imported by name; define it at module level"
            )
    if not _is_literal(failure.program_args):
        raise ValueError(f"to_pytest: args={failure.program_args!r} are not Python literals")
    models = [
        name
        for name, model in (("ComputeModel", failure.compute), ("NetworkModel", failure.network))
        if model is not None
    ]
    imports = [f"from twinrpc.simulator import {', '.join([*models, 'replay'])}"]
    imports.append(_import_line(target, "program"))
    if check_name is not None:
        imports.append(_import_line(check_name, "check"))
    compute_arg = "compute=COMPUTE, " if failure.compute is not None else ""
    call = (
        f"replay(program, {failure.world_size}, seed=SEED, faults=FAULTS, network=NETWORK, "
        f"{compute_arg}args=ARGS{', check=check' if check_name else ''})"
    )
    if expect == "pass":
        doc = "The run that failed now passes."
        body = [f"    {call}"]
    else:
        doc = "The run still fails the known way (remove this test, or switch it to passing, once fixed)."
        more, body = raises_block(failure.exception_type, failure.pattern, "    ", [call])
        imports = ["import pytest", *imports, *more]
    network = "None" if failure.network is None else repr(failure.network)
    lines = [
        *regression_header(failure),
        "",
        "from __future__ import annotations",
        "",
        *imports,
        "",
        f"SEED = {failure.seed}",
        "FAULTS = " + pprint.pformat(plan_to_data(failure.faults), width=100, sort_dicts=False),
        f"NETWORK = {network}",
        *([f"COMPUTE = {failure.compute!r}"] if failure.compute is not None else []),
        f"ARGS = {failure.program_args!r}",
        f"PATTERN = {failure.pattern!r}",
        "",
        "",
        f"def {name}() -> None:",
        f'    """{doc}"""',
        *body,
        "",
    ]
    return "\n".join(lines)
