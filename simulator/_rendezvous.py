"""The simulated store: how ``init_rpc`` finds its group in a simulation.

The gloo world meets its peers through a ``torch.distributed`` store (``impl/_rendezvous.py``); here
:class:`Rendezvous` plays that store for every worker of one simulation. It owns the static groups
(``init_rpc(world_size=N)``: everyone waits for all N, then one roster serves every member) and the
dynamic groups (``init_rpc`` without ``world_size``: members join and leave one at a time under a
membership token, ``simulator/_dynamic_group.py``), and records each joiner's heartbeat options: how
long it lets a silent peer be before declaring it dead (``simulator/_liveness.py``,
``silence_bound``). There is no wire to authenticate, but each joiner's key (``auth_key`` or
``TWINRPC_AUTH_KEY``) is compared with its group's, so workers started with different keys fail
``init_rpc`` as they do in the gloo world (``AuthenticationError`` on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from twinrpc._errors import AUTH_KEY_HINT, AuthenticationError
from twinrpc._future import Future
from twinrpc._membership import MIXED_GROUP_ERROR
from twinrpc._worker_info import Roster, WorkerInfo
from twinrpc._world import Connection, JoinOptions

from ._dynamic_group import DynamicGroup, DynamicMember
from ._world import SimWorld

if TYPE_CHECKING:
    from ._kernel._scheduler import Scheduler
    from ._traces._trace import Trace
    from ._world import SimWorker

#: a store round trip at init
RENDEZVOUS_DELAY = 1e-3


class Rendezvous:
    """The store of one simulation: its static and dynamic groups, by generation.

    Args:
        world_size: the simulation's number of workers (a static group's ranks are among them).
        sched: its scheduler.
        trace: its trace (each worker's name and ``init`` events).
        workers: its workers, by rank.
        joined: called with a worker's rank once its heartbeat options are recorded (the fault engine
            judges the silences that worker listens to by them).
    """

    def __init__(
        self,
        world_size: int,
        sched: Scheduler,
        trace: Trace,
        workers: list[SimWorker],
        joined: Callable[[int], None],
    ) -> None:
        self.world_size = world_size
        self.sched = sched
        self.trace = trace
        self.workers = workers
        self.joined = joined
        #: generation -> rank -> name of the static group's workers that arrived
        self._arrived: dict[int, dict[int, str]] = {}
        self._complete: dict[int, Future[None]] = {}
        #: generation -> (members when built, the static group's workers, or the error of a name
        #: two members share): see _roster
        self._rosters: dict[int, tuple[int, list[WorkerInfo], Roster | None, str | None]] = {}
        #: generation -> the world_size of its static group (the first member's)
        self._sizes: dict[int, int] = {}
        #: generation -> its dynamic group (init_rpc without world_size, LIFE-5)
        self._dynamic: dict[int, DynamicGroup] = {}
        #: generation -> rank -> the job key its worker joined with (None: none), static and dynamic
        self._keys: dict[int, dict[int, bytes | None]] = {}
        #: generation -> rank -> the options a static group's member joined with, until it completes
        self._options: dict[int, dict[int, JoinOptions]] = {}
        #: generation -> whether its complete static group's keys differ (_keys_differ)
        self._keys_differ_in: dict[int, bool] = {}
        #: rank -> (heartbeat_interval, heartbeat_misses) of its latest init_rpc's options: how long it
        #: lets a silent peer be before declaring it dead (simulator/_liveness.py, silence_bound)
        self.heartbeat_options: dict[int, tuple[float, int]] = {}

    def connect(
        self,
        worker: SimWorker,
        *,
        name: str,
        rank: int,
        world_size: int | None,
        options: JoinOptions,
        generation: int,
    ) -> Connection:
        """``init_rpc`` on ``worker``: join its group; returns the worker's world, its own info and the
        group's workers (the simulated world's ``twinrpc._world.Connect``, ``SimWorker.connect``)."""
        if rank not in (-1, worker.rank):
            raise ValueError(
                f"init_rpc(rank={rank}) on simulated worker {worker.rank}: in a Simulation each program's "
                "rank is the rank it was started with (pass that rank, or -1)"
            )
        if not world_size:
            return self._join_dynamic(worker, name=name, options=options, generation=generation)
        if not 0 <= worker.rank < world_size <= self.world_size:
            raise ValueError(
                f"init_rpc(world_size={world_size}) on simulated worker {worker.rank} in a Simulation of "
                f"world_size={self.world_size}: a static group's ranks run from 0 to world_size - 1"
            )
        group = self._dynamic.get(generation)
        if group is not None and group.members:
            raise RuntimeError(MIXED_GROUP_ERROR)
        arrived = self._arrived.setdefault(generation, {})
        self._sizes.setdefault(generation, world_size)
        done = self._complete.setdefault(generation, Future())
        arrived[worker.rank] = name
        keys = self._keys.setdefault(generation, {})
        keys[worker.rank] = options.auth_key
        self.trace.name_worker(worker.rank, name)
        self.trace.record(self.sched.now, worker.rank, "init", f"{name} generation {generation}")
        self._options.setdefault(generation, {})[worker.rank] = options
        if len(arrived) == world_size:
            self.sched.call_later(RENDEZVOUS_DELAY, lambda: self._complete_static(generation, done))
        done.wait()
        if self._keys_differ(generation, keys):
            _check_keys(name, worker.rank, keys, arrived)
        infos, roster = self._roster(generation, arrived)
        world = worker.world
        assert world is not None and world.generation == generation
        return Connection(world, infos[worker.rank], roster)

    def _complete_static(self, generation: int, done: Future[None]) -> None:
        """Every member of generation ``generation``'s static group has arrived: give each its
        world, then let them all return. As PyTorch's ``init_rpc`` returns on no worker before every
        agent is up (it all-gathers over RPC first) and the gloo world's does not before every pair
        is connected, a member that is slow to resume (paused) takes calls from the start: they wait
        in its world until its agent starts, and never find it "not initialised"."""
        arrived = self._arrived[generation]
        keys = self._keys[generation]
        if not self._keys_differ(generation, keys) and self._roster_error(generation, arrived) is None:
            for rank, options in sorted(self._options.pop(generation).items()):
                worker = self.workers[rank]
                if worker.crashed:
                    continue
                worker.world = SimWorld(worker, options.num_worker_threads, generation)
                self._heartbeats_of(rank, options)
        done.set_result(None)

    def _keys_differ(self, generation: int, keys: dict[int, bytes | None]) -> bool:
        """Whether the members of complete static group ``generation`` (``keys``: rank -> key) were
        started with more than one key: found once for the group, not by each member comparing its
        key with every other's (N^2 comparisons)."""
        differ = self._keys_differ_in.get(generation)
        if differ is None:
            differ = self._keys_differ_in[generation] = len(set(keys.values())) > 1
        return differ

    def open_round(self, rank: int, since: int) -> int:
        """The generation a process that newly joins as ``rank`` takes part in: the first, from
        ``since`` on, that ``rank`` is not in and that still has room (a static group not yet full,
        or a dynamic group). A worker's k-th ``init_rpc`` joins round k while one process re-inits;
        processes a program's own launcher starts (``mp.spawn``, one world after another) meet in
        the round their store would hold at the time, whatever the earlier worlds' sizes were."""
        generation = since
        while True:
            arrived = self._arrived.get(generation)
            if arrived is not None:
                if rank not in arrived and len(arrived) < self._sizes[generation]:
                    return generation
            else:
                group = self._dynamic.get(generation)
                if group is None or rank not in group.members:
                    return generation
            generation += 1

    def _roster(self, generation: int, arrived: dict[int, str]) -> tuple[list[WorkerInfo], Roster]:
        """The workers of a static group (by rank) and their Roster, once for all its members: each
        member building its own took N^2 time and kept N^2 WorkerInfo objects alive. Raises, for
        each member, when two share a name."""
        _, infos, roster, error = self._built_roster(generation, arrived)
        if error is not None:
            raise RuntimeError(error)
        assert roster is not None
        return infos, roster

    def _roster_error(self, generation: int, arrived: dict[int, str]) -> str | None:
        """Why the static group cannot be built (two members share a name), or None."""
        return self._built_roster(generation, arrived)[3]

    def _built_roster(
        self, generation: int, arrived: dict[int, str]
    ) -> tuple[int, list[WorkerInfo], Roster | None, str | None]:
        cached = self._rosters.get(generation)
        if cached is None or cached[0] != len(arrived):
            by_name: dict[str, int] = {}
            error = None
            for r in sorted(arrived):
                other = by_name.setdefault(arrived[r], r)
                if other != r:
                    error = (
                        f"RPC worker name {arrived[r]} is not unique. Workers {other} and {r} share the "
                        "same name."
                    )
                    break
            infos = [WorkerInfo(arrived[r], r) for r in sorted(arrived)] if error is None else []
            roster = Roster(infos) if infos else None
            cached = self._rosters[generation] = (len(arrived), infos, roster, error)
        return cached

    def _join_dynamic(
        self, worker: SimWorker, *, name: str, options: JoinOptions, generation: int
    ) -> Connection:
        """Join generation ``generation``'s dynamic group (LIFE-5); returns holding its token, which
        ``init_rpc`` gives back once every member knows this worker (twinrpc._membership)."""
        group = self._dynamic.setdefault(generation, DynamicGroup(self.sched))
        self.trace.name_worker(worker.rank, name)
        self.trace.record(self.sched.now, worker.rank, "init", f"{name} generation {generation} (dynamic)")
        group.lock(f"the membership token of dynamic group {generation}")
        try:
            self._store_round_trip()  # the store round trips of the token and the names
            if self._arrived.get(generation):
                raise RuntimeError(MIXED_GROUP_ERROR)
            keys = self._keys.setdefault(generation, {})
            _check_keys(name, worker.rank, {**keys, worker.rank: options.auth_key}, group.members)
            group.check_unique(name, worker.rank)
            keys[worker.rank] = options.auth_key
        except BaseException:
            group.unlock()
            raise
        group.members[worker.rank] = name
        for other in self.workers:  # a departure of an earlier worker of this rank no longer applies
            if other is not worker and other.world is not None:
                other.world.peer_joined(worker.rank)
        infos = [WorkerInfo(n, r) for r, n in sorted(group.members.items())]
        world = SimWorld(worker, options.num_worker_threads, generation)
        world.membership = DynamicMember(group, worker.rank)
        worker.world = world
        self._heartbeats_of(worker.rank, options)
        return Connection(world, WorkerInfo(name, worker.rank), infos)

    def _store_round_trip(self) -> None:
        """Wait :data:`RENDEZVOUS_DELAY` of virtual time on the calling task."""
        fut: Future[None] = Future()
        self.sched.call_later(RENDEZVOUS_DELAY, lambda: fut.set_result(None))
        fut.wait()

    def _heartbeats_of(self, rank: int, options: JoinOptions) -> None:
        """Worker ``rank`` is up with ``options``: from now on it declares a peer dead after
        ``heartbeat_interval * heartbeat_misses`` seconds of virtual silence (never with an interval of
        0), as a gloo worker judges with its own options, unless ``network.heartbeat_timeout`` is set."""
        self.heartbeat_options[rank] = (options.heartbeat_interval, options.heartbeat_misses)
        self.joined(rank)


def _check_keys(name: str, rank: int, keys: dict[int, bytes | None], group: dict[int, str]) -> None:
    """Refuse to join ``group`` (rank -> name) if a member's key differs from this worker's."""
    mine = keys[rank]
    differ = sorted(r for r in group if r != rank and keys.get(r) != mine)
    if differ:
        raise AuthenticationError(
            f"init_rpc as '{name}' (rank {rank}): authentication failed: rank(s) {differ} of its group "
            f"were not started with the same key as this worker (which has {'one' if mine else 'none'}). "
            f"{AUTH_KEY_HINT}"
        )
