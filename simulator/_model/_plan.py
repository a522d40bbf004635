"""Fault plans: what the simulated network and workers do wrong, as plain data in the RPC's words.

A :class:`FaultPlan` is a frozen value (it prints as valid Python, compares, shrinks, and round-trips
through JSON and TOML, see :meth:`FaultPlan.load`). It holds

- ``faults``: message faults addressed the way a user thinks of messages, "drop the 3rd response from
  worker 1 to worker 0" (:class:`Drop`, :class:`Delay`, :class:`Duplicate`); link faults
  (:class:`Hold`, :class:`Partition`); worker faults (:class:`Crash`, :class:`Pause`);
- ``actions``: the older positional form, the *i*-th action applying to the *i*-th message the
  simulation sends (:class:`Deliver`, or a ``Delay``/``Drop``/``Duplicate`` whose ``kind``/``src``/
  ``dst`` then only filter which of those messages it touches);
- ``gc_delay``: the bound of the seeded delay before a dead user RRef's delete is sent.

Message kinds a fault addresses (``kind=``): a class, or the raw name of a ``twinrpc._message.Kind``:

=================  ===================================================================================
``request``        what ``rpc_sync``/``rpc_async``/``remote``/``to_here`` send (CALL, REMOTE_CALL,
                   RREF_FETCH, RREF_TYPE)
``response``       the reply (RESPONSE, or EXCEPTION for an error) to a ``request``
``rref-control``   RRef control messages (RREF_USER_DELETE, RREF_FORK_REQUEST, RREF_CHILD_ACCEPT) and
                   their acks: the messages PyTorch retries, which twinrpc resends until acked and
                   deduplicates on receipt
``gradient``       GRADIENT: gradients for a send function during ``dist_autograd.backward``
``context-cleanup``  CONTEXT_CLEANUP: release of a distributed autograd context, and its ack (resent
                   up to 20 times, as PyTorch, and handled once)
``CALL``, ...      one ``Kind`` exactly (``RESPONSE`` then means every RESPONSE, whatever it answers)
``None``           any message
=================  ===================================================================================

What the faults mean is in the how-to (``docs/howto/fault-plan.md``); how they are applied is in
``simulator/_faults/_engine.py``. Hypothesis strategies for plans live in
:mod:`twinrpc.simulator.strategies`; seeded *swarm* plans come from :meth:`Swarm.plan`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from twinrpc._message import Kind

from ._codec import build, convert, dump_data, plain, read_data, to_json, to_toml
from ._errors import FaultPlanError

#: default bound of the seeded delay between a user RRef's death and the send of its delete message
DEFAULT_GC_DELAY = 50e-6

#: the message classes a fault can address besides raw Kind names (see the module docstring)
MESSAGE_CLASSES = ("request", "response", "rref-control", "gradient", "context-cleanup")
#: raw message kind names a fault can address (HEARTBEAT exists only on gloo links)
KIND_NAMES = tuple(k.name for k in Kind if k is not Kind.HEARTBEAT)
#: every fault kind, mildest first (the order hypothesis shrinks towards)
FAULT_KINDS = ("delay", "duplicate", "hold", "partition", "pause", "drop", "crash")
#: how a partition treats the messages it cuts: queue them until it heals, or lose them
PARTITION_MODES = ("hold", "drop")
#: the fault kinds a correct PyTorch RPC program must survive on TCP, given that drops and duplicates
#: keep to RETRIED_MESSAGES and windows stay shorter than the heartbeat timeout: reordering, stalls and
#: partitions that heal; crashes and losses of other messages fail every RPC program by design
SURVIVABLE_KINDS = ("delay", "duplicate", "hold", "partition", "pause", "drop")
#: the messages PyTorch retries and twinrpc deduplicates: losing or duplicating them is survivable
RETRIED_MESSAGES = ("rref-control",)


# -- checks shared by every fault ------------------------------------------------------------------
def _fail(what: str, message: str) -> FaultPlanError:
    return FaultPlanError(f"{what}: {message}")


def _check_kind(value: Any, what: str, field: str = "kind") -> str | None:
    """A message class or Kind name, normalised to its string (a ``Kind`` becomes its name)."""
    if value is None:
        return None
    if isinstance(value, Kind):
        value = value.name
    if not isinstance(value, str) or (value not in MESSAGE_CLASSES and value not in KIND_NAMES):
        raise _fail(
            what,
            f"{field}={value!r} is not a message kind; expected one of {', '.join(MESSAGE_CLASSES)} or a "
            f"Kind name ({', '.join(KIND_NAMES)})",
        )
    return value


def _check_rank(value: Any, what: str, field: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _fail(what, f"{field} must be a worker rank (an int >= 0), got {value!r}")


def _check_number(obj: Any, field: str, what: str, *, optional: bool = False, positive: bool = False) -> None:
    """Check ``obj.<field>`` is a finite number of seconds and store it as a float."""
    value = getattr(obj, field)
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise _fail(what, f"{field} must be a finite number of seconds {bound}, got {value!r}")
    object.__setattr__(obj, field, float(value))


def _check_window(obj: Any, what: str) -> None:
    _check_number(obj, "start", what)
    _check_number(obj, "end", what, optional=True)
    if obj.end is not None and obj.end < obj.start:
        raise _fail(what, f"end {obj.end} is before start {obj.start}")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class _MessageFault:
    """Shared by Delay, Drop and Duplicate: which messages they address (``kind``, ``src``, ``dst``)
    and which of those (``nth``, ``count``, ``rate``)."""

    __slots__ = ()
    kind: str | None
    src: int | None
    dst: int | None
    nth: int
    count: int | None
    rate: float

    def _check_selector(self) -> None:
        what = repr(self)
        object.__setattr__(self, "kind", _check_kind(self.kind, what))
        _check_rank(self.src, what, "src", optional=True)
        _check_rank(self.dst, what, "dst", optional=True)
        if not isinstance(self.nth, int) or isinstance(self.nth, bool) or self.nth < 1:
            raise _fail(what, f"nth must be an int >= 1 (1 = the first matching message), got {self.nth!r}")
        if self.count is not None and (
            not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1
        ):
            raise _fail(
                what,
                f"count must be an int >= 1, or None for every message from the nth on, got {self.count!r}",
            )
        rate = self.rate
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0.0 < rate <= 1.0:
            raise _fail(what, f"rate must be a probability in (0, 1], got {rate!r}")
        object.__setattr__(self, "rate", float(rate))

    @property
    def positional(self) -> bool:
        """True when only ``kind``/``src``/``dst`` are set: usable in ``FaultPlan.actions``."""
        return self.nth == 1 and self.count == 1 and self.rate == 1.0

    def matches(self, classes: frozenset[str], src: int, dst: int) -> bool:
        """Does a message with these classes, from ``src`` to ``dst``, fall under this fault?"""
        return (
            (self.kind is None or self.kind in classes)
            and (self.src is None or self.src == src)
            and (self.dst is None or self.dst == dst)
        )

    def _link(self) -> str:
        if self.src is None and self.dst is None:
            return ""
        return f" {'*' if self.src is None else self.src}->{'*' if self.dst is None else self.dst}"

    def _target(self) -> str:
        what = self.kind or "message"
        if self.count == 1:
            text = f"the {_ordinal(self.nth)} {what}{self._link()}"
        elif self.count is None:
            text = f"every {what}{self._link()}" + (
                f" from the {_ordinal(self.nth)} on" if self.nth > 1 else ""
            )
        else:
            text = f"{what} #{self.nth}..#{self.nth + self.count - 1}{self._link()}"
        return text

    def _chance(self) -> str:
        return f" (each with probability {self.rate:g})" if self.rate < 1.0 else ""

    def _filter(self) -> str:
        """The positional form's text: the action applies only to messages of this kind/link."""
        if self.kind is None and self.src is None and self.dst is None:
            return ""
        return f" if {self.kind or 'any message'}{self._link()}"


# -- message faults ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Deliver:
    """Deliver normally (a positional action only: "leave this message alone")."""

    def __str__(self) -> str:
        return "deliver"


@dataclass(frozen=True, slots=True)
class Delay(_MessageFault):
    """Deliver the addressed message(s) ``extra`` seconds later than the network model says.

    Args:
        extra: seconds added to the message's delay.
        kind: message class or Kind name (see the module docstring); ``None`` = any message.
        src: only messages sent by this rank (``None`` = any).
        dst: only messages sent to this rank (``None`` = any).
        nth: the first matching message it applies to (1 = the first one sent after the fault is
            installed: at the start of the run for a plan, at the call for ``Simulation.delay``).
        count: how many matching messages from the ``nth`` on (``None`` = all of them).
        rate: each of those is hit with this probability, drawn from the simulation's seed.
    """

    extra: float
    kind: str | None = None
    src: int | None = None
    dst: int | None = None
    nth: int = 1
    count: int | None = 1
    rate: float = 1.0

    def __post_init__(self) -> None:
        _check_number(self, "extra", repr(self))
        self._check_selector()

    def __str__(self) -> str:
        return f"delay {self._target()} by {self.extra:g}s{self._chance()}"

    def positional_text(self) -> str:
        """How it reads as the *i*-th entry of ``FaultPlan.actions``."""
        return f"delay {self.extra:g}s{self._filter()}"


@dataclass(frozen=True, slots=True)
class Drop(_MessageFault):
    """Lose the addressed message(s) for good (arguments as for :class:`Delay`).

    A lost ``rref-control`` or ``context-cleanup`` message or ack is resent after the retry interval,
    as in PyTorch. Any other loss is final: the caller of a lost request or response sees its RPC time
    out ("RPC ran for more than set timeout"), a lost GRADIENT makes ``dist_autograd.backward`` time
    out, and the RRef monitors stop (the RRef protocol assumes every other message arrives, as TCP
    guarantees).
    """

    kind: str | None = None
    src: int | None = None
    dst: int | None = None
    nth: int = 1
    count: int | None = 1
    rate: float = 1.0

    def __post_init__(self) -> None:
        self._check_selector()

    def __str__(self) -> str:
        return f"drop {self._target()}{self._chance()}"

    def positional_text(self) -> str:
        """How it reads as the *i*-th entry of ``FaultPlan.actions``."""
        return f"drop{self._filter()}"


@dataclass(frozen=True, slots=True)
class Duplicate(_MessageFault):
    """Deliver the addressed message(s), and a copy ``extra`` seconds after each.

    A duplicated request is served twice (PyTorch does not deduplicate ordinary requests: the
    function runs twice); the caller keeps the first reply and ignores the second. Duplicated RRef
    control messages are acked and handled once. A duplicated GRADIENT is applied once, and a copy of
    a request its worker still holds is answered with the original, never before (see the how-to).
    Other arguments as for :class:`Delay`.
    """

    extra: float = 0.0
    kind: str | None = None
    src: int | None = None
    dst: int | None = None
    nth: int = 1
    count: int | None = 1
    rate: float = 1.0

    def __post_init__(self) -> None:
        _check_number(self, "extra", repr(self))
        self._check_selector()

    def __str__(self) -> str:
        chance = f", each with probability {self.rate:g}" if self.rate < 1.0 else ""
        return f"duplicate {self._target()} (copy +{self.extra:g}s{chance})"

    def positional_text(self) -> str:
        """How it reads as the *i*-th entry of ``FaultPlan.actions``."""
        return f"duplicate +{self.extra:g}s{self._filter()}"


Action = Deliver | Delay | Drop | Duplicate


# -- link faults ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hold:
    """Hold every message ``src`` sends to ``dst`` from ``start`` on, and release them all at ``end``
    (``None``: until ``Simulation.release``): a one-way partition that heals, delivering late.

    While held, ``dst`` hears nothing from ``src``: held longer than ``dst``'s heartbeat bound (its
    ``heartbeat_interval * heartbeat_misses``, or the network model's ``heartbeat_timeout`` when
    set), ``dst`` declares ``src`` dead if they are linked, as the gloo world's heartbeats do (over
    links only).
    """

    src: int
    dst: int
    start: float = 0.0
    end: float | None = None

    def __post_init__(self) -> None:
        what = f"Hold({self.src}->{self.dst})"
        _check_rank(self.src, what, "src")
        _check_rank(self.dst, what, "dst")
        _check_window(self, what)

    def __str__(self) -> str:
        if self.end is None:
            return f"hold {self.src}->{self.dst} from t={self.start:g}s until released"
        return f"hold {self.src}->{self.dst} during [{self.start:g}, {self.end:g})s"


def _group(value: Any, what: str, field: str) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes)):
        raise _fail(what, f"{field} must be a rank or a list of ranks, got {value!r}")
    ranks = tuple(value)
    for r in ranks:
        _check_rank(r, what, field)
    if not ranks:
        raise _fail(what, f"{field} must name at least one worker")
    return tuple(sorted(set(ranks)))


@dataclass(frozen=True, slots=True)
class Partition:
    """Cut the links between the workers of ``a`` and those of ``b`` from ``start`` until ``end``
    (``None``: until ``Simulation.heal``).

    Args:
        a: a rank or ranks on one side.
        b: the other side; ``None`` = every worker not in ``a``.
        oneway: cut only ``a -> b`` (``b`` still reaches ``a``).
        mode: ``"hold"`` (default) queues the messages and delivers them when the partition heals,
            as TCP does when a partition heals before the connection times out; ``"drop"`` loses
            them (see :class:`Drop` for what a loss means). Either way a side linked to the other
            that hears nothing for longer than its heartbeat bound declares the other dead.
    """

    a: tuple[int, ...]
    b: tuple[int, ...] | None = None
    start: float = 0.0
    end: float | None = None
    oneway: bool = False
    mode: str = "hold"

    def __post_init__(self) -> None:
        what = f"Partition(a={self.a!r}, b={self.b!r})"
        object.__setattr__(self, "a", _group(self.a, what, "a"))
        if self.b is not None:
            object.__setattr__(self, "b", _group(self.b, what, "b"))
            both = set(self.a) & set(self.b)
            if both:
                raise _fail(what, f"workers {sorted(both)} are on both sides")
        _check_window(self, what)
        if not isinstance(self.oneway, bool):
            raise _fail(what, f"oneway must be true or false, got {self.oneway!r}")
        if self.mode not in PARTITION_MODES:
            raise _fail(what, f"mode must be one of {', '.join(PARTITION_MODES)}, got {self.mode!r}")

    def links(self, world_size: int) -> list[tuple[int, int]]:
        """The (src, dst) links it cuts in a world of ``world_size``."""
        b = self.b if self.b is not None else tuple(r for r in range(world_size) if r not in self.a)
        out = [(x, y) for x in self.a for y in b]
        if not self.oneway:
            out += [(y, x) for x in self.a for y in b]
        return out

    def __str__(self) -> str:
        b = "the rest" if self.b is None else "{" + ",".join(map(str, self.b)) + "}"
        arrow = "->" if self.oneway else "<->"
        text = f"partition {{{','.join(map(str, self.a))}}} {arrow} {b} ({self.mode})"
        if self.end is None:
            return text + f" from t={self.start:g}s until healed"
        return text + f" during [{self.start:g}, {self.end:g})s"


# -- worker faults ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Crash:
    """Crash ``worker`` (like a SIGKILL) at virtual time ``at``, or when the ``nth`` message of a kind
    arrives at it (``on_receive``) or leaves it (``on_send``); that message is lost with it. Exactly one
    of ``at``, ``on_receive`` and ``on_send`` is given; kinds as for :class:`Delay`.

    Its tasks stop forever, messages to it are lost, and every peer sees ``WorkerUnavailableError``
    naming it after the network model's ``failure_detection`` delay (ERR-7)."""

    worker: int
    at: float | None = None
    on_receive: str | None = None
    on_send: str | None = None
    nth: int = 1

    def __post_init__(self) -> None:
        what = f"Crash(worker={self.worker})"
        _check_rank(self.worker, what, "worker")
        given = [f for f in ("at", "on_receive", "on_send") if getattr(self, f) is not None]
        if len(given) != 1:
            raise _fail(
                what,
                "give exactly one of at=<virtual time>, on_receive=<message kind> and on_send=<message kind>"
                + (f" (got {', '.join(given)})" if given else ""),
            )
        _check_number(self, "at", what, optional=True)
        object.__setattr__(self, "on_receive", _check_kind(self.on_receive, what, "on_receive"))
        object.__setattr__(self, "on_send", _check_kind(self.on_send, what, "on_send"))
        if not isinstance(self.nth, int) or isinstance(self.nth, bool) or self.nth < 1:
            raise _fail(what, f"nth must be an int >= 1, got {self.nth!r}")

    def __str__(self) -> str:
        if self.at is not None:
            return f"crash worker {self.worker} at t={self.at:g}s"
        if self.on_receive is not None:
            return f"crash worker {self.worker} when message #{self.nth} of kind {self.on_receive} arrives"
        return f"crash worker {self.worker} when it sends message #{self.nth} of kind {self.on_send}"


@dataclass(frozen=True, slots=True)
class Pause:
    """Stop ``worker`` for ``duration`` seconds from ``at`` (like SIGSTOP then SIGCONT: a stalled or
    very slow process). None of its tasks runs, its timers fire late, messages to it queue and are
    received when it resumes. Paused longer than a peer's heartbeat bound (the peer's
    ``heartbeat_interval * heartbeat_misses``, or the network model's ``heartbeat_timeout`` when
    set), a peer linked to it declares it dead (as the gloo world's heartbeats do) and closes their
    connection, which the paused worker finds lost as soon as it resumes."""

    worker: int
    duration: float
    at: float = 0.0

    def __post_init__(self) -> None:
        what = f"Pause(worker={self.worker})"
        _check_rank(self.worker, what, "worker")
        _check_number(self, "duration", what, positive=True)
        _check_number(self, "at", what)

    def __str__(self) -> str:
        return f"pause worker {self.worker} at t={self.at:g}s for {self.duration:g}s"


Fault = Delay | Drop | Duplicate | Hold | Partition | Crash | Pause
_FAULT_TYPES = (Delay, Drop, Duplicate, Hold, Partition, Crash, Pause)
_ACTION_TYPES = (Deliver, Delay, Drop, Duplicate)


# -- the plan ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, init=False)
class FaultPlan:
    """What goes wrong in one simulation (see the module docstring).

    Args:
        faults: message, link and worker faults; times are virtual seconds from the start of the run,
            and message counts (``nth``) start there too.
        actions: the positional form: the *i*-th action applies to the *i*-th message the simulation
            sends (the *i*-th ``send`` event of the trace); messages past the end are delivered
            normally.
        gc_delay: a dead user RRef's delete is sent after a seeded delay drawn from [0, gc_delay).

    Every fault goes in ``faults``, whatever its type: ``FaultPlan([Hold(0, 1, 0.0, 5.0), Crash(2,
    at=1.0)])``. There is no second spelling (``holds=``, ``crashes=``: a :class:`FaultPlanError`
    says where they go).

    Raises:
        FaultPlanError: a value is out of range, or a keyword other than these (a ``ValueError``).
        TypeError: an entry is not a fault (or not an action, in ``actions``).
    """

    faults: tuple[Fault, ...]
    actions: tuple[Action, ...]
    gc_delay: float

    def __init__(
        self,
        faults: Iterable[Fault] = (),
        actions: Iterable[Action] = (),
        gc_delay: float = DEFAULT_GC_DELAY,
        **unknown: object,
    ) -> None:
        if unknown:
            raise FaultPlanError(_unknown_keyword(next(iter(unknown))))
        all_faults = tuple(faults)
        for i, f in enumerate(all_faults):
            if not isinstance(f, _FAULT_TYPES):
                raise TypeError(
                    f"FaultPlan.faults[{i}] is {f!r}; expected Delay, Drop, Duplicate, Hold, Partition, Crash or Pause"
                )
        acts = tuple(actions)
        for i, a in enumerate(acts):
            if not isinstance(a, _ACTION_TYPES):
                raise TypeError(
                    f"FaultPlan.actions[{i}] is {a!r}; expected Deliver, Delay, Drop or Duplicate"
                )
            if not isinstance(a, Deliver) and not a.positional:
                raise FaultPlanError(
                    f"FaultPlan.actions[{i}] is {a!r}: a positional action applies to the {i}-th message "
                    "sent; nth, count and rate belong to FaultPlan.faults"
                )
        object.__setattr__(self, "faults", all_faults)
        object.__setattr__(self, "actions", acts)
        object.__setattr__(self, "gc_delay", gc_delay)
        _check_number(self, "gc_delay", "FaultPlan")

    def __len__(self) -> int:
        """How many faults the plan holds: its faults and its actions other than ``Deliver`` (what
        shrinking minimizes; an empty plan is falsy)."""
        return len(self.faults) + sum(1 for a in self.actions if not isinstance(a, Deliver))

    @property
    def holds(self) -> tuple[Hold, ...]:
        """The :class:`Hold` faults."""
        return tuple(f for f in self.faults if isinstance(f, Hold))

    @property
    def crashes(self) -> tuple[Crash, ...]:
        """The :class:`Crash` faults."""
        return tuple(f for f in self.faults if isinstance(f, Crash))

    def describe(self) -> str:
        """One line a person can read: every fault, every non-``Deliver`` action, a non-default
        ``gc_delay`` (``FaultPlan()`` for a plan that does nothing)."""
        parts = []
        acts = [
            f"#{i}: {a.positional_text()}" for i, a in enumerate(self.actions) if not isinstance(a, Deliver)
        ]
        if acts:
            parts.append("actions=[" + ", ".join(acts) + "]")
        if self.faults:
            parts.append("faults=[" + "; ".join(str(f) for f in self.faults) + "]")
        if self.gc_delay != DEFAULT_GC_DELAY:
            parts.append(f"gc_delay={self.gc_delay:g}")
        return "FaultPlan(" + ", ".join(parts) + ")"

    def check_world(self, world_size: int) -> None:
        """Raise :class:`FaultPlanError` if a fault names a rank outside a world of ``world_size``."""
        for i, f in enumerate(self.faults):
            for field, rank in _ranks_of(f):
                if rank >= world_size:
                    raise FaultPlanError(
                        f"faults[{i}] ({f}): {field}={rank}: no worker {rank} in a world of {world_size}"
                    )
        for i, a in enumerate(self.actions):
            for field, rank in _ranks_of(a):
                if rank >= world_size:
                    raise FaultPlanError(
                        f"actions[{i}] ({a}): {field}={rank}: no worker {rank} in a world of {world_size}"
                    )

    # -- plain data --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (``FaultPlan.from_dict(plan.to_dict()) == plan``); default values are left out."""
        return plan_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> FaultPlan:
        """The plan a dict describes (the form of :meth:`to_dict`, a JSON or TOML file's content).

        Raises:
            FaultPlanError: naming the bad field, e.g. ``faults[1] (drop): unknown field 'knd'``.
        """
        return plan_from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> FaultPlan:
        """Read a plan from a ``.json`` or ``.toml`` file (see the how-to for the format)."""
        return plan_from_dict(read_data(path), f"{path}: ")

    def dump(self, path: str | Path) -> None:
        """Write the plan to a ``.json`` or ``.toml`` file; :meth:`load` reads back an equal plan."""
        dump_data(self.to_dict(), path)

    def to_json(self) -> str:
        """The plan as JSON text."""
        return to_json(self.to_dict())

    def to_toml(self) -> str:
        """The plan as TOML text."""
        return to_toml(self.to_dict())


def _unknown_keyword(name: str) -> str:
    """What FaultPlan says of a keyword it does not take: where that fault goes instead."""
    cls = {"holds": "Hold", "crashes": "Crash", "partitions": "Partition", "pauses": "Pause"}.get(name)
    if cls is None:
        return f"FaultPlan() got {name}=; it takes faults, actions and gc_delay"
    return (
        f"FaultPlan() takes no {name}=: put the {cls} faults in faults with the others, "
        f"e.g. FaultPlan([{cls}(...), ...])"
    )


def _ranks_of(f: Any) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for fl in fields(f):
        value = getattr(f, fl.name)
        if fl.name in ("src", "dst", "worker") and value is not None:
            out.append((fl.name, value))
        elif fl.name in ("a", "b") and value is not None:
            out.extend((fl.name, r) for r in value)
    return out


# -- the dict form (what a JSON or TOML file holds, see simulator/_model/_codec.py) ----------------
_FAULTS: dict[str, type] = {
    "delay": Delay,
    "drop": Drop,
    "duplicate": Duplicate,
    "hold": Hold,
    "partition": Partition,
    "crash": Crash,
    "pause": Pause,
}
_ACTIONS: dict[str, type] = {"deliver": Deliver, "delay": Delay, "drop": Drop, "duplicate": Duplicate}
_NAME = {cls: name for name, cls in _FAULTS.items()} | {Deliver: "deliver"}


# -- fault plans ---------------------------------------------------------------------------------------
def fault_to_dict(fault: Any) -> dict[str, Any]:
    return {"type": _NAME[type(fault)], **plain(fault)}


def _item(data: Any, where: str, table: dict[str, type]) -> Any:
    if not isinstance(data, dict):
        example = f"{{type = {json.dumps(data)}}}" if isinstance(data, str) else '{type = "drop", ...}'
        raise FaultPlanError(f"{where}: expected a table/object with a 'type', e.g. {example}; got {data!r}")
    kind = data.get("type")
    cls = table.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise FaultPlanError(f"{where}.type: {kind!r} is not one of {', '.join(table)}")
    return build(cls, data, f"{where} ({kind})", skip=("type",))


def plan_to_dict(plan: FaultPlan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if plan.gc_delay != DEFAULT_GC_DELAY:
        out["gc_delay"] = plan.gc_delay
    if plan.actions:
        out["actions"] = [fault_to_dict(a) for a in plan.actions]
    if plan.faults:
        out["faults"] = [fault_to_dict(f) for f in plan.faults]
    return out


def plan_from_dict(data: Any, where: str = "") -> FaultPlan:
    if not isinstance(data, dict):
        raise FaultPlanError(f"{where or 'fault plan'}: expected a table/object, got {type(data).__name__}")
    if "swarm" in data:
        raise FaultPlanError(
            f"{where or 'fault plan'}: this describes a Swarm, not a FaultPlan; read it with "
            "twinrpc.simulator.load_faults or Swarm.from_dict"
        )
    unknown = set(data) - {"gc_delay", "actions", "faults"}
    if unknown:
        raise FaultPlanError(
            f"{where}unknown field {sorted(unknown)[0]!r}; a fault plan has gc_delay, actions and faults"
        )
    gc_delay = convert(data.get("gc_delay", DEFAULT_GC_DELAY), "float", f"{where}gc_delay")
    lists = {}
    for name, table in (("actions", _ACTIONS), ("faults", _FAULTS)):
        items = data.get(name, [])
        if not isinstance(items, list):
            raise FaultPlanError(f"{where}{name}: expected a list, got {items!r}")
        lists[name] = [_item(x, f"{where}{name}[{i}]", table) for i, x in enumerate(items)]
    try:
        return FaultPlan(lists["faults"], lists["actions"], gc_delay)
    except (FaultPlanError, TypeError) as exc:
        raise FaultPlanError(f"{where}{exc}") from None
