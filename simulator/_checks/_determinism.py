"""``check_determinism``: run a scenario twice with the same seed and point at the first difference.

A simulation is only worth replaying if the same seed gives the same run. A program that reads the
wall clock, draws from an unseeded random generator, iterates over a set of objects hashed by
``id()``, or keeps module-level state from one run to the next breaks that; this check finds it the
way madsim does, by running twice and comparing the traces event by event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import NondeterminismError
from .._simulation import RunResult, Simulation
from .._traces._diff import diff_traces
from .._traces._trace import Trace


def _run(
    fn: Callable[..., Any], world_size: int, seed: int, args: tuple[Any, ...], sim_kwargs: dict[str, Any]
) -> tuple[Trace, RunResult | None, BaseException | None]:
    sim = Simulation(world_size, seed, **sim_kwargs)
    try:
        return sim.trace, sim.run(fn, *args, check=False), None
    except Exception as exc:  # the scenario's own failure: compare the traces up to it
        return sim.trace, None, exc


def check_determinism(
    fn: Callable[..., Any],
    world_size: int,
    seed: int = 0,
    *,
    args: tuple[Any, ...] = (),
    context: int = 3,
    **sim_kwargs: Any,
) -> RunResult:
    """Run ``fn(rank, *args)`` as ``Simulation(world_size, seed, **sim_kwargs).run`` twice and
    compare the two traces event by event.

    Returns:
        The first run's result, when both runs recorded the same trace.

    Raises:
        NondeterminismError: the traces differ; its message shows the first differing event of each
            run with ``context`` events around it, and ``divergence`` holds them.
        Exception: whatever the first run raised (a deadlock, a monitor violation...), when the
            second run recorded the same trace and raised the same type: the failure is
            deterministic, so it is passed on.
        ValueError: ``trace=False`` was passed (there would be nothing to compare).
    """
    if not sim_kwargs.get("trace", True):
        raise ValueError("check_determinism compares traces: do not pass trace=False")
    first = _run(fn, world_size, seed, args, sim_kwargs)
    second = _run(fn, world_size, seed, args, sim_kwargs)
    (trace_a, result_a, error_a), (trace_b, _result_b, error_b) = first, second
    divergence = diff_traces(trace_a, trace_b, context=context)
    if divergence is not None:
        raise NondeterminismError(
            f"the same scenario with seed {seed} ran differently twice ({len(trace_a)} vs {len(trace_b)} "
            "trace events): something in the program reads the wall clock, an unseeded random "
            "generator, id()-ordered sets, or state left over from the first run.\n"
            + divergence.describe(("run 1", "run 2")),
            divergence,
            seed,
        )
    if (error_a is None) != (error_b is None) or (error_a is not None and type(error_a) is not type(error_b)):
        raise NondeterminismError(
            f"the same scenario with seed {seed} recorded the same trace twice but ended differently: "
            f"run 1 {'raised ' + repr(error_a) if error_a is not None else 'returned'}, "
            f"run 2 {'raised ' + repr(error_b) if error_b is not None else 'returned'}",
            None,
            seed,
        )
    if error_a is not None:
        raise error_a
    assert result_a is not None
    return result_a
