"""Applies faults inside one simulation: the network hook behind ``FaultPlan`` and the fault verbs.

Installed by ``Simulation(faults=...)``, or on the first fault verb (``sim.drop(...)``). Every message a
worker sends goes through :meth:`NetworkFaults.route` (message faults, holds, partitions, crash on
send) and every arrival through :meth:`NetworkFaults.on_arrival` (paused receivers, peers declared
dead, crash on receive). Each applied fault is a ``fault`` event of the trace saying what it did.

Decisions (documented in ``docs/howto/fault-plan.md``):

- **Counting.** A message fault counts the messages matching its kind/src/dst from the moment it is
  installed; a message can match several faults (each counts it). A drop wins over duplicates.
- **Losses.** A lost RRef control message, context cleanup or ack is left to the sender's retry
  (``_RESENT``). Any other lost
  request will never be served, and a duplicated one is served twice: the sender's agent is told
  (``WorldEvents.on_request_copies``) so that graceful shutdown's join, which counts requests sent
  against requests served, still terminates. The caller's call itself just times out.
- **Monitors.** The RRef protocol (and PyTorch's) assumes every message but the retried control
  messages arrives exactly once, as TCP guarantees. The RRef monitors therefore stop, with a
  ``monitors-off`` trace event saying why, at the first fault outside that assumption: a crash, a
  message other than a control message lost for good, a request other than a control message
  duplicated, or a worker declared dead. Delays, holds, healed partitions, pauses and duplicated
  replies keep them on.
- **Silence.** Pauses, holds and partitions silence links; what a silence makes the listening worker
  decide is the liveness model's (``simulator/_liveness.py``).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twinrpc._message import RREF_CONTROL_KINDS, Kind, Message
from twinrpc._serialize import copy_storages

from .._errors import FaultPlanError
from .._liveness import Liveness
from .._model._plan import (
    Crash,
    Delay,
    Deliver,
    Drop,
    Duplicate,
    Fault,
    FaultPlan,
    Hold,
    Partition,
    Pause,
)

if TYPE_CHECKING:
    from .._parts import RunParts

#: what ``rpc_sync``/``rpc_async``/``remote``/``to_here``/``_get_type`` send
USER_REQUEST_KINDS = frozenset({Kind.CALL, Kind.REMOTE_CALL, Kind.RREF_FETCH, Kind.RREF_TYPE})
_REQUEST_KINDS = USER_REQUEST_KINDS | RREF_CONTROL_KINDS | {Kind.GRADIENT, Kind.CONTEXT_CLEANUP}
#: the classes the sender resends until acked and the receiver handles once (a loss or copy is
#: harmless): RETRIED_MESSAGES, which generated plans lose by default, plus context cleanups
_RESENT = frozenset({"rref-control", "context-cleanup"})
_REPLY_KINDS = (Kind.RESPONSE, Kind.EXCEPTION)


def _classes_of(kind: Kind) -> frozenset[str]:
    out = {kind.name}
    if kind in USER_REQUEST_KINDS:
        out.add("request")
    elif kind in RREF_CONTROL_KINDS:
        out.add("rref-control")
    elif kind is Kind.GRADIENT:
        out.add("gradient")
    elif kind is Kind.CONTEXT_CLEANUP:
        out.add("context-cleanup")
    return frozenset(out)


_KIND_CLASSES = {k: _classes_of(k) for k in Kind}
_REPLY_CLASSES = {
    (reply, request): _KIND_CLASSES[reply]
    | ({"response"} if request in USER_REQUEST_KINDS else set())
    | ({"rref-control"} if request in RREF_CONTROL_KINDS else set())
    | ({"context-cleanup"} if request is Kind.CONTEXT_CLEANUP else set())
    for reply in _REPLY_KINDS
    for request in Kind
}


def classify(msg: Message) -> frozenset[str]:
    """The names a fault may address ``msg`` by, without knowing what a reply answers."""
    return _KIND_CLASSES[msg.kind]


@dataclass(slots=True)
class _Rule:
    """A message fault installed in the engine, with its count of matching messages so far."""

    fault: Delay | Drop | Duplicate
    seen: int = 0

    def fires(self, rng: random.Random) -> bool:
        self.seen += 1
        f = self.fault
        if self.seen < f.nth or (f.count is not None and self.seen >= f.nth + f.count):
            return False
        return f.rate >= 1.0 or rng.random() < f.rate


@dataclass(slots=True)
class _Trigger:
    crash: Crash
    seen: int = 0


@dataclass(slots=True)
class _Block:
    """A hold or partition in force on some links."""

    fault: Hold | Partition
    links: list[tuple[int, int]]
    mode: str
    end: float | None
    active: bool = True


@dataclass(slots=True)
class _Queued:
    msg: Message
    classes: frozenset[str]
    delay: float


class NetworkFaults:
    """Applies faults inside one simulation (see the module docstring).

    Attributes:
        sent, dropped, duplicated, delayed, held: counts of messages routed and of faults applied.
    """

    def __init__(self, parts: RunParts, plan: FaultPlan | None) -> None:
        #: the run's parts and callbacks: what the fault engine may touch
        self.parts = parts
        self.plan = plan if plan is not None else FaultPlan()
        self.sent = 0
        self.dropped = 0
        self.duplicated = 0
        self.delayed = 0
        self.held = 0
        #: rates are drawn from their own generator, seeded by the simulation's seed, so adding a
        #: fault does not shift the scheduler's draws (jitter, ties) of everything else
        self.rng = random.Random(f"twinrpc-faults-{parts.seed}")
        self._rules: list[_Rule] = []
        self._on_receive: list[_Trigger] = []
        self._on_send: list[_Trigger] = []
        #: (sender, id) of requests on their way -> [request kind, replies still expected]
        self._requests: dict[tuple[int, int], list[Any]] = {}
        self._blocks: dict[tuple[int, int], list[_Block]] = {}
        self._queued: dict[tuple[int, int], list[_Queued]] = {}
        #: rank -> virtual time its pause ends
        self.paused_until: dict[int, float] = {}
        self._paused_inbox: dict[int, list[tuple[Message, frozenset[str]]]] = {}
        #: id(message in flight) -> its classes (see _send)
        self._classes: dict[int, frozenset[str]] = {}
        #: heartbeat-style failure detection of the silences that pauses, holds and partitions make
        self.liveness = Liveness(
            parts, self._record, self.is_silent, self.silence_ends_now, self.paused_until
        )
        plan = self.plan
        plan.check_world(parts.world_size)
        for f in plan.faults:
            self.install(f)

    # -- installing faults -------------------------------------------------------------------------
    def install(self, fault: Fault) -> Fault:
        """Put ``fault`` in force (now, or at its start time)."""
        parts = self.parts
        FaultPlan((fault,)).check_world(parts.world_size)
        now = parts.sched.now
        if isinstance(fault, (Delay, Drop, Duplicate)):
            self._rules.append(_Rule(fault))
        elif isinstance(fault, (Hold, Partition)):
            if fault.end is not None and fault.end <= now:
                raise FaultPlanError(f"{fault}: virtual time is already {now:g}s")
            links = [(fault.src, fault.dst)] if isinstance(fault, Hold) else fault.links(parts.world_size)
            block = _Block(fault, links, "hold" if isinstance(fault, Hold) else fault.mode, fault.end)
            if fault.start <= now:
                self._add_block(block)
            else:
                parts.sched.call_later(fault.start - now, lambda: self._add_block(block))
            if fault.end is not None:
                parts.sched.call_later(fault.end - now, functools.partial(self._end_block, block))
        elif isinstance(fault, Crash):
            if fault.at is not None:
                parts.crashes.crash_at(fault.worker, fault.at)
            elif fault.on_receive is not None:
                self._on_receive.append(_Trigger(fault))
            else:
                self._on_send.append(_Trigger(fault))
        elif isinstance(fault, Pause):
            if fault.at < now:
                raise FaultPlanError(f"{fault}: virtual time is already {now:g}s")
            if fault.at == now:
                self.pause(fault.worker, fault.duration)
            else:
                parts.sched.call_later(fault.at - now, lambda: self.pause(fault.worker, fault.duration))
        else:  # pragma: no cover - FaultPlan checks the types
            raise TypeError(f"not a fault: {fault!r}")
        return fault

    def _record(self, worker: int, text: str) -> None:
        """A ``fault`` event of the trace: what a fault did."""
        self.parts.trace.record(self.parts.sched.now, worker, "fault", text)

    def _message_event(self, worker: int, event: str, msg: Message, note: str = "") -> None:
        """A message event (``drop``, ``duplicate``, ``hold``) through the trace's message API, so the
        trace can follow each message from its send to its end."""
        self.parts.trace.message(self.parts.sched.now, worker, event, msg, note)

    # -- sending -----------------------------------------------------------------------------------
    def _classify_send(self, msg: Message) -> frozenset[str]:
        kind = msg.kind
        if kind is Kind.RESPONSE or kind is Kind.EXCEPTION:
            entry = self._requests.get((msg.dst, msg.id))
            if entry is None:
                return _KIND_CLASSES[kind]
            entry[1] -= 1
            if entry[1] <= 0:
                del self._requests[(msg.dst, msg.id)]
            return _REPLY_CLASSES[(kind, entry[0])]
        if kind in _REQUEST_KINDS:
            self._requests[(msg.src, msg.id)] = [kind, 1]
        return _KIND_CLASSES[kind]

    def route(self, msg: Message, delay: float) -> None:
        """Schedule the delivery (or not) of ``msg``, which the network model delays by ``delay``."""
        index = self.sent
        self.sent += 1
        classes = self._classify_send(msg)
        if self._on_send and self._crash_on(self._on_send, msg, classes, msg.src, "sends"):
            return
        drop: str | None = None
        extra = 0.0
        copies: list[float] = []
        actions = self.plan.actions
        if index < len(actions):
            action = actions[index]
            if not isinstance(action, Deliver) and action.matches(classes, msg.src, msg.dst):
                why = f"action #{index} ({action.positional_text()})"
                if isinstance(action, Drop):
                    drop = why
                elif isinstance(action, Delay):
                    extra += action.extra
                    self._applied_delay(msg, action.extra, why)
                else:
                    copies.append(action.extra)
        for rule in self._rules:
            f = rule.fault
            if f.matches(classes, msg.src, msg.dst) and rule.fires(self.rng):
                if isinstance(f, Drop):
                    drop = drop or str(f)
                elif isinstance(f, Delay):
                    extra += f.extra
                    self._applied_delay(msg, f.extra, str(f))
                else:
                    copies.append(f.extra)
        link = (msg.src, msg.dst)
        blocks = self._blocks.get(link)
        if drop is None and blocks:
            cutting = next((b for b in blocks if b.mode == "drop"), None)
            if cutting is not None:
                drop = str(cutting.fault)
        if drop is not None:
            self._lose(msg, classes, drop)
            return
        if copies:
            self._duplicated(msg, classes, len(copies))
        deliveries = [(msg, delay + extra)]
        for c in copies:
            copy = _copy(msg)
            self._message_event(msg.src, "duplicate", msg, f": a copy arrives +{c:g}s after it")
            self.parts.trace.copied(msg, copy)  # the copy's events carry the original's message number
            self._record(msg.src, f"duplicate {msg.describe()}: a copy arrives +{c:g}s after it")
            deliveries.append((copy, delay + extra + c))
        if blocks:
            queue = self._queued.setdefault(link, [])
            for m, d in deliveries:
                queue.append(_Queued(m, classes, d))
                self.held += 1
            self._message_event(msg.src, "hold", msg, f": held by {blocks[0].fault}")
            self._record(msg.src, f"hold {msg.describe()}: {blocks[0].fault}")
            return
        for m, d in deliveries:
            self._send(m, classes, d)

    def _applied_delay(self, msg: Message, extra: float, why: str) -> None:
        self.delayed += 1
        self._record(msg.src, f"delay {msg.describe()} by {extra:g}s: {why}")

    def _lose(self, msg: Message, classes: frozenset[str], why: str) -> None:
        """``msg`` is lost for good (a drop, or a dropping partition)."""
        self.dropped += 1
        self._message_event(msg.src, "drop", msg, f": {why}")
        self._record(msg.src, f"drop {msg.describe()}: {why}")
        if classes & _RESENT:
            return  # the sender resends it (or its request, for a lost ack) after the retry interval
        if msg.kind in _REQUEST_KINDS:
            self._requests.pop((msg.src, msg.id), None)
            self._count_copies(msg, 0)
        self.parts.stop_monitors(
            f"{msg.describe()} was lost for good ({why}): the RRef protocol assumes every message but its "
            "retried control messages arrives"
        )

    def _duplicated(self, msg: Message, classes: frozenset[str], n: int) -> None:
        self.duplicated += n
        if msg.kind not in _REQUEST_KINDS or classes & _RESENT:
            return  # duplicated replies are ignored by the caller; control messages are deduplicated
        entry = self._requests.get((msg.src, msg.id))
        if entry is not None:
            entry[1] += n
        self._count_copies(msg, 1 + n)
        self.parts.stop_monitors(
            f"{msg.describe()} was duplicated: the RRef protocol assumes requests other than its control "
            "messages arrive once"
        )

    def _count_copies(self, msg: Message, copies: int) -> None:
        world = self.parts.workers[msg.src].world
        agent = world.agent if world is not None else None
        if agent is not None:
            agent.on_request_copies(msg, copies)

    # -- arriving ----------------------------------------------------------------------------------
    def _send(self, msg: Message, classes: frozenset[str], delay: float) -> None:
        # What a reply answers is known only when it is sent: keep its classes for its arrival (keyed
        # by id: unique while the message is in flight, and only ever looked up, never iterated).
        self._classes[id(msg)] = classes
        self.parts.sched.schedule(delay, self.parts.deliver, msg)

    def on_arrival(self, msg: Message) -> bool:
        """``msg`` reaches its (live) destination: True when it is consumed here (queued at a paused
        worker, discarded as coming from a peer declared dead, or lost with a crash it triggers)."""
        classes = self._classes.pop(id(msg), None)
        distrusted = self.liveness.distrusted
        if distrusted and (msg.src, msg.dst) in distrusted:
            self.parts.trace.record(
                self.parts.sched.now,
                msg.dst,
                "lost",
                f"{msg.describe()}: from a peer this worker declared dead",
            )
            return True
        if msg.dst in self.paused_until:
            self._paused_inbox.setdefault(msg.dst, []).append((msg, classes or classify(msg)))
            return True
        if self._on_receive:
            return self._crash_on(
                self._on_receive, msg, classes if classes is not None else classify(msg), msg.dst, "receives"
            )
        return False

    def _crash_on(
        self, triggers: list[_Trigger], msg: Message, classes: frozenset[str], rank: int, verb: str
    ) -> bool:
        for t in triggers:
            c = t.crash
            kind = c.on_receive if c.on_receive is not None else c.on_send
            if c.worker == rank and kind in classes:
                t.seen += 1
                if t.seen == c.nth:
                    self._record(rank, f"{c}: worker {rank} {verb} {msg.describe()}, which is lost")
                    self.parts.crashes.crash_at(rank, None)
                    return True
        return False

    # -- holds and partitions ----------------------------------------------------------------------
    def _add_block(self, block: _Block) -> None:
        if not block.active:
            return
        self._record(-1, f"{block.fault}: in force")
        changed = []
        for link in block.links:
            blocks = self._blocks.setdefault(link, [])
            blocks.append(block)
            if len(blocks) == 1:
                changed.append(link)
        self.liveness.silence_changed(changed, f"{block.fault}")

    def _end_block(self, block: _Block) -> None:
        self._remove_block(block, "ends")

    def _remove_block(self, block: _Block, how: str) -> int:
        """Lift ``block``; flush the links it was the last block of. Returns messages released."""
        if not block.active:
            return 0
        block.active = False
        released = 0
        changed = []
        for link in block.links:
            blocks = self._blocks.get(link)
            if blocks is None or block not in blocks:
                continue
            blocks.remove(block)
            if blocks:
                continue
            del self._blocks[link]
            changed.append(link)
            for q in self._queued.pop(link, []):
                self._send(q.msg, q.classes, q.delay)
                released += 1
        self._record(-1, f"{block.fault}: {how}; {released} held message(s) released")
        self.liveness.silence_changed(changed, "")
        for src, dst in changed:
            self.liveness.notice_closure(src, dst)
        return released

    def blocks_of(self, kind: type) -> list[_Block]:
        """The active holds (``Hold``) or partitions (``Partition``), oldest first."""
        seen: list[_Block] = []
        for blocks in self._blocks.values():
            for b in blocks:
                if isinstance(b.fault, kind) and b not in seen:
                    seen.append(b)
        return seen

    def remove_blocks(self, blocks: list[_Block], how: str) -> int:
        return sum(self._remove_block(b, how) for b in blocks)

    # -- pauses ------------------------------------------------------------------------------------
    def pause(self, rank: int, duration: float) -> None:
        """Stop worker ``rank`` for ``duration`` seconds from now (see :class:`Pause`)."""
        parts = self.parts
        sched = parts.sched
        if rank in parts.crashes.crashed:
            return
        until = max(sched.now + duration, self.paused_until.get(rank, -math.inf))
        first = rank not in self.paused_until
        self.paused_until[rank] = until
        sched.pause(rank)
        self._record(rank, f"pause worker {rank} until t={until:g}s ({duration:g}s)")
        sched.call_later(until - sched.now, lambda: self._resume(rank, until))
        if first:
            others = [(rank, r) for r in range(parts.world_size) if r != rank]
            self.liveness.silence_changed(others, f"worker {rank} paused")
        current = sched.current_task()
        if current is not None and current.worker == rank:
            sched.wake(current)  # runs again only when the pause is over (the scheduler defers it)
            sched.park(f"pause of worker {rank}")

    def _resume(self, rank: int, until: float) -> None:
        if self.paused_until.get(rank) != until:
            return  # extended by a later pause
        del self.paused_until[rank]
        sched = self.parts.sched
        self._record(rank, f"resume worker {rank}")
        sched.unpause(rank)
        for msg, classes in self._paused_inbox.pop(rank, []):
            self._send(msg, classes, 0.0)
        self.liveness.silence_changed([(rank, r) for r in range(self.parts.world_size) if r != rank], "")
        for observer in range(self.parts.world_size):
            self.liveness.notice_closure(observer, rank)

    # -- silence: what the liveness model asks ---------------------------------------------------------
    def is_silent(self, src: int, dst: int) -> bool:
        """Nothing from ``src`` reaches ``dst`` now (``src`` is paused, or the link is held or cut)."""
        return src in self.paused_until or bool(self._blocks.get((src, dst)))

    def silence_ends_now(self, src: int, dst: int) -> bool:
        """The silence of src -> dst ends at this very instant (a pause or window that ends now)."""
        now = self.parts.sched.now
        if src in self.paused_until and self.paused_until[src] > now:
            return False
        blocks = self._blocks.get((src, dst), [])
        return all(b.end is not None and b.end <= now for b in blocks)


def _copy(msg: Message) -> Message:
    """A second copy of ``msg`` on the wire (its own tensor storages, as a real copy would have)."""
    return Message(msg.kind, msg.id, msg.src, msg.dst, msg.payload, copy_storages(msg.tensors))
