"""The ``ctx`` object a worker program receives: the backend's modules plus rank bookkeeping.

This module runs inside worker processes (torch backend) as well as in the pytest process (sim), so it
imports neither pytest nor any backend eagerly: each context resolves its modules on first use.
"""

from __future__ import annotations

import abc
import importlib
import time
from types import ModuleType
from typing import Any, ClassVar, NoReturn

__all__ = ["HarnessUsageError", "WorldContext"]

#: init_rpc's own keyword parameters; every other keyword given to ``ctx.init_rpc`` goes to ``ctx.options``.
_INIT_RPC_PARAMS = frozenset({"backend", "rank", "world_size", "rpc_backend_options"})


class HarnessUsageError(Exception):
    """A worker program used the ``ctx`` object in a way the harness does not support.

    Deliberately not a RuntimeError/ValueError, so ``pytest.raises(RuntimeError)`` around
    ``world.run`` never mistakes a harness misuse for the behaviour under test.
    """


class WorldContext(abc.ABC):
    """What a worker program ``fn(ctx, *args)`` sees; one instance per rank per call.

    Subclasses name the modules that implement the RPC API (``MODULES``) and say how backend options
    are built (:meth:`options`). ``init_rpc`` and ``name`` are shared so every backend agrees on the
    worker naming scheme ``worker{rank}``.

    Attributes:
        rank: This worker's rank.
        world_size: Number of ranks in the world.
        backend: The backend's name (``"sim"``, ``"torch"``, ...).
        spawned: True inside ``world.spawn`` (fresh world, RPC not initialised), False inside
            ``world.run`` (RPC already initialised; ``init_rpc`` is refused).
    """

    #: attribute -> dotted module name; resolved lazily by ``__getattr__``.
    MODULES: ClassVar[dict[str, str]] = {}
    #: True when every worker's program runs as a cooperative task of one OS thread (a simulation):
    #: a test must then not block an OS thread of its own on RPC, which would stop every worker.
    simulated: ClassVar[bool] = False

    def __init__(self, *, rank: int, world_size: int, backend: str, spawned: bool) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.spawned = spawned
        self._options_calls = 0

    def __getattr__(self, attr: str) -> ModuleType:
        # Only called for missing attributes: rpc, dist_autograd, optim, futures.
        module = type(self).MODULES.get(attr)
        if module is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {attr!r}")
        return importlib.import_module(module)

    def __repr__(self) -> str:
        kind = "spawn" if self.spawned else "run"
        return f"<{type(self).__name__} {self.backend} {kind} rank={self.rank}/{self.world_size}>"

    @staticmethod
    def name(rank: int) -> str:
        """The worker name the harness uses for ``rank``: ``"worker{rank}"``."""
        return f"worker{rank}"

    def options(self, **kwargs: Any) -> Any:
        """Backend options with a fresh rendezvous; the k-th call on every rank of one world agrees.

        That agreement is what lets a spawned program shut down and initialise again: each
        re-initialisation asks for ``ctx.options()`` once more and all ranks meet at the same new place.
        """
        k = self._options_calls
        self._options_calls += 1
        return self._make_options(k, **kwargs)

    @abc.abstractmethod
    def _make_options(self, k: int, /, **kwargs: Any) -> Any:
        """Build the backend's options object for the ``k``-th rendezvous of this world."""

    def init_rpc(self, name: str | None = None, **kwargs: Any) -> None:
        """``ctx.rpc.init_rpc(name or ctx.name(rank), rank, world_size, rpc_backend_options=ctx.options(...))``.

        Keywords that are init_rpc's own parameters (``backend``, ``rank``, ``world_size``,
        ``rpc_backend_options``) override the defaults; all other keywords go to :meth:`options`.
        Only valid inside ``world.spawn``: ``world.run``'s ranks are initialised already.
        """
        if not self.spawned:
            raise HarnessUsageError(
                "ctx.init_rpc() is for world.spawn programs; world.run's ranks already called init_rpc. "
                "Use world.spawn for lifecycle tests."
            )
        init_kwargs = {k: v for k, v in kwargs.items() if k in _INIT_RPC_PARAMS}
        option_kwargs = {k: v for k, v in kwargs.items() if k not in _INIT_RPC_PARAMS}
        init_kwargs.setdefault("rank", self.rank)
        init_kwargs.setdefault("world_size", self.world_size)
        if "rpc_backend_options" not in init_kwargs:
            init_kwargs["rpc_backend_options"] = self.options(**option_kwargs)
        elif option_kwargs:
            raise HarnessUsageError(
                f"ctx.init_rpc got rpc_backend_options and option keywords {sorted(option_kwargs)}; pass one"
            )
        self.rpc.init_rpc(name if name is not None else self.name(self.rank), **init_kwargs)

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``: wall-clock here; the simulator overrides this with virtual time."""
        time.sleep(seconds)

    def crash(self) -> NoReturn:
        """Kill this worker at once, like ``kill -9`` (failure tests; ``world.spawn`` only).

        The spawning test must name the rank in ``world.spawn(..., expect_dead=[rank])``; its entry in
        the result is then ``None``. Process backends SIGKILL the process, the simulator crashes the
        simulated worker (``Simulation.crash``). Never returns.
        """
        self._check_crash_allowed()
        raise HarnessUsageError(f"the {self.backend!r} backend does not support ctx.crash()")

    def _check_crash_allowed(self) -> None:
        if not self.spawned:
            raise HarnessUsageError(
                "ctx.crash() is for world.spawn programs (with expect_dead=[rank]); killing a rank of "
                "world.run would break the shared pool"
            )
