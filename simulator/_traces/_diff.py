"""Where two traces first differ: two seeds, two versions of a program, or a simulation vs a gloo run.

Exact mode compares the traces event by event, as the digest does (time to the nanosecond, worker,
event, detail), and stops at the first difference. Structural mode ignores times, message ids and
everything but messages: it compares each worker's sequence of sends and deliveries as
``(event, kind, peer)``, which is what a simulation and a recorded gloo run of the same program can
share (their clocks, task switches and internal events differ by construction).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from ._data import Divergence

if TYPE_CHECKING:
    from ._data import TraceEvent
    from ._trace import Trace

_STRUCTURAL_EVENTS = ("send", "deliver")


def _key(ev: TraceEvent) -> tuple[str, int, str, str]:
    return (f"{ev.time:.9f}", ev.worker, ev.event, ev.detail)


def diff_traces(
    a: Trace,
    b: Trace,
    *,
    structural: bool = False,
    kinds: Collection[str] | None = None,
    context: int = 3,
) -> Divergence | None:
    """The first difference between traces ``a`` and ``b``, or ``None`` when they are the same.

    Args:
        a: a trace (e.g. ``RunResult.trace`` or ``Trace.load(path)``).
        b: the trace to compare it with.
        structural: compare each worker's sequence of sends and deliveries only, as
            ``(event, kind, peer)``: for a simulation against a recorded gloo run, or runs whose
            timing differs by design.
        kinds: in structural mode, compare only messages of these kinds (names such as ``"CALL"``,
            ``"RESPONSE"``): e.g. leave out the shutdown barrier's ``GATHER``/``SCATTER`` rounds,
            whose number depends on timing.
        context: how many events before and after the difference to include.
    """
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    if kinds is not None and not structural:
        raise ValueError("kinds= filters a structural comparison: pass structural=True too")
    if structural:
        return _structural(a, b, context, None if kinds is None else frozenset(kinds))
    ea, eb = a.events(), b.events()
    mismatch = _first_mismatch(ea, eb, _key)
    if mismatch is None:
        return None
    i, x, y = mismatch
    first = x if x is not None else y
    assert first is not None
    lo = max(0, i - context)
    return Divergence(
        index=i,
        worker=first.worker,
        time=first.time,
        a=x,
        b=y,
        context_a=tuple(ea[lo : i + context + 1]),
        context_b=tuple(eb[lo : i + context + 1]),
    )


def _first_mismatch(
    sa: Sequence[TraceEvent], sb: Sequence[TraceEvent], key: Callable[[TraceEvent], object]
) -> tuple[int, TraceEvent | None, TraceEvent | None] | None:
    """Where two event sequences first differ by ``key`` (one ending early counts): the index and the
    events there (``None`` past an end), or ``None`` when they agree. Serves both comparisons."""
    for i in range(max(len(sa), len(sb))):
        x = sa[i] if i < len(sa) else None
        y = sb[i] if i < len(sb) else None
        if x is None or y is None or key(x) != key(y):
            return i, x, y
    return None


def _per_worker(trace: Trace, kinds: frozenset[str] | None) -> dict[int, list[TraceEvent]]:
    out: dict[int, list[TraceEvent]] = {}
    for ev in trace:
        m = ev.message
        if (
            ev.event in _STRUCTURAL_EVENTS
            and m is not None
            and ev.worker >= 0
            and (kinds is None or m.kind in kinds)
        ):
            out.setdefault(ev.worker, []).append(ev)
    return out


def _shape(ev: TraceEvent) -> tuple[str, str, int]:
    m = ev.message
    assert m is not None
    return (ev.event, m.kind, m.dst if ev.event == "send" else m.src)


def _structural(a: Trace, b: Trace, context: int, kinds: frozenset[str] | None) -> Divergence | None:
    wa, wb = _per_worker(a, kinds), _per_worker(b, kinds)
    best: tuple[int, Divergence] | None = None
    for worker in sorted(set(wa) | set(wb)):
        sa, sb = wa.get(worker, []), wb.get(worker, [])
        mismatch = _first_mismatch(sa, sb, _shape)
        if mismatch is None:
            continue
        i, x, y = mismatch
        first = x if x is not None else y
        assert first is not None
        # order the workers' divergences by where they happen in A (A's length if A ended there)
        rank = x.index if x is not None else len(a) + (y.index if y is not None else 0)
        lo = max(0, i - context)
        div = Divergence(
            index=i,
            worker=worker,
            time=first.time,
            a=x,
            b=y,
            context_a=tuple(sa[lo : i + context + 1]),
            context_b=tuple(sb[lo : i + context + 1]),
            structural=True,
        )
        if best is None or rank < best[0]:
            best = (rank, div)
    return best[1] if best is not None else None
