"""The backend seam: a small class with ``run`` and ``spawn`` that the ``world`` fixture drives.

To run the conformance suite against another implementation, subclass :class:`Backend` (and
:class:`~conformance.harness.WorldContext` for its ``ctx``) and pass
``--backend package.module:ClassName``. See conformance/README.md.
"""

from __future__ import annotations

import abc
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn

__all__ = [
    "BUILTIN_BACKENDS",
    "Backend",
    "BackendConfig",
    "WorkerProgram",
    "fail_world",
    "is_builtin",
    "load_backend_class",
]

#: A worker program: a module-level function called as ``fn(ctx, *args)``.
WorkerProgram = Callable[..., Any]

#: Name -> "module:Class" of the backends that ship with the harness.
BUILTIN_BACKENDS: dict[str, str] = {
    "sim": "conformance.harness._sim:SimBackend",
    "torch": "conformance.harness._torch:TorchBackend",
    "gloo": "conformance.harness._gloo:GlooBackend",
}


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """Session-wide settings every backend receives.

    Attributes:
        sim_seed: Seed for simulated backends (``--sim-seed``).
        world_timeout: Default wall-clock bound in seconds for one ``run``/``spawn`` call (``--world-timeout``).
        tmp_dir: A private scratch directory for this pytest process (rendezvous files, stack dumps).
        spares: How many pre-started interpreters a process-based backend may keep warm for ``spawn``.
    """

    sim_seed: int = 0
    world_timeout: float = 60.0
    tmp_dir: Path = Path("/tmp")
    spares: int = 4


def fail_world(message: str) -> NoReturn:
    """Fail the running test for a harness-level reason (hang, crashed worker, unpicklable program).

    Raises pytest's ``Failed``, a BaseException, so that a test's ``pytest.raises(Exception)`` around
    ``world.run`` can never swallow a hang or a dead worker and pass by accident.
    """
    __tracebackhide__ = True
    import pytest

    pytest.fail(message, pytrace=True)


class Backend(abc.ABC):
    """One way of running worker programs on a world of ranks.

    A backend object lives for the whole pytest (or pytest-xdist worker) process: create expensive
    things lazily and keep them between calls; :meth:`close` releases them at session end.

    Contract for both methods: call ``fn(ctx, *args)`` (``ctx`` a :class:`WorldContext` subclass),
    return one entry per rank, re-raise the first (rank order) worker exception with its original type
    after every rank finished, and call :func:`fail_world` instead of hanging past ``timeout`` seconds.
    """

    #: The name tests see as ``world.backend`` / ``ctx.backend`` and deviations refer to.
    name: ClassVar[str]

    #: This backend's deviations file (format in conformance/CONTRACT.md), relative to the directory
    #: of the module that defines the class, or absolute; ``None``: no deviations. Ignored by the
    #: built-in backends, whose deviations are twinrpc's ``spec/deviations.toml``, and overridden by
    #: ``--deviations FILE``.
    deviations: ClassVar[str | None] = None

    def __init__(self, config: BackendConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def run(
        self,
        fn: WorkerProgram,
        args: tuple[Any, ...],
        *,
        world_size: int,
        ranks: Sequence[int],
        timeout: float,
    ) -> list[Any]:
        """Run ``fn`` on ``ranks`` of a started world (every rank did ``init_rpc("worker{r}", ...)``).

        Ranks not in ``ranks`` serve requests only; their entry in the result is ``None``.
        """

    @abc.abstractmethod
    def spawn(
        self, fn: WorkerProgram, args: tuple[Any, ...], *, world_size: int, timeout: float
    ) -> list[Any]:
        """Run ``fn`` on every rank of a fresh world where RPC is not initialised.

        A backend that supports failure tests also accepts ``expect_dead: frozenset[int]`` (passed
        only when non-empty): ranks that kill themselves with ``ctx.crash()``, whose entries are
        ``None``; a listed rank that survives or an unlisted rank that dies fails the test.
        """

    def warm_up(self) -> None:  # noqa: B027 - optional hook
        """Called once after collection when tests will use ``world``: start slow set-up in the
        background (never block here)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release processes and files at session end. Must not hang."""

    @classmethod
    def deviations_path(cls) -> Path | None:
        """:attr:`deviations` resolved against the directory of the class's module (None if unset)."""
        if cls.deviations is None:
            return None
        path = Path(cls.deviations)
        if path.is_absolute():
            return path
        module_file = getattr(sys.modules.get(cls.__module__), "__file__", None)
        base = Path(module_file).resolve().parent if module_file else Path.cwd()
        return base / path


def is_builtin(cls: type[Backend]) -> bool:
    """Whether ``cls`` is one of the backends that ship with the harness (``sim``, ``torch``, ``gloo``)."""
    return BUILTIN_BACKENDS.get(cls.name) == f"{cls.__module__}:{cls.__qualname__}"


def load_backend_class(name: str) -> type[Backend]:
    """Resolve ``--backend``: a built-in name or ``package.module:ClassName``.

    Raises:
        ValueError: for an unknown name or a target that is not a Backend subclass.
    """
    target = BUILTIN_BACKENDS.get(name, name)
    if ":" not in target:
        raise ValueError(
            f"unknown backend {name!r}: use one of {sorted(BUILTIN_BACKENDS)} or 'package.module:BackendClass'"
        )
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ValueError(f"backend {name!r}: {target} is not a conformance.harness.Backend subclass")
    return cls
