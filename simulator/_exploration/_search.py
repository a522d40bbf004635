"""The search: hypothesis draws cases, runs them (with a cache of verdicts), and shrinks the first
failure to the smallest case that still fails the same way."""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .._errors import SimulationError
from .._model._compute import ComputeModel
from .._model._network import NetworkModel
from .._model._plan import FaultPlan
from .._model._swarm import Swarm
from .._simulation import RunResult
from ._case import Case, _Outcome, case_key
from ._failure import Failure
from ._signature import _Signature

if TYPE_CHECKING:
    from hypothesis.strategies import DataObject, SearchStrategy


#: simulation seeds are drawn from [0, SEED_RANGE)
SEED_RANGE = 2**32


class _Stopped(BaseException):
    """Ends a search from inside (its ``stop`` hook said so): :meth:`_Search.run` returns what it found."""


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
    #: the run budget hypothesis's generation is tuned for (None: ``runs``). A part of a parallel
    #: exploration (:mod:`._parallel`) is tuned as one whole exploration, so that the cases it draws
    #: do not depend on how many runs the whole has or how they are divided.
    tuned_for: int | None = None
    #: asked before each run; True ends the search there (a parallel exploration's block whose budget
    #: is spent, or whose runs a failure at a lower run index made useless)
    stop: Callable[[], bool] | None = None

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
            if self.stop is not None and self.stop():
                raise _Stopped  # after the draw: hypothesis replays the case to re-raise this
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

    def run_baseline(self) -> bool:
        """The calibration run; True when it failed (and counts)."""
        case = self.baseline
        self.calls += 1
        outcome = self.body(lambda world_size: case)
        if outcome.error is None and outcome.duration is not None and outcome.duration > 0:
            self.horizon = round_up(outcome.duration)
        found = outcome.error is not None and self.baseline_counts and self._judge(case, outcome)
        self._verdicts[case_key(case)] = found
        return found

    def after_baseline(self, horizon: float | None, counted: bool) -> None:
        """Start after a calibration run made elsewhere (it passed, and measured ``horizon``): its case
        is known to pass, and with ``counted`` it is this search's first run."""
        self.horizon = horizon
        self._verdicts[case_key(self.baseline)] = False
        if counted:
            self.calls += 1

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
        return failure_of(
            self.first,
            self.best,
            self.signature,
            found_at=self.found_at,
            calls=self.calls,
            world_size=world_size,
            program=program,
            args=args,
            check=check,
            command=command,
            exporter=exporter,
            case=case,
        )

    def _explore(self) -> bool:
        hypothesis = require_hypothesis()
        if self.calibrate and self.run_baseline():
            return True  # seed 0 without faults fails: nothing is smaller
        generate, shrink = hypothesis.Phase.generate, hypothesis.Phase.shrink
        phases = (generate, shrink) if self.shrink else (generate,)
        tuned = self.runs if self.tuned_for is None else self.tuned_for
        conf = hypothesis.settings(
            # a little more than ``runs``: a case drawn twice runs once, and runs stop at ``runs``
            max_examples=tuned + tuned // 4 + 10,
            database=None,
            deadline=None,
            phases=phases,
            suppress_health_check=list(hypothesis.HealthCheck),
            print_blob=False,
        )
        try:
            hypothesis.find(
                hypothesis.strategies.data(), self._condition, settings=conf, random=random.Random(self.seed)
            )
        except hypothesis.errors.NoSuchExample:
            return False
        except _Stopped:
            pass
        return self.first is not None


def failure_of(
    first_run: tuple[Case, _Outcome],
    best_run: tuple[Case, _Outcome],
    signature: _Signature,
    *,
    found_at: int,
    calls: int,
    world_size: int,
    program: Callable[..., Any] | None,
    args: Sequence[Any],
    check: Callable[[RunResult], object] | None,
    command: Callable[[Case], str],
    exporter: Callable[[Failure, str, str], str] | None = None,
    case: Case | None = None,
) -> Failure:
    """The :class:`Failure` of a search that found ``first_run`` at run ``found_at`` and shrank it to
    ``best_run`` by run ``calls`` (:meth:`_Search.failure`, or a search run in another process)."""
    original, first = first_run
    best, minimal = best_run
    assert first.error is not None
    failure = Failure(
        case=best if case is None else case,
        original=original,
        error=first.error,
        minimal=minimal,
        signature=signature,
        runs=found_at,
        shrink_runs=calls - found_at,
        world_size=world_size,
        program=program,
        args=args,
        check=check,
        command=command,
        exporter=exporter,
    )
    failure.__cause__ = minimal.error
    return failure


def require_hypothesis() -> ModuleType:
    """hypothesis, which exploration searches with (its ``strategies`` and ``errors`` come with it):
    says so plainly when it is missing."""
    try:
        import hypothesis  # an optional dependency (twinrpc[sim]): imported when a search starts
    except ImportError as exc:
        raise ImportError(
            "twinrpc.simulator.explore searches with hypothesis, which is not installed: "
            "pip install 'twinrpc[test]' (or pip install hypothesis)"
        ) from exc
    return hypothesis


def round_up(seconds: float) -> float:
    """``seconds`` rounded up to one significant digit (3.8 ms -> 4 ms): plans timed over it read well."""
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
    st = require_hypothesis().strategies
    if swarm:
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
    from ..strategies import fault_plans  # an optional dependency: the strategies are hypothesis's

    return fault_plans(world_size) if horizon is None else fault_plans(world_size, horizon=horizon)
