"""Twin programs: small RPC programs as plain data, and the hypothesis strategy that draws them.

A :class:`Program` is a world size and a tuple of operations that worker 0 (the *driver*) performs
in order; the other workers serve requests and, in programs with departures, wait for the driver's
order to leave or die. Programs are data (not code) so that one interpreter
(:func:`twin.interpreter.interpret`) runs them unchanged on the simulator and in gloo processes, so
hypothesis can shrink them, and so a disagreement prints as a short, readable, runnable program
(:meth:`Program.source`).

Operations name workers by rank and earlier results by *slot*: ``slot`` picks one of the driver's
live RRefs (or pending futures) modulo their number, so every list of operations is valid and
hypothesis can delete any operation while shrinking (an operation with nothing to act on is
recorded as skipped).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from hypothesis import strategies as st

__all__ = [
    "DEPARTURE_KINDS",
    "OP_KINDS",
    "Builtin",
    "Chain",
    "Fail",
    "FanOut",
    "Kill",
    "Leave",
    "Op",
    "PassOn",
    "Program",
    "Remote",
    "RemoteOf",
    "Slow",
    "Start",
    "Sync",
    "ToHere",
    "Train",
    "Wait",
    "programs",
]


# -- operations (frozen plain data; their reprs are valid Python) ---------------------------------------
@dataclass(frozen=True)
class Sync:
    """``rpc_sync(dst, echo, (x,))``: the callee answers with its own name and ``x``."""

    dst: int
    x: int = 0


@dataclass(frozen=True)
class Builtin:
    """A call of a torch builtin operator, which both worlds send in the compact builtin encoding
    (``src/twinrpc/_builtin_wire.py``): ``torch.add(torch.full((2,), x), 1)`` on ``dst``, or with
    ``bad`` a size mismatch that raises there; ``sync`` chooses ``rpc_sync`` or
    ``rpc_async(...).wait()``."""

    dst: int
    x: int = 0
    bad: bool = False
    sync: bool = True


@dataclass(frozen=True)
class Chain:
    """Nested calls: ``rpc_sync(hops[0], hop, ...)`` and each hop calls the next (a hop may be the
    driver itself, called back while it waits); the value is the list of names visited."""

    hops: tuple[int, ...]


@dataclass(frozen=True)
class FanOut:
    """``rpc_async`` to every ``dsts`` at once, then wait for each future in order."""

    dsts: tuple[int, ...]
    x: int = 0


@dataclass(frozen=True)
class Fail:
    """A remote exception: the callee raises ``error`` (a builtin class name); ``sync`` chooses
    ``rpc_sync`` or ``rpc_async(...).wait()``."""

    dst: int
    error: str = "ValueError"
    sync: bool = True


@dataclass(frozen=True)
class Slow:
    """``rpc_sync(dst, hold)`` where the callee sleeps ``HOLD`` seconds; with ``timeout`` shorter
    than that, the call times out (and the callee still finishes)."""

    dst: int
    timeout: bool = False


@dataclass(frozen=True)
class Start:
    """``rpc_async(dst, hold)`` kept pending in a future slot (waited by :class:`Wait`, or at the
    end of the program)."""

    dst: int


@dataclass(frozen=True)
class Wait:
    """Wait for a pending future slot (it leaves the slots)."""

    slot: int = 0


@dataclass(frozen=True)
class Remote:
    """``rpc.remote(owner, make, (x,))``: a new RRef slot."""

    owner: int
    x: int = 0


@dataclass(frozen=True)
class ToHere:
    """``rref.to_here()`` on the driver."""

    slot: int = 0


@dataclass(frozen=True)
class PassOn:
    """The RRef travels: ``rpc_sync(via, deref, (rref,))``, and ``via`` fetches its value."""

    slot: int
    via: int


@dataclass(frozen=True)
class RemoteOf:
    """``rpc.remote(via, deref, (rref,))``: a new RRef slot whose value ``via`` fetched from the
    RRef passed on (nested remote)."""

    slot: int
    via: int


@dataclass(frozen=True)
class Train:
    """Parameters on ``owners`` (``rpc.remote``), ``steps`` rounds of distributed forward, backward
    and ``DistributedOptimizer`` (SGD) step; the value is every parameter afterwards."""

    owners: tuple[int, ...]
    steps: int = 1


@dataclass(frozen=True)
class Leave:
    """Worker ``rank`` calls ``rpc.shutdown(graceful=graceful)`` now (ordered by the driver, which
    then waits ``SETTLE`` seconds). A graceful leave is PyTorch's barrier: the worker keeps serving
    until everyone has shut down."""

    rank: int
    graceful: bool = False


@dataclass(frozen=True)
class Kill:
    """Worker ``rank`` dies at once (SIGKILL in gloo, ``Simulation.crash`` in the simulator); the
    driver then waits ``SETTLE`` seconds."""

    rank: int


Op = (
    Sync
    | Builtin
    | Chain
    | FanOut
    | Fail
    | Slow
    | Start
    | Wait
    | Remote
    | ToHere
    | PassOn
    | RemoteOf
    | Train
    | Leave
    | Kill
)

#: operation kinds (class names) the generator can draw, departures excluded
OP_KINDS = (
    "Sync",
    "Builtin",
    "Chain",
    "FanOut",
    "Fail",
    "Slow",
    "Start",
    "Wait",
    "Remote",
    "ToHere",
    "PassOn",
    "RemoteOf",
    "Train",
)
#: the ways a worker leaves the world (programs with them run in fresh worlds): a non-graceful
#: ``shutdown(graceful=False)``, a graceful (barrier) shutdown, a kill
DEPARTURE_KINDS = ("leave", "leave-graceful", "kill")


@dataclass(frozen=True)
class Program:
    """``ops`` performed by worker 0 of a world of ``world_size`` workers."""

    world_size: int
    ops: tuple[Op, ...] = field(default=())

    @property
    def departures(self) -> bool:
        """Whether a worker leaves or dies: then the program needs a fresh world of its own."""
        return any(isinstance(op, Leave | Kill) for op in self.ops)

    def killed(self) -> frozenset[int]:
        """The ranks that die (the first departure of a rank is the one that happens)."""
        gone: set[int] = set()
        killed: set[int] = set()
        for op in self.ops:
            if isinstance(op, Leave | Kill) and 0 < op.rank < self.world_size and op.rank not in gone:
                gone.add(op.rank)
                if isinstance(op, Kill):
                    killed.add(op.rank)
        return frozenset(killed)

    def source(self) -> str:
        """The program as Python, one operation a line (what a disagreement prints)."""
        lines = [f"Program(world_size={self.world_size}, ops=("]
        lines += [f"    {op!r}," for op in self.ops]
        lines.append("))")
        return "\n".join(lines)


# -- strategy ---------------------------------------------------------------------------------------------
_ERRORS = ("ValueError", "KeyError", "TypeError", "ZeroDivisionError")


def _ops(world_size: int, kinds: Collection[str]) -> st.SearchStrategy[Op]:
    anyone = st.integers(0, world_size - 1)
    others = st.integers(1, world_size - 1)
    slot = st.integers(0, 3)
    small = st.integers(0, 9)
    options: dict[str, st.SearchStrategy[Op]] = {
        "Sync": st.builds(Sync, dst=anyone, x=small),
        "Builtin": st.builds(Builtin, dst=anyone, x=small, bad=st.booleans(), sync=st.booleans()),
        "Chain": st.builds(Chain, hops=st.lists(anyone, min_size=1, max_size=4).map(tuple)),
        "FanOut": st.builds(FanOut, dsts=st.lists(anyone, min_size=1, max_size=4).map(tuple), x=small),
        "Fail": st.builds(Fail, dst=anyone, error=st.sampled_from(_ERRORS), sync=st.booleans()),
        "Slow": st.builds(Slow, dst=anyone, timeout=st.booleans()),
        "Start": st.builds(Start, dst=anyone),
        "Wait": st.builds(Wait, slot=slot),
        "Remote": st.builds(Remote, owner=anyone, x=small),
        "ToHere": st.builds(ToHere, slot=slot),
        "PassOn": st.builds(PassOn, slot=slot, via=anyone),
        "RemoteOf": st.builds(RemoteOf, slot=slot, via=anyone),
        "Train": st.builds(
            Train, owners=st.lists(anyone, min_size=1, max_size=3).map(tuple), steps=st.integers(1, 2)
        ),
        "leave": st.builds(Leave, rank=others, graceful=st.just(False)),
        "leave-graceful": st.builds(Leave, rank=others, graceful=st.just(True)),
        "kill": st.builds(Kill, rank=others),
    }
    unknown = [k for k in kinds if k not in options]
    if unknown:
        raise ValueError(f"unknown operation kinds {unknown}; choose from {sorted(options)}")
    return st.one_of(*(options[k] for k in kinds))


def programs(
    *,
    kinds: Collection[str] = OP_KINDS,
    departures: bool | Collection[str] = False,
    min_workers: int = 2,
    max_workers: int = 4,
    max_ops: int = 8,
) -> st.SearchStrategy[Program]:
    """Programs over ``min_workers``..``max_workers`` workers with up to ``max_ops`` operations of
    ``kinds``; ``departures`` adds :class:`Leave` and :class:`Kill`: ``True`` every way of leaving,
    or some of ``DEPARTURE_KINDS``. Shrinks towards fewer workers, fewer and earlier-listed
    operations."""
    if isinstance(departures, bool):
        departures = DEPARTURE_KINDS if departures else ()
    all_kinds = tuple(kinds) + tuple(departures)

    def for_size(n: int) -> st.SearchStrategy[Program]:
        return st.lists(_ops(n, all_kinds), min_size=1, max_size=max_ops).map(
            lambda ops: Program(n, tuple(ops))
        )

    return st.integers(min_workers, max_workers).flatmap(for_size)
