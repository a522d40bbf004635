"""What a twin program observed, in a form both worlds can be compared on.

An :class:`Outcome` is per operation of the driver the value, or the exception's class name and
PyTorch message fragment, or that it was skipped; which started calls completed and how (``waited``
and ``end-wait`` records); each serving worker's departure and shutdown result; which workers died;
and a world-level failure (a simulated deadlock, a gloo world that hung) if there was one. Outcomes
are frozen and hashable, so the simulator's outcomes over several seeds form a set and the gloo
outcome must be a member of it.

Message *fragments* drop what legitimately differs between runs (durations, the remote traceback
after the first line) and keep the words users match on ("RPC ran for more than", the remote
exception's own text, the departed worker's name).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .programs import Program

__all__ = ["Outcome", "Result", "describe_exception", "first_difference", "fragment"]

#: one record: ("ok", value) | ("raised", class name, fragment) | ("skipped",) | ("started",)
#: | ("waited", index of the Start, Result)
Result = tuple[Any, ...]

_NUMBER = re.compile(r"\d+\.\d+(e-?\d+)?")
_ADDRESS = re.compile(r"0x[0-9a-f]+")


#: which clock a timeout message names differs between the worlds on purpose
_CLOCK = re.compile(r"\((simulated|wall-clock) time\)")
#: why a peer is unavailable: the transport's own words (gloo's "Connection closed by peer [addr]",
#: the simulator's "simulated crash at t=..."), like PyTorch's ERR-7 transport message; the rest of
#: the sentence (who, to whom, what to do) is compared
_TRANSPORT = re.compile(
    r"(is unavailable to WorkerInfo\([^)]*\)): .*?(\. (Its process has probably died|It has shut down RPC))"
)


def fragment(message: str) -> str:
    """The comparable part of an exception message: its first line (for a remote error, PyTorch's
    ``On WorkerInfo(...):`` line and the ``repr`` of the remote exception after it, not the remote
    traceback), with decimals, addresses and the name of the clock masked."""
    lines = message.strip().splitlines()
    kept = lines[:2] if lines and lines[0].startswith("On WorkerInfo(") else lines[:1]
    text = " | ".join(kept)
    text = _TRANSPORT.sub(r"\1: <transport>\2", text)
    return _CLOCK.sub("(# time)", _ADDRESS.sub("0x#", _NUMBER.sub("#", text)))


def describe_exception(exc: BaseException) -> tuple[str, str]:
    """(class name, message fragment) of an exception a call raised. A ``KeyError``'s ``str`` is the
    ``repr`` of its argument, so its argument is used instead."""
    args = exc.args
    message = (
        args[0] if isinstance(exc, KeyError) and len(args) == 1 and isinstance(args[0], str) else str(exc)
    )
    return type(exc).__name__, fragment(message)


def freeze(value: Any) -> Any:
    """Lists, tuples and dicts as nested tuples (hashable, equal across pickling)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class Outcome:
    """Everything one run of a program observed (see the module docstring).

    Attributes:
        ops: the driver's records, ``(index, "op" | "end-wait", result)``.
        workers: per serving worker of a fresh world: ``(rank, order, shutdown result)``; a dead
            worker's entry is ``(rank, "died", None)``.
        driver_end: the driver's end-of-program records (finish orders, its own shutdown).
        failure: a world-level failure (``"deadlock: ..."``, ``"hung: ..."``), else ``None``.
    """

    ops: tuple[Any, ...] = ()
    workers: tuple[Any, ...] = ()
    driver_end: tuple[Any, ...] = ()
    failure: str | None = None

    @classmethod
    def from_values(cls, values: list[Any], crashed: frozenset[int] = frozenset()) -> Outcome:
        """Build from :func:`twin.interpreter.interpret`'s per-rank return values."""
        driver = values[0]
        if driver is None:
            return cls(failure="the driver returned nothing")
        end = tuple((k, freeze(v)) for k, v in sorted(driver.items()) if k != "ops")
        workers = []
        for rank, value in enumerate(values[1:], start=1):
            if rank in crashed:
                workers.append((rank, "died", None))
            elif value is not None:
                workers.append((rank, value["order"], freeze(value["shutdown"])))
        return cls(ops=freeze(driver["ops"]), workers=tuple(workers), driver_end=end)

    def lines(self, program: Program) -> list[str]:
        """One readable line per record."""
        out = []
        for index, kind, result in self.ops:
            op = program.ops[index] if 0 <= index < len(program.ops) else "?"
            tag = "" if kind == "op" else f" [{kind}]"
            out.append(f"  [{index}] {op!r}{tag} -> {result!r}")
        out += [f"  worker {rank}: {order} -> {result!r}" for rank, order, result in self.workers]
        out += [f"  driver {key}: {result!r}" for key, result in self.driver_end]
        if self.failure is not None:
            out.append(f"  WORLD FAILURE: {self.failure}")
        return out

    def render(self, program: Program) -> str:
        return "\n".join(self.lines(program))


def first_difference(a: Outcome, b: Outcome, program: Program) -> str:
    """The first line on which two outcomes' renderings differ (or a note that they are equal)."""
    la, lb = a.lines(program), b.lines(program)
    for x, y in zip(la, lb, strict=False):
        if x != y:
            return f"first difference:\n  sim : {x.strip()}\n  gloo: {y.strip()}"
    if len(la) != len(lb):
        return f"one outcome has more records ({len(la)} vs {len(lb)})"
    return "outcomes equal"
