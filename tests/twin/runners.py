"""Run one twin program in both worlds and decide whether they agree.

* :class:`SimRunner` runs it in :class:`~twinrpc.simulator.Simulation` under several seeds; the
  set of outcomes is everything the simulator says may happen.
* :class:`GlooRunner` runs it in real processes through the conformance harness's gloo backend
  (``conformance.harness``): programs without departures share a started pool world (a call costs
  milliseconds), programs where a worker leaves or dies get a fresh world of warm spare processes.
* :func:`check` is the differential verdict: the gloo outcome must be one the simulator produced
  for some seed. Where the simulator is deterministic that means equal; where it is not (a race
  the seeds explore), the real world may take either branch. A gloo outcome the default network
  model does not produce is looked for under :data:`LOADED_HOST` too: a loaded host delays
  deliveries far beyond the default jitter (spec/simulator.md, "Delivery delays on a loaded host").
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.harness import BackendConfig
from conformance.harness._gloo import GlooBackend
from conformance.harness._sim import SimContext

from .interpreter import interpret
from .outcome import Outcome, first_difference, fragment
from .programs import Program

__all__ = ["GlooRunner", "SimRunner", "Verdict", "check"]

#: wall-clock bound of one program in the gloo world (a program takes a few seconds at most)
GLOO_TIMEOUT = 90.0
#: virtual-time bound of one simulated program
SIM_MAX_TIME = 600.0
#: the network model of a loaded host: deliveries over different links overtake each other by up to
#: 20 ms (the default jitter is 20 us)
LOADED_HOST_JITTER = 0.02
#: seeds run under the loaded-host model when the default model did not produce the gloo outcome
LOADED_HOST_SEEDS = tuple(range(32))
#: the gloo world programs without departures run in (their operations name only ranks below
#: ``Program.world_size``; the others idle, so the simulator runs just ``Program.world_size``
#: workers). One size means one pooled gloo world: the harness keeps at most 8 pooled processes, so
#: pools of 2, 3 and 4 would evict each other.
POOL_WORLD_SIZE = 4


def world_size_of(program: Program) -> int:
    """How many workers run ``program``: its own size in a fresh world, else the pooled size."""
    return program.world_size if program.departures else max(program.world_size, POOL_WORLD_SIZE)


def _run_id() -> str:
    return uuid.uuid4().hex[:12]


class SimRunner:
    """Runs programs in fresh simulations, one per seed of ``seeds``."""

    def __init__(self, seeds: Sequence[int] = (0, 1, 2), *, jitter: float | None = None) -> None:
        self.seeds = tuple(seeds)
        #: the network model's jitter (None: the default model)
        self.jitter = jitter

    def run(self, program: Program, seed: int) -> Outcome:
        """One simulation of ``program`` with ``seed``; never raises for what the program does."""
        from twinrpc.simulator import NetworkModel, Simulation

        n = program.world_size
        network = None if self.jitter is None else NetworkModel(jitter=self.jitter)
        # Monitors off: they check the simulator's RRef invariants, which the gloo world cannot check;
        # the twin test compares only what programs observe.
        sim = Simulation(n, seed=seed, network=network, max_time=SIM_MAX_TIME, trace=False, monitors=False)
        run_id = _run_id()
        spawned = program.departures

        def worker(rank: int) -> Any:
            import twinrpc.rpc as rpc

            ctx = SimContext(rank=rank, world_size=n, backend="sim", spawned=spawned, sim=sim)
            if spawned:
                return interpret(ctx, program, run_id)
            # world.run's shape, as the gloo pool: everyone initialised, the driver runs, all shut down
            rpc.init_rpc(ctx.name(rank), rank=rank, world_size=n)
            try:
                return interpret(ctx, program, run_id)
            finally:
                rpc.shutdown()

        try:
            result = sim.run(worker, check=False)
        except Exception as exc:
            return Outcome(failure=f"simulation failed: {type(exc).__name__}: {fragment(str(exc))}")
        errors = [o for o in result.outcomes if o.error is not None]
        if errors:
            e = errors[0]
            return Outcome(failure=f"rank {e.rank} raised {type(e.error).__name__}: {fragment(str(e.error))}")
        return Outcome.from_values(list(result.values()), frozenset(result.crashed))

    def outcomes(self, program: Program) -> dict[Outcome, list[int]]:
        """Every distinct outcome over the seeds, with the seeds that produced it."""
        seen: dict[Outcome, list[int]] = {}
        for seed in self.seeds:
            seen.setdefault(self.run(program, seed), []).append(seed)
        return seen


class GlooRunner:
    """Runs programs in real gloo-world processes; :meth:`close` releases them."""

    def __init__(
        self, tmp_dir: Path | None = None, *, timeout: float = GLOO_TIMEOUT, spares: int = 4
    ) -> None:
        self._tmp = None if tmp_dir is not None else tempfile.TemporaryDirectory(prefix="twin-")
        base = tmp_dir if tmp_dir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.backend = GlooBackend(BackendConfig(world_timeout=timeout, tmp_dir=base, spares=spares))
        self.timeout = timeout

    def run(self, program: Program) -> Outcome:
        """One run of ``program``; a hung or crashed world is an outcome (``failure``), not an error."""
        n = world_size_of(program)
        args = (program, _run_id())
        killed = program.killed()
        try:
            if program.departures:
                values = self.backend.spawn(
                    interpret, args, world_size=n, timeout=self.timeout, expect_dead=killed
                )
            else:
                values = self.backend.run(interpret, args, world_size=n, ranks=[0], timeout=self.timeout)
        except Exception as exc:
            return Outcome(failure=f"a rank raised {type(exc).__name__}: {fragment(str(exc))}")
        except BaseException as exc:  # the harness's fail_world: a hang or an unexpected death
            if type(exc).__name__ != "Failed":
                raise
            return Outcome(failure=f"world failed: {fragment(str(exc))}")
        return Outcome.from_values(values, killed)

    def close(self) -> None:
        self.backend.close()
        if self._tmp is not None:
            self._tmp.cleanup()


@dataclass
class Verdict:
    """The differential result for one program."""

    program: Program
    sim: dict[Outcome, list[int]]
    gloo: Outcome
    gloo_runs: int = 1
    notes: list[str] = field(default_factory=list)
    #: outcomes under the loaded-host network model (only looked for when ``sim`` lacks gloo's)
    loaded: dict[Outcome, list[int]] = field(default_factory=dict)

    @property
    def agree(self) -> bool:
        return self.gloo in self.sim or self.gloo in self.loaded

    def report(self) -> str:
        """The shrunk program, every simulated outcome with its seeds, the gloo outcome, the first
        difference, and how to replay it."""
        p = self.program
        parts = ["twin program:", p.source(), ""]
        for outcome, seeds in self.sim.items():
            parts += [f"simulator, seeds {seeds}:", outcome.render(p), ""]
        for outcome, seeds in self.loaded.items():
            parts += [
                f"simulator, loaded-host network (jitter {LOADED_HOST_JITTER} s), seeds {seeds}:",
                outcome.render(p),
                "",
            ]
        parts += ["gloo:", self.gloo.render(p), ""]
        closest = min(self.sim, key=lambda o: _distance(o, self.gloo, p))
        parts.append(first_difference(closest, self.gloo, p))
        parts.append(
            '\nreplay: python -c \'import sys; sys.path[:0] = ["tests", "."]; from twin import *; '
            f"print(check({p!r}).report())'"
        )
        return "\n".join(parts + self.notes)


def _distance(a: Outcome, b: Outcome, program: Program) -> int:
    la, lb = a.lines(program), b.lines(program)
    return sum(x != y for x, y in zip(la, lb, strict=False)) + abs(len(la) - len(lb))


def check(
    program: Program, *, sim: SimRunner | None = None, gloo: GlooRunner | None = None, gloo_runs: int = 1
) -> Verdict:
    """Run ``program`` on the simulator (every seed) and on gloo (``gloo_runs`` times, stopping at the
    first outcome the simulator does not produce)."""
    sim = sim or SimRunner()
    own = gloo is None
    runner = gloo or GlooRunner()
    try:
        sim_outcomes = sim.outcomes(program)
        outcome = runner.run(program)
        runs = 1
        while runs < gloo_runs and outcome in sim_outcomes:
            outcome = runner.run(program)
            runs += 1
    finally:
        if own:
            runner.close()
    loaded: dict[Outcome, list[int]] = {}
    if outcome not in sim_outcomes:
        loaded = SimRunner(LOADED_HOST_SEEDS, jitter=LOADED_HOST_JITTER).outcomes(program)
    return Verdict(program, sim_outcomes, outcome, runs, loaded=loaded)
