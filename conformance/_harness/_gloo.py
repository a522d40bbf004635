"""Placeholder for the real gloo world (twinrpc.impl), which does not exist yet.

``--backend gloo`` fails at session start with :attr:`GlooBackend.unavailable` rather than skipping,
so nobody mistakes an empty run for a green one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from ._backend import Backend, WorkerProgram

__all__ = ["GlooBackend"]


class GlooBackend(Backend):
    """Will run twinrpc's real gloo world; until then the plugin refuses to start with it."""

    name = "gloo"
    #: Read by the plugin at configure time: a backend with this set cannot be selected.
    unavailable: ClassVar[str | None] = "the gloo world arrives with issue #3"

    def run(
        self,
        fn: WorkerProgram,
        args: tuple[Any, ...],
        *,
        world_size: int,
        ranks: Sequence[int],
        timeout: float,
    ) -> list[Any]:
        raise NotImplementedError(self.unavailable)

    def spawn(
        self, fn: WorkerProgram, args: tuple[Any, ...], *, world_size: int, timeout: float
    ) -> list[Any]:
        raise NotImplementedError(self.unavailable)
