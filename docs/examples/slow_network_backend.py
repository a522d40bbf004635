"""A conformance backend of your own: twinrpc's simulator behind a slow, jittery network.

The conformance harness needs two methods, ``run`` and ``spawn`` (see conformance/README.md). This
backend runs every program on a fresh :class:`~twinrpc.simulator.Simulation` with a 5 ms network
whose jitter reorders messages freely, to check that the suite's expectations do not depend on a fast
network.

It differs from PyTorch on purpose in one place: the worlds ``world.run`` starts give every call a
120 s default timeout (``RUN_RPC_TIMEOUT``) instead of PyTorch's 60 s, as a deployment on a slow link
would. That deviation is declared in its own file beside this module,
``slow_network_backend.deviations.toml``, which the class names in ``deviations``.

Run the suite on it: ``PYTHONPATH=docs/examples pytest conformance --backend
slow_network_backend:SlowNetworkBackend``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twinrpc.simulator import NetworkModel, Simulation

from conformance.harness import Backend, WorldContext, fail_world

SLOW = NetworkModel(latency=5e-3, jitter=5e-3, bandwidth=100e6)
RUN_RPC_TIMEOUT = 120.0  # seconds; PyTorch's default is 60 (the deviation in the .toml beside this file)


class SlowNetworkContext(WorldContext):
    """``ctx`` inside the programs: which modules serve ``ctx.rpc`` etc., and how to sleep."""

    MODULES = {
        "rpc": "twinrpc.rpc",
        "dist_autograd": "twinrpc.autograd",
        "optim": "twinrpc.optim",
        "futures": "twinrpc.futures",
        "nn": "twinrpc.nn",
    }
    simulated = True  # the workers are tasks of one Simulation: tests start no blocking threads

    def _make_options(self, k: int, /, **kwargs: Any) -> Any:
        # Simulated workers meet inside their Simulation: no init_method to allocate.
        return self.rpc.RpcBackendOptions(**kwargs)

    def sleep(self, seconds: float) -> None:
        from twinrpc.simulator import sleep

        sleep(seconds)


class SlowNetworkBackend(Backend):
    name = "slownet"  # what backends(...) markers and this backend's deviations refer to
    deviations = "slow_network_backend.deviations.toml"  # relative to this module's folder

    def _simulate(self, world_size: int, worker: Any) -> list[Any]:
        try:
            result = Simulation(world_size, seed=self.config.sim_seed, network=SLOW).run(worker)
        except Exception as exc:  # deadlock or internal failure: the world failed, not a worker
            fail_world(f"simulation failed: {type(exc).__name__}: {exc}")
        return list(result.values())  # re-raises the first worker's exception with its own type

    def run(
        self, fn: Any, args: tuple[Any, ...], *, world_size: int, ranks: Sequence[int], timeout: float
    ) -> list[Any]:
        def worker(rank: int) -> Any:
            import twinrpc.rpc as rpc

            ctx = SlowNetworkContext(rank=rank, world_size=world_size, backend=self.name, spawned=False)
            options = rpc.RpcBackendOptions(rpc_timeout=RUN_RPC_TIMEOUT)  # the deliberate difference
            rpc.init_rpc(ctx.name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
            try:
                return fn(ctx, *args) if rank in ranks else None
            finally:
                rpc.shutdown()

        return self._simulate(world_size, worker)

    def spawn(self, fn: Any, args: tuple[Any, ...], *, world_size: int, timeout: float) -> list[Any]:
        def worker(rank: int) -> Any:
            ctx = SlowNetworkContext(rank=rank, world_size=world_size, backend=self.name, spawned=True)
            return fn(ctx, *args)

        return self._simulate(world_size, worker)
