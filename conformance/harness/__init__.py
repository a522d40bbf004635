"""The conformance harness: the pytest plugin and the public interface for adding a backend.

A backend is a :class:`Backend` subclass with ``run`` and ``spawn``; its programs receive a
:class:`WorldContext` subclass as ``ctx``. Pass it to the suite as ``--backend package.module:Class``.
A backend that runs its ranks in real processes can reuse the torch backend's machinery
(warm process pools, deadlines, stacks of hung ranks) by subclassing :class:`ProcessBackend` and
:class:`ProcessContext`. A backend's deliberate differences from PyTorch live in its own deviations file
(:attr:`Backend.deviations`, or ``--deviations FILE``), read with :func:`load_deviations`.
See conformance/README.md and conformance/CONTRACT.md.

Modules: :mod:`~conformance.harness.backend` (the seam), :mod:`~conformance.harness.context` (``ctx``),
:mod:`~conformance.harness.world` (the ``world`` fixture's object), :mod:`~conformance.harness.spec`
(requirement IDs and deviation files, no pytest), :mod:`~conformance.harness.processes` and
:mod:`~conformance.harness.child` (process backends, parent and worker side),
:mod:`~conformance.harness.plugin` (the pytest plugin). Modules with a leading underscore are the
built-in backends.
"""

from .backend import Backend, BackendConfig, WorkerProgram, fail_world
from .child import ProcessContext
from .context import HarnessUsageError, WorldContext
from .processes import ProcessBackend
from .spec import Deviation, SpecError, load_deviations
from .world import World

__all__ = [
    "Backend",
    "BackendConfig",
    "Deviation",
    "HarnessUsageError",
    "ProcessBackend",
    "ProcessContext",
    "SpecError",
    "WorkerProgram",
    "World",
    "WorldContext",
    "fail_world",
    "load_deviations",
]
