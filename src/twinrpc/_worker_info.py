"""WorkerInfo: the identity of one worker (name and rank), a frozen value object."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_NAME_RE = re.compile(r"^[A-Za-z0-9\-_:]*$")
MAX_NAME_LEN = 128


def check_worker_name(name: object) -> str:
    """Validate a worker name with PyTorch's rules (LIFE-1) and return it."""
    if not isinstance(name, str):
        raise TypeError(f"Worker name must be a str, but got {type(name).__name__}: {name!r}")
    if not name or len(name) >= MAX_NAME_LEN or not _NAME_RE.match(name):
        # PyTorch's text first (torch/csrc/distributed/rpc/types.cpp, WorkerInfo::WorkerInfo), then ours
        raise RuntimeError(
            f"Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than "
            f"{MAX_NAME_LEN} chars, but got {name} (twinrpc: {name!r}, {len(name)} chars; use only ASCII "
            f"letters, digits, '-', '_' and ':')"
        )
    return name


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's name and id (its rank). Compares and hashes by value; picklable.

    Matches ``torch.distributed.rpc.WorkerInfo``: ``WorkerInfo(name, id)`` with fields ``name``
    and ``id`` and the repr ``WorkerInfo(id=1, name=w1)``.
    """

    name: str
    id: int

    def __post_init__(self) -> None:
        check_worker_name(self.name)
        if not isinstance(self.id, int) or not 0 <= self.id < 2**15:
            raise ValueError(f"WorkerInfo id must be an int in [0, 32767], but got {self.id!r}")

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    __str__ = __repr__


class Roster:
    """A group's workers (ordered by id), looked up by name and by id, and its shutdown leader (the
    smallest name): what an agent resolves destinations with.

    A world whose members join one group together (the simulator's static groups) makes one for all
    of them: each agent building its own is N^2 work for N workers (at 2048 simulated workers, a
    tenth of the run). Never changed in place: a dynamic group's agent replaces its tables instead.
    """

    __slots__ = ("by_id", "by_name", "leader", "workers")

    def __init__(self, workers: Iterable[WorkerInfo]) -> None:
        self.workers = sorted(workers, key=lambda w: w.id)
        self.by_name = {w.name: w for w in self.workers}
        self.by_id = {w.id: w for w in self.workers}
        self.leader = min(self.workers, key=lambda w: w.name)
