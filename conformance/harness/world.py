"""The ``world`` object tests receive: argument checking in front of a :class:`Backend`."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import Any

from .backend import Backend, WorkerProgram, fail_world

__all__ = ["World"]


class World:
    """Runs worker programs on the session's backend (see conformance/CONTRACT.md).

    The checks here are the same for every backend on purpose: a program that only works in-process
    (a lambda, a local function, unpicklable arguments) fails on ``sim`` exactly as it would on
    ``torch``, so a test written against the simulator does not break later on real processes.
    """

    def __init__(self, backend: Backend, *, default_timeout: float) -> None:
        self._backend = backend
        self._default_timeout = default_timeout

    @property
    def backend(self) -> str:
        """The backend's name: ``"sim"``, ``"torch"`` or ``"gloo"``."""
        return self._backend.name

    def __repr__(self) -> str:
        return f"<World backend={self.backend!r}>"

    def run(
        self,
        fn: WorkerProgram,
        *args: Any,
        world_size: int = 2,
        ranks: Iterable[int] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Run ``fn(ctx, *args)`` on ``ranks`` (default all) of a started world; others only serve.

        Returns one entry per rank (``None`` for idle ranks). Re-raises the first worker exception
        (rank order, original type) after every selected rank finished; fails the test if the world
        does not finish within ``timeout`` seconds (default ``--world-timeout``).
        """
        __tracebackhide__ = True
        selected = self._check(fn, args, world_size, ranks)
        return self._backend.run(
            fn, args, world_size=world_size, ranks=selected, timeout=self._timeout(timeout)
        )

    def run_on(
        self, rank: int, fn: WorkerProgram, *args: Any, world_size: int = 2, timeout: float | None = None
    ) -> Any:
        """``world.run(fn, *args, world_size=world_size, ranks=[rank])[rank]``."""
        __tracebackhide__ = True
        return self.run(fn, *args, world_size=world_size, ranks=[rank], timeout=timeout)[rank]

    def spawn(
        self,
        fn: WorkerProgram,
        *args: Any,
        world_size: int = 2,
        timeout: float | None = None,
        expect_dead: Iterable[int] = (),
    ) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank of a FRESH world; ``fn`` initialises RPC itself.

        ``expect_dead``: ranks that kill themselves on purpose (``ctx.crash()``); their entries are
        ``None``. A listed rank that survives, or an unlisted rank that dies, fails the test.
        """
        __tracebackhide__ = True
        self._check(fn, args, world_size, None)
        dead = frozenset(expect_dead)
        if not all(isinstance(r, int) and 0 <= r < world_size for r in dead) or len(dead) >= world_size:
            fail_world(f"expect_dead must be a proper subset of range({world_size}), got {expect_dead!r}")
        if not dead:  # backends written before expect_dead existed keep working
            return self._backend.spawn(fn, args, world_size=world_size, timeout=self._timeout(timeout))
        # Optional in the Backend signature: only backends that support ctx.crash() accept it.
        spawn: Callable[..., list[Any]] = self._backend.spawn
        return spawn(fn, args, world_size=world_size, timeout=self._timeout(timeout), expect_dead=dead)

    def _timeout(self, timeout: float | None) -> float:
        return self._default_timeout if timeout is None else timeout

    @staticmethod
    def _check(
        fn: WorkerProgram, args: tuple[Any, ...], world_size: int, ranks: Iterable[int] | None
    ) -> list[int]:
        __tracebackhide__ = True
        if not isinstance(world_size, int) or world_size < 1:
            fail_world(f"world_size must be a positive int, got {world_size!r}")
        selected = list(range(world_size)) if ranks is None else sorted(set(ranks))
        bad = [r for r in selected if not isinstance(r, int) or not 0 <= r < world_size]
        if bad or not selected:
            fail_world(f"ranks must be a non-empty subset of range({world_size}), got {ranks!r}")
        qualname = getattr(fn, "__qualname__", "")
        if not callable(fn) or "<" in qualname:  # <lambda>, <locals>
            fail_world(
                f"worker programs must be module-level functions (they are pickled by reference to worker "
                f"processes); got {fn!r}"
            )
        try:
            pickle.dumps((fn, args))
        except Exception as exc:
            fail_world(
                f"cannot pickle the program {qualname} or its arguments {args!r}: {type(exc).__name__}: {exc}"
            )
        return selected
