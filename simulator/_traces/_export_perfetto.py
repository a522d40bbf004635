"""Chrome trace / Perfetto JSON: open it in ui.perfetto.dev or chrome://tracing.

Each worker is a process (``pid`` = rank, named after the worker) with two tracks: ``rpc`` (messages,
RRef, autograd and lifecycle events) and ``tasks`` (task switches). Events are zero-length slices at
their time in microseconds (virtual time; a recorded gloo run counts from its first event), with
their detail, message and vector clock as arguments. Each delivery of a message is a flow arrow
(``ph`` ``s``/``f``, one flow id per delivery) from the slice of its send to the slice of its delivery.
Events of the simulation itself (worker -1) form one more process, ``simulation``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._data import TraceData, TraceEvent

#: events whose detail names a message
MESSAGE_EVENTS = frozenset({"send", "deliver", "drop", "duplicate", "hold", "lost", "bounce", "send-failed"})
_RPC_TID = 0
_TASK_TID = 1


def _category(event: str) -> str:
    if event == "switch":
        return "task"
    if event.startswith("rref-"):
        return "rref"
    if event.startswith("autograd-"):
        return "autograd"
    return "message" if event in MESSAGE_EVENTS else "lifecycle"


def to_perfetto_dict(trace: TraceData) -> dict[str, Any]:
    """The trace as a Chrome trace event document (``{"traceEvents": [...], ...}``)."""
    events = trace.events
    n = trace.world_size
    t0 = events[0].time if events and trace.clock == "wall" else 0.0
    out: list[dict[str, Any]] = []
    sim_pid = n  # the simulation itself (worker -1)
    for rank in range(n):
        name = f"{trace.worker_name(rank)} (rank {rank})"
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}})
        out.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": _RPC_TID, "args": {"name": "rpc"}})
        out.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": _TASK_TID, "args": {"name": "tasks"}}
        )
    if any(ev.worker < 0 for ev in events):
        out.append(
            {"name": "process_name", "ph": "M", "pid": sim_pid, "tid": 0, "args": {"name": "simulation"}}
        )
        out.append(
            {"name": "process_sort_index", "ph": "M", "pid": sim_pid, "tid": 0, "args": {"sort_index": -1}}
        )
    sends: dict[int, TraceEvent] = {}
    flow = 0
    for ev in events:
        ts = (ev.time - t0) * 1e6
        pid = ev.worker if ev.worker >= 0 else sim_pid
        tid = _TASK_TID if ev.event == "switch" else _RPC_TID
        cat = _category(ev.event)
        args: dict[str, Any] = {"index": ev.index, "detail": ev.detail}
        if ev.clock is not None:
            args["vector_clock"] = list(ev.clock)
        m = ev.message
        if m is not None:
            args["message"] = {
                "kind": m.kind,
                "id": m.id,
                "src": m.src,
                "dst": m.dst,
                "bytes": m.nbytes,
                "seq": m.seq,
            }
            name = f"{ev.event} {m.kind}#{m.id}"
        else:
            name = ev.event
        out.append(
            {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": 0, "pid": pid, "tid": tid, "args": args}
        )
        if m is None or m.seq is None:
            continue
        if ev.event == "send":
            sends[m.seq] = ev
        elif ev.event in ("deliver", "lost", "bounce") and m.seq in sends:
            send = sends[m.seq]
            flow += 1
            common = {"name": m.kind, "cat": cat, "id": flow}
            out.append(
                {**common, "ph": "s", "ts": (send.time - t0) * 1e6, "pid": send.worker, "tid": _RPC_TID}
            )
            out.append({**common, "ph": "f", "bp": "e", "ts": ts, "pid": pid, "tid": tid})
    return {
        "traceEvents": out,
        "displayTimeUnit": "ns",
        "otherData": {
            "source": trace.source,
            "clock": trace.clock,
            "seed": trace.seed,
            "world_size": n,
            "workers": list(trace.names),
        },
    }


def to_perfetto(trace: TraceData) -> str:
    """The trace as Chrome trace / Perfetto JSON text."""
    return json.dumps(to_perfetto_dict(trace), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
