"""The ``sim`` backend: every call is a fresh deterministic simulation in this very process.

No processes and no wall-clock bound are needed: a deadlock is detected by the simulator and raised
from ``Simulation.run``, and time spent in ``ctx.sleep`` or RPC timeouts is virtual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .backend import Backend, WorkerProgram, fail_world
from .context import WorldContext

__all__ = ["SimBackend", "SimContext"]


class SimContext(WorldContext):
    """``ctx`` on the simulator: twinrpc's modules, virtual-time sleep, no rendezvous needed."""

    MODULES = {
        "rpc": "twinrpc.rpc",
        "dist_autograd": "twinrpc.autograd",
        "optim": "twinrpc.optim",
        "futures": "twinrpc.futures",
        "nn": "twinrpc.nn",
    }
    simulated = True

    def __init__(self, *, sim: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sim = sim

    def _make_options(self, k: int, /, **kwargs: Any) -> Any:
        # Simulated workers meet inside one Simulation, so there is no init_method to allocate.
        return self.rpc.RpcBackendOptions(**kwargs)

    def crash(self) -> NoReturn:
        """Crash this simulated worker (``Simulation.crash``): its tasks stop, peers see it die."""
        self._check_crash_allowed()
        self._sim.crash(self.rank)
        raise AssertionError("unreachable: Simulation.crash returned on the crashed worker")

    def sleep(self, seconds: float) -> None:
        """Sleep on the simulation's virtual clock (instant in wall time)."""
        from twinrpc.simulator import sleep

        sleep(seconds)


class SimBackend(Backend):
    """Runs each ``run``/``spawn`` as ``Simulation(world_size, seed=--sim-seed).run(...)``."""

    name = "sim"

    def _new_simulation(self, world_size: int) -> Any:
        from twinrpc.simulator import Simulation

        return Simulation(world_size=world_size, seed=self.config.sim_seed)

    def _simulate(
        self,
        sim: Any,
        worker: Callable[[int], Any],
        what: str,
        expect_dead: frozenset[int] = frozenset(),
    ) -> list[Any]:
        __tracebackhide__ = True
        seed, world_size = self.config.sim_seed, sim.world_size
        try:
            result = sim.run(worker, check=False)
        except Exception as exc:
            # Worker errors come back through result.values(); anything raised by run() itself is the
            # simulation failing as a whole (deadlock, internal error) and must not be mistaken for a
            # worker exception by a surrounding pytest.raises.
            fail_world(
                f"the simulation of {what} failed (world_size={world_size}, --sim-seed={seed}):\n"
                f"{type(exc).__name__}: {exc}"
            )
        unexpected = sorted(set(result.crashed) - expect_dead)
        if unexpected:
            fail_world(f"{what}: ranks {unexpected} crashed but are not in expect_dead (--sim-seed={seed})")
        values = list(result.values())
        survived = sorted(expect_dead - set(result.crashed))
        if survived:
            got = {r: values[r] for r in survived}
            fail_world(f"{what}: ranks {survived} were expected to die (expect_dead) but returned {got!r}")
        return values

    def run(
        self,
        fn: WorkerProgram,
        args: tuple[Any, ...],
        *,
        world_size: int,
        ranks: Sequence[int],
        timeout: float,
    ) -> list[Any]:
        __tracebackhide__ = True
        selected = frozenset(ranks)
        sim = self._new_simulation(world_size)

        def worker(rank: int) -> Any:
            import twinrpc.rpc as rpc

            ctx = SimContext(rank=rank, world_size=world_size, backend=self.name, spawned=False, sim=sim)
            rpc.init_rpc(ctx.name(rank), rank=rank, world_size=world_size)
            try:
                return fn(ctx, *args) if rank in selected else None
            finally:
                rpc.shutdown()

        return self._simulate(sim, worker, f"world.run({_qualname(fn)})")

    def spawn(
        self,
        fn: WorkerProgram,
        args: tuple[Any, ...],
        *,
        world_size: int,
        timeout: float,
        expect_dead: frozenset[int] = frozenset(),
    ) -> list[Any]:
        __tracebackhide__ = True
        sim = self._new_simulation(world_size)

        def worker(rank: int) -> Any:
            ctx = SimContext(rank=rank, world_size=world_size, backend=self.name, spawned=True, sim=sim)
            return fn(ctx, *args)

        return self._simulate(sim, worker, f"world.spawn({_qualname(fn)})", expect_dead)


def _qualname(fn: WorkerProgram) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
