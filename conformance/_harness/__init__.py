"""The conformance harness: a pytest plugin plus the worlds it runs programs on.

Public pieces for people adding a backend (see conformance/README.md):
:class:`Backend`, :class:`BackendConfig`, :class:`WorldContext`, :func:`fail_world`, :class:`World`.
"""

from ._backend import Backend, BackendConfig, WorkerProgram, fail_world
from ._context import HarnessUsageError, WorldContext
from ._world import World

__all__ = [
    "Backend",
    "BackendConfig",
    "HarnessUsageError",
    "WorkerProgram",
    "World",
    "WorldContext",
    "fail_world",
]
