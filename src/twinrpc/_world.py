"""The seam between the protocol core and a world (docs/explanation/architecture.md, "The seam").

The protocol core (the agent, RRefs, dist-autograd) never touches threads, sockets or the clock: it
asks its :class:`World` to send messages, run tasks and set timers, and the world reports back through
the :class:`WorldEvents` the agent implements. The simulator (``simulator/_world.py``) and the gloo
world (``impl/_world.py``) are the two implementations, so the simulator runs the very code that runs
multiprocess. Everything that crosses the seam is declared here, in both directions:

- the join: ``init_rpc`` builds one :class:`JoinOptions` from the user's backend options and calls
  its worker's :class:`Connect`, which returns a :class:`Connection` (the world, this worker, the
  roster). Which connect a worker has is decided by its slot (``twinrpc._current``): a simulated
  worker's slot holds the simulation's; a real process's is the world installed under the
  :data:`WORLDS_ENTRY_POINT_GROUP` entry points (``gloo``: ``twinrpc.impl``), found by name, so the
  core never imports a world;
- the running world: :class:`World` (what each world must provide is abstract; the optional hooks
  have the real world's defaults), its :class:`Timer`, and the observers the core reports to
  (:class:`RRefObserver`, :class:`AutogradObserver`) and the dynamic group's :class:`GroupMembership`.

This file stands on the core's plain data only (messages, departures, errors, worker infos; the RRef
states the observers are told about are named for typing only), so both worlds build on the ground.
"""

from __future__ import annotations

import abc
import functools
import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from ._departure import Departure
    from ._errors import WorkerUnavailableError
    from ._message import Message
    from ._rref import GloballyUniqueId, OwnerState, UserState
    from ._worker_info import Roster, WorkerInfo


class Timer(Protocol):
    def cancel(self) -> None:
        """Stop the timer; a no-op once it fired."""


class TimerHandle:
    """The ``Timer`` both worlds hand out: a flag their timer loop checks before firing."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


# -- observers: what the core reports, only in simulations ------------------------------------------
class RRefObserver(Protocol):
    """What the simulator's online monitors (``simulator/_checks/_monitors.py``) and its trace are told
    by each worker's RRef context (``twinrpc._rref_context``). ``rank`` is the worker whose context
    reports the event. Only set in simulations; ``None`` (no cost) in the real world."""

    def user_created(self, rank: int, state: UserState) -> None: ...
    def user_confirmed(self, rank: int, state: UserState) -> None: ...
    def user_deleted(self, rank: int, state: UserState, notified: bool) -> None: ...
    def child_forked(self, rank: int, parent: UserState, child_fork_id: GloballyUniqueId) -> None: ...
    def fork_known(self, rank: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None: ...
    def fork_abandoned(self, rank: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None: ...
    def delete_heard(self, rank: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None: ...
    def owner_registered(self, rank: int, state: OwnerState) -> None: ...
    def owner_dropped(self, rank: int, state: OwnerState) -> None: ...
    def closed(
        self, rank: int, graceful: bool, leaks: list[tuple[GloballyUniqueId, list[GloballyUniqueId]]]
    ) -> None:
        """The worker's RRef context closed (shutdown); ``leaks``: owned rref ids with live forks."""


class AutogradObserver(Protocol):
    """What the simulator's trace is told about distributed autograd (``twinrpc._dist_autograd``;
    ``event``: context-created, context-released, send-recorded, recv-recorded, backward-started,
    backward-finished, gradient-sent). Only set in simulations; ``None`` (no cost) in the real world."""

    def autograd_event(self, rank: int, event: str, context_id: int, detail: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ProtocolObservers:
    """Who the protocol core reports its RRef and autograd events to. The simulator's trace and
    online monitors observe them; the real world has none (``None`` costs one test per event)."""

    rrefs: RRefObserver | None = None
    autograd: AutogradObserver | None = None


NO_OBSERVERS = ProtocolObservers()


class GroupMembership(Protocol):
    """A dynamic group member's handle on the rendezvous store (one per ``init_rpc``; LIFE-5, the
    protocol is ``twinrpc._membership``)."""

    def lock(self) -> None:
        """Take the group's membership token: blocks while another worker joins or leaves."""

    def unlock(self) -> None:
        """Give the token back (the connect that made this handle returned holding it)."""

    def remove(self) -> None:
        """Remove this worker's name and rank from the store (the token is held)."""

    def changed(self, info: WorkerInfo, is_join: bool) -> None:
        """This member's agent was told that ``info`` joined or left the group (the joiner or leaver
        holds the token)."""


# -- the join -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class JoinOptions:
    """What a world is told at ``init_rpc``: the user's backend options, read and checked once by
    ``init_rpc`` (``twinrpc.rpc.api``), so no world reads ``twinrpc.rpc.options`` itself."""

    #: the default timeout of every RPC in seconds (0: never); also bounds the rendezvous
    rpc_timeout: float
    #: the rendezvous URL (``env://``, ``tcp://host:port``, ``file://path``; the simulator has its own)
    init_method: str
    #: the size of the pool that serves incoming requests
    num_worker_threads: int
    #: seconds between liveness frames on every link (0: no heartbeats)
    heartbeat_interval: float
    #: a peer silent for ``heartbeat_interval * heartbeat_misses`` seconds is declared dead
    heartbeat_misses: int
    #: the module patterns this worker may unpickle beyond twinrpc's own; None: any global
    unpickle_allow: tuple[str, ...] | None
    #: the job's key (``auth_key``, else the key file or variable, ``twinrpc._key_source``); None: none.
    #: Never shown by repr (a secret).
    auth_key: bytes | None = field(repr=False)


class Connection(NamedTuple):
    """What a join returns: the worker's world (started by ``init_rpc`` once its agent exists), this
    worker, and the group's workers (a shared roster of a static group, or a list)."""

    world: World
    me: WorkerInfo
    workers: list[WorkerInfo] | Roster


class Connect(Protocol):
    """How ``init_rpc`` joins a world as ``name``: a static group of ``world_size`` workers (blocks
    until every worker has joined), or with ``world_size`` None or 0 a dynamic group (LIFE-5: the
    world returns holding the group's membership token, ``World.membership``). ``rank`` -1: the
    world's own choice (``RANK``, a simulated worker's rank); ``generation``: how many times this
    worker joined before (a simulated worker's k-th join meets round k's group)."""

    def __call__(
        self, *, name: str, rank: int, world_size: int | None, options: JoinOptions, generation: int
    ) -> Connection: ...


#: the entry-point group under which a package installs a world's :class:`Connect` (pyproject.toml)
WORLDS_ENTRY_POINT_GROUP = "twinrpc.worlds"
#: the world ``init_rpc`` joins outside a simulation: the real multiprocess world (``twinrpc.impl``)
DEFAULT_WORLD = "gloo"


@functools.cache
def installed_world(name: str = DEFAULT_WORLD) -> Connect:
    """The connect of the world installed as ``name`` under :data:`WORLDS_ENTRY_POINT_GROUP` (loading
    it imports its package). Raises RuntimeError naming the fix when twinrpc's metadata lacks it."""
    for entry in importlib.metadata.entry_points(group=WORLDS_ENTRY_POINT_GROUP, name=name):
        connect: Connect = entry.load()
        return connect
    raise RuntimeError(
        f"twinrpc: no world named {name!r} is installed (entry point group {WORLDS_ENTRY_POINT_GROUP!r}); "
        "twinrpc's installation metadata is missing or stale: reinstall twinrpc (pip install -e . in a "
        "checkout)"
    )


# -- the running world ----------------------------------------------------------------------------
class WorldEvents(Protocol):
    """What a world calls on its agent (``twinrpc._agent.RpcAgent``), each on a task of the worker.

    The world only reports what happened; what it means for calls, collectives and RRefs is the
    agent's to decide (twinrpc._departure)."""

    def on_message(self, msg: Message) -> None:
        """``msg`` arrived. Runs on a task that may block; requests that run user code are handed on
        to :meth:`World.submit` by the agent."""

    def on_send_failed(self, msg: Message, exc: BaseException) -> None:
        """``msg`` could not be delivered; ``exc`` is the agent's :meth:`departure_error`."""

    def on_peer_failed(self, peer: int, departure: Departure, detail: str = "") -> None:
        """``peer`` departed (``detail``: the world's words for a crash or silence)."""

    def departure_error(self, peer: int, departure: Departure, detail: str = "") -> WorkerUnavailableError:
        """The error a call to ``peer`` fails with after it departed: the world uses it for sends
        that fail, so every failure names the departure in the core's words."""

    def on_request_copies(self, msg: Message, copies: int) -> None:
        """The world delivers request ``msg`` ``copies`` times instead of once (0: lost for good; 2 or
        more: duplicated). Only the simulator's fault plans do this; a real link delivers a message
        once or fails. Graceful shutdown counts requests sent against requests served, so it must
        know."""


class World(abc.ABC):
    """One worker's view of its world. Thread-safe. A world implements every abstract method (an
    incomplete subclass cannot be instantiated); the hooks after them have the real world's defaults.

    What may block, and for how long (everything else returns at once):

    - :meth:`send` may block the calling thread in the gloo world while the link to the peer is
      busy or the peer has not posted a receive for a large frame: at most the heartbeat bound
      (``heartbeat_interval * heartbeat_misses``; ``rpc_timeout`` when heartbeats are off), after
      which the link fails and so does the send (through ``on_send_failed``). A thread that must
      never block (a link's receiver, the timer) is never made to: the gloo world hands its send to
      an outbox. The simulator's send never blocks (it schedules the delivery).
    - :meth:`stop` blocks until the world's threads are gone: in gloo at most about 16 s, when a peer
      does not close its side (10 s for the peer's close, then 2 s for the abandoned link's threads
      to leave gloo, 2 s for the pool and the timer, 2 s for a dynamic group's watcher); in the
      simulator never.
    - :meth:`start` runs the messages that arrived before the agent existed, on the calling task in
      gloo (they may block as ``on_message`` may).
    """

    #: this worker's handle on its dynamic group's store (LIFE-5, ``twinrpc._membership``); None in a
    #: static group. A world made by a dynamic join returns holding the group's membership token.
    membership: GroupMembership | None = None
    #: whether the world's tasks are threads of this process (the gloo world). The simulator's are not
    #: (every simulated task runs on the simulating thread): what that thread went through, such as a
    #: fork (``twinrpc._fork``), is no business of the program's, and must not change its schedule.
    threaded: bool = True
    #: the worker has its process to itself (the gloo world), so ``init_rpc`` may tune the process:
    #: it freezes the heap it finds (``twinrpc._heap``); the simulator runs many workers in one process
    owns_process: bool = True

    @property
    @abc.abstractmethod
    def clock_name(self) -> str:
        """ "simulated" or "wall-clock": how error messages describe durations (a class attribute of
        each world)."""

    @abc.abstractmethod
    def now(self) -> float:
        """Seconds on this world's clock (virtual in the simulator)."""

    @abc.abstractmethod
    def send(self, msg: Message) -> None:
        """Hand ``msg`` to the network (may block: see the class docstring). Failures surface through
        ``agent.on_send_failed`` with the error ``agent.departure_error`` builds. After :meth:`stop`,
        drops ``msg``: a worker that has left sends nothing more (twinrpc._departure)."""

    @abc.abstractmethod
    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a new task of this worker (protocol-internal work, unbounded)."""

    @abc.abstractmethod
    def submit(self, fn: Callable[..., Any], *args: Any, brief: bool = False) -> None:
        """Run ``fn(*args)`` on the worker's request pool (``num_worker_threads`` tasks at most).

        ``brief``: a hint that the request is short and never blocks (a builtin operator on a few
        plain arguments, ``twinrpc._builtin_wire.is_brief``), so the world may run it on the thread
        that received it rather than hand that thread's role to another first; it still takes one of
        the pool's slots (the gloo world; the simulator ignores it)."""

    @abc.abstractmethod
    def call_later(self, delay: float, fn: Callable[[], Any]) -> Timer:
        """Run ``fn()`` on a task of this worker after ``delay`` seconds of this world's clock."""

    @abc.abstractmethod
    def start(self, agent: WorldEvents) -> None:
        """Begin delivering incoming messages to ``agent.on_message`` (each on a task)."""

    @abc.abstractmethod
    def stop(self, graceful: bool = False) -> None:
        """Stop delivering; release the world's resources for this worker; tell every peer that this
        worker shut down RPC, after what was sent to it before (gloo: a close frame on each link; the
        simulator: an announcement with the network's delay). Each peer's world then reports
        ``agent.on_peer_failed(rank, Departure.LEFT if graceful else Departure.SHUT_DOWN)``; a crash
        or silence is reported as ``Departure.CRASHED`` / ``Departure.SILENT`` (a link refused by the job
        key's check as ``Departure.REFUSED``) with the transport's
        words. ``graceful``: the graceful shutdown protocol completed, so the departure is orderly."""

    # -- optional hooks: the defaults are what the real world does ------------------------------------
    def observers(self) -> ProtocolObservers:
        """Who observes this worker's protocol events (read once, when the agent is made)."""
        return NO_OBSERVERS

    def reach(self, peers: Iterable[int]) -> None:
        """Make the links to ``peers`` now rather than at the first message (links are made on first
        use). The leader of graceful shutdown calls it, so that a follower that died before any link
        to it was made is reported (``on_peer_failed``) instead of awaited. A world whose links all
        exist from the start has nothing to make."""
        del peers

    def reply_receiver(self, peer: int) -> Callable[[Any], None] | None:
        """How a thread that blocks on the future of a request to ``peer`` may receive the reply
        itself (see ``twinrpc._future.receive_while_waiting``); None: it waits to be woken. The gloo
        world's same-host links have one (``Receiver.receive_until``); the simulator's tasks wait."""
        del peer
        return None

    def schedule_rref_delete(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` (sending a dead user RRef's delete) on a task soon. Called from
        ``UserState.__del__``, which may run inside any allocation holding any lock, so it must only
        schedule. The simulator delays it by a seeded amount: *when* garbage collection triggers a
        delete is a scheduling choice it explores."""
        self.spawn(fn)
