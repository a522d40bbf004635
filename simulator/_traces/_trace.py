"""The trace of a run: every send, delivery, drop, task switch, RRef and autograd event, in order.

Recording is on the hot path, so each event is packed into one fixed-size record of numbers (its
strings interned) and formatted only when read: a run of a million events holds one buffer, not
millions of tuples for the allocator and the cyclic GC to walk. Read back, an event is a tuple
``(time, worker, event, detail)``. A message event's detail is a tuple
``(kind, id, src, dst, nbytes, seq, note)``, never the message (which would keep its tensors alive);
``seq`` is the message number the trace gave the send, so every later event about the same message
(its delivery, a drop, a duplicate) names the same number. A task switch's detail is
``(task id, task name)``.

Vector clocks are not stored: each worker's clock ticks at each of its events, a send carries the
sender's clock, and a delivery merges it before ticking. They follow from the order of events and the
message numbers, so :meth:`Trace.events` computes them when the trace is read, which keeps recording
a dict store and a packed record per message.

The same events come from a file: :meth:`Trace.save` writes JSON lines (``twinrpc._trace_format``);
:meth:`Trace.load` reads that back, or the per-worker files of the gloo world's recorder
(``TWINRPC_TRACE=dir``), merged in causal order.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from twinrpc._message import Kind, Message
from twinrpc._trace_format import FORMAT, VERSION, event_line, header_line

from .._errors import TraceFormatError
from ._data import MessageInfo, TraceData, TraceEvent
from ._export import export
from ._export_text import to_text

#: events after which the message is gone (delivered, lost, dropped or bounced)
_FINAL = frozenset({"deliver", "lost", "bounce", "drop"})
#: a message kind -> its name, which a message event reads back in place of the kind (it renders the same)
_KIND_NAMES: dict[Any, str] = {k: k.name for k in Kind}
_KIND_BY_VALUE: dict[int, str] = {k.value: k.name for k in Kind}

# Each event is one 80-byte record of packed numbers: its time, its worker, its code (the index in
# Trace._event_table of its name and the form of its detail), then up to 7 ints that hold the detail
# (zeros after a shorter form's):
_OBJECT = 0  # (index in Trace._objects): a string, or a detail that fits no form below
_MESSAGE = 1  # (kind, id, src, dst, nbytes, seq, note) of a Message: the kind by value
_NAMED = 2  # the same with the kind's name (a loaded trace's, or given to record()), interned
_SWITCH = 3  # (task id, task name): the name interned
# In both message forms a seq of None is -1 and the note is interned (Trace._strings). Native byte
# order: records never leave the process, and Trace.count reads the codes as native ints.
_RECORD = struct.Struct("=d9q")  # a message's record, and how any record is read
_SWITCH_RECORD = struct.Struct("=d4q40x")
_OBJECT_RECORD = struct.Struct("=d3q48x")
_pack, _pack_switch = _RECORD.pack, _SWITCH_RECORD.pack  # bound once: they run per message and per switch
_FIELDS = 10  # the 8-byte fields of a record; the code is field 2
_EMPTY = 0  # the number of "" in every trace's _Strings
_SEND = 0  # the code of "send" (a _MESSAGE event) in every trace


class _Strings(dict[Any, int]):
    """A trace's interned values (notes, task names, kind names) -> small ints; a value seen for the
    first time gets the next number, and ``table[number]`` is the value."""

    __slots__ = ("table",)

    def __init__(self) -> None:
        super().__init__()
        self.table: list[Any] = []
        self[""]  # interned first: _EMPTY

    def __missing__(self, value: Any) -> int:
        code = len(self.table)
        self.table.append(value)
        self[value] = code
        return code


class _EventCodes(dict[Any, int]):
    """Event names -> codes, for events of one form. A trace has one of these per form; they share
    ``table``, where ``table[code]`` is ``(name, form)``."""

    __slots__ = ("form", "table")

    def __init__(self, table: list[tuple[Any, int]], form: int) -> None:
        super().__init__()
        self.table = table
        self.form = form

    def __missing__(self, name: Any) -> int:
        code = len(self.table)
        self.table.append((name, self.form))
        self[name] = code
        return code


def _named_message(detail: tuple[Any, ...]) -> bool:
    """Whether a 7-tuple given to :meth:`Trace.record` reads back the same from the ``_NAMED`` form
    (ints that do not fit 64 bits are found when packing)."""
    kind, msg_id, src, dst, nbytes, seq, note = detail
    return (
        type(kind) is str
        and type(note) is str
        and type(msg_id) is int
        and type(src) is int
        and type(dst) is int
        and type(nbytes) is int
        and (seq is None or (type(seq) is int and seq >= 0))
    )


def _render(detail: Any) -> str:
    if type(detail) is str:
        return detail
    if type(detail) is tuple:
        if len(detail) == 7:
            kind, msg_id, src, dst, nbytes, _seq, note = detail
            name = kind.name if isinstance(kind, Kind) else kind
            return f"{name}#{msg_id} {src}->{dst} ({nbytes} B){note}"
        if len(detail) == 2:
            return f"{detail[1]} (task {detail[0]})"
    return str(detail)


def _message(detail: Any) -> MessageInfo | None:
    if type(detail) is tuple and len(detail) == 7:
        kind, msg_id, src, dst, nbytes, seq, _note = detail
        name = kind.name if isinstance(kind, Kind) else str(kind)
        return MessageInfo(name, msg_id, src, dst, nbytes, seq)
    return None


class Trace:
    """Events in the order they happened. Same seed + same program = the same trace (SIM-1).

    Args:
        enabled: record events (off: nothing is recorded and the digest covers nothing).
        seed: the simulation's seed (written into saved files).
        world_size: the number of workers (the length of each vector clock).
        workers: the workers' names by rank (a simulation fills them in at ``init_rpc``).
        source: ``"simulator"``, or ``"gloo"`` for a recorded real run.
        clock: ``"virtual"`` or ``"wall"``: what event times mean.
    """

    def __init__(
        self,
        enabled: bool = True,
        *,
        seed: int | None = None,
        world_size: int = 0,
        workers: list[str] | None = None,
        source: str = "simulator",
        clock: str = "virtual",
    ) -> None:
        self.enabled = enabled
        self.seed = seed
        self.world_size = world_size
        self.workers: list[str] = list(workers) if workers is not None else []
        self.source = source
        self.clock = clock
        # the events' records (see _RECORD), in order
        self._buffer = bytearray()
        self._objects: list[Any] = []
        self._strings = _Strings()
        self._event_table: list[tuple[Any, int]] = []
        self._object_events = _EventCodes(self._event_table, _OBJECT)
        self._message_events = _EventCodes(self._event_table, _MESSAGE)
        self._named_events = _EventCodes(self._event_table, _NAMED)
        self._switch_events = _EventCodes(self._event_table, _SWITCH)
        self._message_events["send"]  # interned first: _SEND
        # id(message) -> its message number, from its send to its last event (an id is unique while
        # the message lives, and a message in flight is alive: the event queue holds it)
        self._numbers: dict[int, int] = {}
        # (src, dst, kind, id) -> numbers of duplicated messages whose extra copy has not arrived yet
        # (a fault's copy is a new object, or the same one delivered twice: either misses _numbers)
        self._copies: dict[tuple[int, int, Any, int], list[int]] = {}
        self._sent = 0

    # -- recording ---------------------------------------------------------------------------------
    def record(self, time: float, worker: int, event: str, detail: Any) -> None:
        """Record an event; ``detail`` is a string (or a tuple as described in the module docstring).

        The event reads back with the same values: a task switch's or a message's detail is packed
        as ints, any other detail kept as is.

        Raises:
            struct.error: ``time`` is not a number or ``worker`` not an int (nothing is recorded).
        """
        if not self.enabled:
            return
        if type(detail) is tuple:
            size = len(detail)
            if size == 2:  # a task switch, each time the scheduler runs another task
                task, name = detail
                if type(task) is int and type(name) is str:
                    try:
                        self._buffer += _pack_switch(
                            time, worker, self._switch_events[event], task, self._strings[name]
                        )
                        return
                    except struct.error:  # an id past 64 bits (or a bad time or worker: raised below)
                        pass
            elif size == 7 and _named_message(detail):
                kind, msg_id, src, dst, nbytes, seq, note = detail
                strings = self._strings
                code = self._named_events[event]
                try:
                    self._buffer += _RECORD.pack(
                        time,
                        worker,
                        code,
                        strings[kind],
                        msg_id,
                        src,
                        dst,
                        nbytes,
                        -1 if seq is None else seq,
                        strings[note],
                    )
                    return
                except struct.error:
                    pass
        self._record_object(time, worker, event, detail)

    def _record_object(self, time: float, worker: int, event: Any, detail: Any) -> None:
        """An event whose detail is kept as is (the record holds its index in ``_objects``)."""
        objects = self._objects
        self._buffer += _OBJECT_RECORD.pack(time, worker, self._object_events[event], len(objects))
        objects.append(detail)

    def _record_message(
        self, time: float, worker: int, event: str, msg: Message, nbytes: int, n: int | None, note: str
    ) -> None:
        """A message event whose fields do not pack (a Message's always do): kept as a tuple."""
        detail = (_KIND_NAMES.get(msg.kind, msg.kind), msg.id, msg.src, msg.dst, nbytes, n, note)
        self._record_object(time, worker, event, detail)

    def sent(self, time: float, worker: int, msg: Message, nbytes: int) -> None:
        """Record the send of ``msg``, giving it the next message number."""
        if self.enabled:
            n = self._sent
            self._sent = n + 1
            self._numbers[id(msg)] = n
            try:
                self._buffer += _pack(
                    time, worker, _SEND, msg.kind, msg.id, msg.src, msg.dst, nbytes, n, _EMPTY
                )
            except struct.error:
                self._record_message(time, worker, "send", msg, nbytes, n, "")

    def message(self, time: float, worker: int, event: str, msg: Message, note: str = "") -> None:
        """Record an event about ``msg`` (``deliver``, ``drop``, ``lost``...); ``note`` is appended to
        its detail (e.g. ``": worker 1 crashed"``). ``send-failed`` (never sent) has no number."""
        if not self.enabled:
            return
        n: int | None
        if event in _FINAL:
            n = self._numbers.pop(id(msg), None)
            if n is None and self._copies:
                n = self._copy_number(msg)
        elif event == "send-failed":
            n = None
        else:
            n = self._numbers.get(id(msg))
            if event == "duplicate" and n is not None:
                self._copies.setdefault((msg.src, msg.dst, msg.kind, msg.id), []).append(n)
        tensors = msg.tensors  # msg.nbytes, inlined: every delivery is recorded
        nbytes = len(msg.payload) + (sum(t.numel() for t in tensors) if tensors else 0)
        try:
            self._buffer += _pack(
                time,
                worker,
                self._message_events[event],
                msg.kind,
                msg.id,
                msg.src,
                msg.dst,
                nbytes,
                -1 if n is None else n,
                self._strings[note] if note else _EMPTY,
            )
        except struct.error:
            self._record_message(time, worker, event, msg, nbytes, n, note)

    def _copy_number(self, msg: Message) -> int | None:
        key = (msg.src, msg.dst, msg.kind, msg.id)
        pending = self._copies.get(key)
        if not pending:
            return None
        n = pending.pop(0)
        if not pending:
            del self._copies[key]
        return n

    def copied(self, original: Message, copy: Message) -> None:
        """``copy`` (a fault's duplicate of ``original``, a new object) is the same message: later
        events about it carry the original's message number."""
        if self.enabled:
            n = self._numbers.get(id(original))
            if n is not None:
                self._numbers[id(copy)] = n

    def name_worker(self, rank: int, name: str) -> None:
        """Remember ``rank``'s worker name (the first one it used)."""
        while len(self.workers) <= rank:
            self.workers.append(f"rank{len(self.workers)}")
        if self.workers[rank] == f"rank{rank}":
            self.workers[rank] = name
        self.world_size = max(self.world_size, rank + 1)

    # -- reading -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._buffer) // _RECORD.size

    def count(self, event: str) -> int:
        """How many ``event`` events the trace holds (e.g. ``count("send")``, the messages sent),
        counted from the events' codes without reading the events back."""
        codes = [code for code, (name, _) in enumerate(self._event_table) if name == event]
        if not codes:
            return 0
        column = memoryview(bytes(self._buffer)).cast("q")[2::_FIELDS].tolist()
        return sum(column.count(code) for code in codes)

    def _rows(self) -> Iterator[tuple[float, int, Any, Any]]:
        """Every event as recorded, a tuple ``(time, worker, event, detail)`` (see the module
        docstring), unpacked as it is read (from a copy of the records: recording may go on)."""
        table, values, objects = self._event_table, self._strings.table, self._objects
        for time, worker, code, a, b, c, d, e, f, g in _RECORD.iter_unpack(bytes(self._buffer)):
            event, form = table[code]
            if form == _MESSAGE:
                yield (
                    time,
                    worker,
                    event,
                    (_KIND_BY_VALUE.get(a, a), b, c, d, e, None if f < 0 else f, values[g]),
                )
            elif form == _SWITCH:
                yield time, worker, event, (a, values[b])
            elif form == _NAMED:
                yield time, worker, event, (values[a], b, c, d, e, None if f < 0 else f, values[g])
            else:
                yield time, worker, event, objects[a]

    def __iter__(self) -> Iterator[TraceEvent]:
        """Every event with its message and vector clock (see :meth:`events`)."""
        rows = list(self._rows())
        n = max(self.world_size, len(self.workers), 1 + max((w for _, w, _, _ in rows), default=-1))
        clocks = [[0] * n for _ in range(n)]
        carried: dict[int, list[int]] = {}  # message number -> the sender's clock at its send
        for index, (t, w, e, d) in enumerate(rows):
            clock: tuple[int, ...] | None = None
            info = _message(d)
            if 0 <= w < n:
                vc = clocks[w]
                if e == "deliver" and info is not None and info.seq is not None:
                    sent = carried.get(info.seq)
                    if sent is not None:
                        for i, c in enumerate(sent):
                            if c > vc[i]:
                                vc[i] = c
                vc[w] += 1
                if e == "send" and info is not None and info.seq is not None:
                    carried[info.seq] = list(vc)
                clock = tuple(vc)
            yield TraceEvent(t, w, e, _render(d), info, clock, index)

    def events(self) -> list[TraceEvent]:
        """Every event, with its :class:`MessageInfo` and vector clock.

        Each worker's clock counts its own events; a ``deliver`` first takes the element-wise
        maximum with the clock its message's ``send`` carried. So event ``a`` happened before event
        ``b`` exactly when ``a.clock <= b.clock`` element-wise and they differ.
        """
        return list(self)

    def worker_name(self, rank: int) -> str:
        """The name of ``rank`` (``"simulation"`` for -1)."""
        if rank < 0:
            return "simulation"
        return self.workers[rank] if rank < len(self.workers) else f"rank{rank}"

    def _data(self) -> TraceData:
        """The events, with every rank they name named: what the exports and the file render."""
        events = tuple(self)
        n = max(self.world_size, len(self.workers), 1 + max((ev.worker for ev in events), default=-1))
        names = tuple(self.worker_name(r) for r in range(n))
        return TraceData(events, names, self.seed, self.source, self.clock)

    def digest(self) -> str:
        """A SHA-256 over every event: equal digests mean identical runs."""
        h = hashlib.sha256()
        for t, w, e, d in self._rows():
            h.update(f"{t:.9f}|{w}|{e}|{_render(d)}\n".encode())
        return h.hexdigest()

    def text(self, limit: int | None = None) -> str:
        """The readable timeline, the same text as ``export("text")``: a header, then one line per
        event (the first ``limit``, or all) with its index, time, worker, detail and vector clock; a
        delivery also says when and by whom its message was sent."""
        return to_text(self._data(), limit=limit)

    def export(self, format: str, path: str | Path | None = None) -> str:
        """Render the trace for a viewer: ``"perfetto"`` (Chrome trace JSON), ``"shiviz"``,
        ``"text"`` or ``"html"`` (a self-contained space-time diagram); also written to ``path``
        when given. Returns the text.

        Raises:
            ValueError: an unknown format.
        """
        return export(self._data(), format, path)

    # -- files -------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the trace as JSON lines: a header (format, version, seed, world size, worker names),
        then one event a line with its message and vector clock. Same events = the same bytes."""
        data = self._data()
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(
                header_line(
                    source=self.source,
                    clock=self.clock,
                    seed=self.seed,
                    world_size=data.world_size,
                    workers=list(data.names),
                )
                + "\n"
            )
            for ev in data.events:
                m = ev.message
                msg = (m.kind, m.id, m.src, m.dst, m.nbytes, m.seq) if m is not None else None
                f.write(event_line(ev.time, ev.worker, ev.event, ev.detail, msg, ev.clock) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace saved by :meth:`save`, or a gloo run recorded with ``TWINRPC_TRACE=dir``
        (pass the directory: its per-worker files are merged in causal order, each delivery after
        its send, otherwise by time).

        Raises:
            TraceFormatError: not a twinrpc trace, or a version this twinrpc does not read.
            FileNotFoundError: no such file, or a directory without ``*.jsonl`` files.
        """
        p = Path(path)
        if p.is_dir():
            files = sorted(p.glob("*.jsonl"))
            if not files:
                raise FileNotFoundError(f"{p}: no *.jsonl trace files in this directory")
            parts = [_read(f) for f in files]
            if len(parts) == 1 and parts[0][0].get("rank") is None:
                return _build(*parts[0])
            return _merge(parts, p)
        header, events = _read(p)
        if header.get("rank") is not None:  # one worker's file of a recorded run
            return _merge([(header, events)], p)
        return _build(header, events)


# -- loading -----------------------------------------------------------------------------------------
_Raw = tuple[float, int, str, Any]


def _read(path: Path) -> tuple[dict[str, Any], list[_Raw]]:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
        try:
            header = json.loads(first)
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise TraceFormatError(
                f"{path}: not a twinrpc trace (its first line should be a header with "
                f'"format": "{FORMAT}"; write one with Trace.save or TWINRPC_TRACE=dir)'
            )
        if header.get("version") != VERSION:
            raise TraceFormatError(
                f"{path}: trace format version {header.get('version')!r}; this twinrpc reads version "
                f"{VERSION}"
            )
        events: list[_Raw] = []
        for lineno, line in enumerate(f, start=2):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                t, w, e, d = float(obj["t"]), int(obj["w"]), str(obj["e"]), str(obj["d"])
                m = obj.get("m")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{path}:{lineno}: not a trace event ({exc}): {line[:200]!r}")
            if m is not None:
                kind, msg_id, src, dst, nbytes, seq = m
                detail: Any = (str(kind), int(msg_id), int(src), int(dst), int(nbytes), seq, "")
                base = _render(detail)
                note = d[len(base) :] if d.startswith(base) else ""
                detail = (*detail[:6], note)
            else:
                detail = d
            events.append((t, w, e, detail))
    return header, events


def _new(header: dict[str, Any]) -> Trace:
    return Trace(
        seed=header.get("seed"),
        world_size=int(header.get("world_size") or 0),
        workers=[str(w) for w in header.get("workers") or []],
        source=str(header.get("source", "simulator")),
        clock=str(header.get("clock", "virtual")),
    )


def _build(header: dict[str, Any], events: list[_Raw]) -> Trace:
    trace = _new(header)
    for t, w, e, d in events:
        trace.record(t, w, e, d)
    trace._sent = 1 + max((d[5] for _, _, e, d in events if e == "send" and d[5] is not None), default=-1)
    return trace


def _merge(parts: list[tuple[dict[str, Any], list[_Raw]]], where: Path) -> Trace:
    """Merge per-worker event lists (a recorded gloo run) into one trace in causal order.

    Sends and deliveries are paired by (src, dst, kind, id) in order of occurrence (a link delivers
    in order). The merge takes the earliest head event of any worker, except a delivery whose send
    was not taken yet; only if every head waits like that (its sender's file is missing) does it
    take one unpaired.
    """
    ranks = [h.get("rank") for h, _ in parts]
    if len(set(ranks)) != len(ranks):
        raise TraceFormatError(f"{where}: several files claim the same rank(s) {sorted(map(str, ranks))}")
    header = dict(parts[0][0])
    header["rank"] = None
    world_size = max(int(h.get("world_size") or 0) for h, _ in parts)
    header["world_size"] = world_size
    trace = _new(header)
    queues = [collections.deque(evs) for _, evs in parts]
    sent: dict[tuple[Any, ...], collections.deque[int]] = collections.defaultdict(collections.deque)
    merged: list[_Raw] = []
    number = 0

    def waiting(ev: _Raw) -> bool:
        _, _, e, d = ev
        return e == "deliver" and type(d) is tuple and not sent.get((d[2], d[3], d[0], d[1]))

    while True:
        heads = [(q[0][0], q[0][1], i) for i, q in enumerate(queues) if q]
        if not heads:
            break
        heapq.heapify(heads)
        pick = None
        while heads:
            _, _, i = heapq.heappop(heads)
            if not waiting(queues[i][0]):
                pick = i
                break
        if pick is None:  # every head is a delivery with no send (yet): take the earliest unpaired
            pick = min((q[0][0], q[0][1], i) for i, q in enumerate(queues) if q)[2]
        t, w, e, d = queues[pick].popleft()
        if type(d) is tuple:
            key = (d[2], d[3], d[0], d[1])
            if e == "send":
                sent[key].append(number)
                d = (*d[:5], number, d[6])
                number += 1
            elif e == "deliver":
                q = sent.get(key)
                d = (*d[:5], q.popleft() if q else None, d[6])
        merged.append((t, w, e, d))
    for t, w, e, d in merged:
        trace.record(t, w, e, d)
    trace._sent = number
    return trace
