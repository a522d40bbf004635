"""A link's send side: frames to the peer under one send lock, coalescing, and the outbox thread for
threads that must not block.

A frame is one header frame (small payloads and storages inline, riders at its end; see ``_framing``),
then a frame per larger payload or storage of its first message. Messages that wait for the same
peer travel together (*coalescing*, as a group commit does): whoever holds the send lock sends every
message queued meanwhile, the first one and then every whole message that fits, in one header frame;
a message that finds the lock free goes at once, alone. A gloo send completes only once the peer has
posted the matching receive; the receiver's credit (``Receiver.consumed`` and ``Receiver.peer_acked``)
tells when a header send cannot wait for the peer (try_send_now).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from twinrpc._future import CALLBACK_ROLE
from twinrpc._message import Kind, Message

from ._auth import DataMac, FrameAuth
from ._framing import (
    HEADER_BYTES,
    SIZES_AT,
    FrameEncoder,
    encode_close,
    fits_whole,
    new_header_tensor,
    pieces,
    ring_fits,
)
from ._link_state import LinkState, PeerShutDown
from ._liveness import MIN_FRAME_RATE, Liveness
from ._pair import DATA_TAG, LARGE_TAG, READY_TAG, TAG, Pair
from ._receiver import GO_AHEAD_BYTES, RECEIVERS, RING, STAGED_BYTES, Receiver
from ._riders import Rider, Riders, messages, report_failed

#: seconds an idle outbox thread waits before it exits (the next message that needs it starts
#: another): a link that needed its outbox once does not hold a thread for the rest of its life
_OUTBOX_IDLE_EXIT = 2.0

_log = logging.getLogger("twinrpc.impl")
_CLOSE_FLUSH = 10.0  # seconds to let the outbox drain before the close frame

OnError = Callable[[Message, BaseException], None]


class _Queued:
    """A message waiting for a frame. ``on_error`` None: the thread that queued it waits until it is
    sent (send) and raises ``error`` itself; else ``on_error(msg, exc)`` reports a failure."""

    __slots__ = ("done", "error", "msg", "on_error")

    def __init__(self, msg: Message, on_error: OnError | None) -> None:
        self.msg = msg
        self.on_error = on_error
        self.done = False
        self.error: BaseException | None = None


class Sender:
    """Sends one peer's messages, in order.

    Thread safety: ``lock`` (the send lock) is held while a frame goes out, and guards the header
    tensor, ``headers_sent`` and taking from ``_queue`` (any thread appends to it); whoever releases
    the lock looks at ``_queue`` again afterwards, so a message queued behind a frame is never left
    (see _lead). ``_outbox_lock`` only guards starting the outbox thread; ``_close_lock`` lets
    send_close run once. A failed frame fails the link through ``fail``, and every message in it
    and still queued with the link's error.
    """

    def __init__(
        self,
        state: LinkState,
        pair: Pair,
        liveness: Liveness,
        riders: Riders,
        receiver: Receiver,
        fail: Callable[[BaseException], None],
        auth: FrameAuth | None = None,
    ) -> None:
        """``auth``: the link's frame MACs with a job key (each header frame is sealed with its
        sequence number, ``headers_sent``); None: frames carry none."""
        self._state = state
        self._auth = auth
        self._pg = pair.pg
        self._dst = pair.peer_rank
        #: the same-host rings (``rings.out`` None: our data goes in data frames)
        self._rings = pair.rings
        #: our header frames go through our ring too (the same-host doorbell), for the link's whole life
        out = pair.rings.out
        self._headers_in_ring = out is not None and out.bell is not None
        self._live = liveness
        self._send_timeout = liveness.send_timeout
        self._riders = riders
        self._receiver = receiver
        self._fail = fail
        #: the send lock: held by whoever writes frames to the peer (a test injecting raw frames too)
        self.lock = threading.Lock()
        self._header, self._view = new_header_tensor()
        self._encoder = FrameEncoder(self._view)
        #: messages waiting for a frame, in order (appended by any thread, taken under the send lock)
        self._queue: collections.deque[_Queued] = collections.deque()
        #: header frames we have sent (under the send lock); see Receiver.peer_acked
        self.headers_sent = 0
        #: messages sent in those frames (riders not counted): messages / headers_sent is the coalescing
        self.messages_sent = 0
        self._defer_callbacks: Callable[[Callable[[], None]], None] | None = None
        #: wake-ups of the outbox thread (None: exit once what is queued is sent)
        self._outbox: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self._outbox_thread: threading.Thread | None = None
        self._outbox_lock = threading.Lock()
        #: our close frames went (or are going): send_close runs once
        self._close_started = False
        #: nothing more goes to the peer (close frames sent, or the link ends at exit): what is still
        #: queued, or queued later, fails at once (under the send lock, see _send_queued)
        self._closed = False
        #: while closing, no wait for the peer lasts past this (monotonic; see send_close)
        self._deadline: float | None = None
        self._close_lock = threading.Lock()

    def start(self, defer_callbacks: Callable[[Callable[[], None]], None] | None) -> None:
        """``defer_callbacks``: where the outbox thread hands the user callbacks of futures it fails
        (see PeerLink.start)."""
        self._defer_callbacks = defer_callbacks

    def send(self, msg: Message, on_error: OnError | None = None) -> None:
        """Send one message (in a frame with whatever else waits for the peer); returns once it is
        sent. Raises on a broken link. With ``on_error``, a whole message (see fits_whole) that finds
        a frame being sent returns at once instead: it rides the next frame (its tensors copied), and
        ``on_error(msg, exc)`` reports if that frame fails."""
        state = self._state
        if state.failed is not None:
            raise state.failed
        if state.closed_by_peer:
            raise PeerShutDown(state.peer_graceful)
        lock = self.lock
        if on_error is not None and lock.locked() and fits_whole(msg):
            self._ride(msg, on_error)
            return
        entry = _Queued(msg, None)
        self._queue.append(entry)
        lock.acquire()
        if entry.done:  # a frame of the thread that held the lock took it
            self._lead_after(blocking=True, sent=False)
        else:
            self._lead(blocking=True)
        if entry.error is not None:
            raise entry.error

    def try_send_now(self, msg: Message, on_error: OnError | None = None) -> bool:
        """Send ``msg`` now if that cannot make this thread wait for the peer's receiver: it travels
        whole in a header frame, the send lock is free and the peer has a header receive posted that
        none of our headers has used (see ``Receiver.peer_acked``). With ``on_error``, a whole message
        that finds the lock taken rides the next frame instead (see send). For threads that must not
        block (receivers, the timer): replying this way saves handing the receiver role to another
        thread. Returns False (nothing sent or queued) otherwise; raises as send() does."""
        state = self._state
        if state.failed is not None or state.closed_by_peer or not self._needs_no_data_frame(msg):
            return False  # the ordinary path reports a broken link
        lock = self.lock
        if not lock.acquire(blocking=False):
            if on_error is None:
                return False
            self._ride(msg, on_error)
            return True
        if state.failed is not None or not self._has_credit() or (self._queue and on_error is None):
            self._lead_after(blocking=False, sent=False)  # messages queued meanwhile count on us
            return False
        # first in the queue, it goes now; behind others it may be left for the next frame
        entry = _Queued(msg if not self._queue else _detached(msg), on_error)
        self._queue.append(entry)
        self._lead(blocking=False)
        if on_error is None and not entry.done:  # cannot happen: it was first, whole, with credit
            raise RuntimeError("twinrpc: a message sent now was left queued")
        if entry.error is not None and on_error is None:
            raise entry.error
        return True

    def defer(self, msg: Message, on_error: OnError) -> bool:
        """Let a deferrable message ride in the next header frame (Riders.defer); False: send it as
        usual. Not while messages are queued: riders go at the front of a frame, before them."""
        return not self._queue and self._riders.defer(msg, on_error)

    def _ride(self, msg: Message, on_error: OnError) -> None:
        """Queue ``msg`` for the next frame (the lock's holder sends it, see _lead)."""
        self._queue.append(_Queued(_detached(msg), on_error))
        if self.lock.acquire(blocking=False):  # the holder left meanwhile: lead ourselves
            self._lead(blocking=False)

    def _lead(self, blocking: bool) -> None:
        """With the send lock held: send what is queued, release the lock, then see to what was queued
        meanwhile (_lead_after). ``blocking``: this thread may wait for the peer (else it sends only
        whole messages, one frame per credit, and leaves the rest to the outbox thread)."""
        try:
            failed = self._send_queued(blocking)
        except BaseException:
            self.lock.release()
            raise
        self._lead_after(blocking, True, failed)

    def _lead_after(
        self, blocking: bool, sent: bool, failed: list[tuple[_Queued, BaseException]] | None = None
    ) -> None:
        """Release the send lock, report failed messages, post receives again (the receiver's
        business after a send), and send what was queued while the lock was held: a message queued
        behind a frame found the lock taken and counts on the holder to send it."""
        while True:
            self.lock.release()
            for entry, error in failed or ():
                _report(entry, error)
            if sent:
                self._receiver.repost_after_send()
            if not self._queue:
                return
            if not self.lock.acquire(blocking=False):
                return  # its holder sends them
            if not (blocking or self._can_send_now() or self._closed or self._state.failed is not None):
                self.lock.release()
                self._kick()  # they need a thread that may wait: the outbox's
                return
            failed = self._send_queued(blocking)
            sent = True

    def _can_send_now(self) -> bool:
        """Whether the next frame can go without waiting (under the send lock)."""
        q = self._queue
        return (
            bool(q)
            and self._needs_no_data_frame(q[0].msg)
            and self._has_credit()
            and self._state.failed is None
        )

    def _has_credit(self) -> bool:
        """Whether a header frame would go now without waiting for the peer: a free header slot in our
        ring, or over gloo a header receive the peer has posted that none of our headers has used."""
        if self._headers_in_ring:
            out = self._rings.out
            return out is not None and out.header_room()
        return self.headers_sent - self._receiver.peer_acked < RING - 1

    def _send_header(self) -> None:
        """Send the header frame (under the send lock): into our ring's next slot, ringing the peer if
        it sleeps, or over gloo."""
        if not self._headers_in_ring:
            self._wait_sent(self._pg.send([self._header], self._dst, TAG), HEADER_BYTES)
            return
        self._put_header(self._view)

    def _put_header(self, frame: memoryview) -> None:
        """Put ``frame`` in our ring's next header slot, once there is one (see _wait_room)."""
        out = self._rings.out
        if out is None or not out.header_room():
            error = self._wait_room()
            if error is not None:
                raise error
            out = self._rings.out
            assert out is not None
        out.put_header(frame)

    def _wait_room(self) -> BaseException | None:
        """Wait for a free header slot (the peer's reader is a whole window behind), recording the wait
        for the liveness check as a gloo send does; returns the error (the link failed with it) when
        the peer has gone, the link failed meanwhile or the wait passed the send's bound."""
        live = self._live
        since = time.monotonic()
        live.sending = (since, HEADER_BYTES / MIN_FRAME_RATE)
        timeout = self._send_timeout
        if self._deadline is not None:
            left = max(1.0, self._deadline - since)
            timeout = left if timeout is None else min(timeout, left)
        error: BaseException | None = None
        try:
            self._wait_for_slot(timeout)
        except RuntimeError as exc:  # a fresh error: a traceback through here would keep the ring mapped
            error = type(exc)(str(exc))
            self._fail(error)  # while sending is still set: see Liveness.overdue_send
        finally:
            live.sending = None
        return error

    def _wait_for_slot(self, timeout: float | None) -> None:
        state = self._state
        out = self._rings.out
        if out is None:
            raise RuntimeError("the link has ended")
        assert out.bell is not None
        out.bell.wait_room(out.header_room, lambda: state.failed is not None, timeout)

    def send_raw_header(self, frame: torch.Tensor) -> None:
        """Send ``frame`` (``HEADER_BYTES``, as it is: not counted, not sealed) as the next header
        frame, the way this link's header frames travel; under the send lock. For tests that inject
        malformed frames."""
        if not self._headers_in_ring:
            self._pg.send([frame], self._dst, TAG).wait()
            return
        # a shorter frame arrives zero-filled, as over gloo (whose receiver clears each header buffer)
        slot = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        n = min(frame.numel(), HEADER_BYTES)
        slot[:n] = frame[:n]
        self._put_header(memoryview(slot.numpy()))  # type: ignore[arg-type]

    def _needs_no_data_frame(self, msg: Message) -> bool:
        """Whether ``msg`` goes in its header frame alone: whole inside it, or with its data in the
        same-host ring (which has room for it now; only the send lock's holder takes room)."""
        if fits_whole(msg):
            return True
        ring = self._rings.out
        return ring is not None and ring_fits(msg, ring)

    def _send_queued(self, blocking: bool) -> list[tuple[_Queued, BaseException]]:
        """Send what is queued, a frame at a time (under the send lock); ``blocking`` False: only
        frames that cannot wait for the peer. Returns the failed messages whose senders are still
        to be told (outside the lock: a report may run a callback that sends)."""
        q, state, receiver, enc = self._queue, self._state, self._receiver, self._encoder
        failed: list[tuple[_Queued, BaseException]] = []
        while q:
            if state.failed is not None or self._closed:
                error = state.failed or self._closed_error()
                while q:
                    failed.append((q.popleft(), error))
                break
            if not blocking and not self._can_send_now():
                break
            first = q[0]
            riders = self._riders.take()
            try:
                inline, inline_tensors = enc.first(
                    first.msg, receiver.consumed, messages(riders), self._rings.out
                )
            except Exception as exc:  # it cannot be framed (too many storages): it alone fails
                self._riders.give_back(riders)
                failed.append((q.popleft(), exc))
                continue
            batch = [q.popleft()]
            while q and enc.add(q[0].msg):
                batch.append(q.popleft())
            seq = self.headers_sent
            self.headers_sent = seq + 1
            mac = None
            if self._auth is not None:
                mac = self._auth.seal(
                    self._view, seq, enc.used, first.msg.payload, first.msg.tensors, GO_AHEAD_BYTES
                )
            try:
                # the go-aheads for the message's large frames: posted before the header, so the
                # receiver's go-ahead never waits for us (a receiver thread must not block in a send)
                readies = self._post_readies(first.msg, inline, inline_tensors)
                self._send_header()
                if not inline or not inline_tensors:
                    self._send_data(first.msg, inline, inline_tensors, readies, mac)
            except RuntimeError as exc:
                error = self._frame_failed(exc, riders)
                failed += [(entry, error) for entry in batch]
                while q:
                    failed.append((q.popleft(), error))
                break
            self.messages_sent += len(batch)
            for entry in batch:
                entry.done = True
        for entry, error in failed:
            entry.done = True
            entry.error = error
        return [f for f in failed if f[0].on_error is not None]

    def _post_readies(
        self, msg: Message, inline: bool, inline_tensors: bool
    ) -> list[tuple[torch.Tensor, Any]]:
        """Post a receive for the peer's go-ahead of each of the message's frames over GO_AHEAD_BYTES
        (see ``READY_TAG``), in order; their buffers are kept with their work."""
        if inline and inline_tensors:
            return []
        sizes = [] if inline else [len(msg.payload)]
        if not inline_tensors:
            sizes += [t.numel() for t in msg.tensors]
        readies = []
        for n in sizes:
            if n > GO_AHEAD_BYTES:
                buf = torch.empty(1, dtype=torch.uint8)
                readies.append((buf, self._pg.recv([buf], self._dst, READY_TAG)))
        return readies

    def _send_data(
        self,
        msg: Message,
        inline: bool,
        inline_tensors: bool,
        readies: list[tuple[torch.Tensor, Any]],
        mac: DataMac | None = None,
    ) -> None:
        """The data frames of a frame's first message: its payload unless inline, then its storages. A
        large frame goes once the peer has posted its receive (its go-ahead, see ``GO_AHEAD_BYTES``).
        With ``mac`` (sealed tag after, see ``_framing.FLAG_TAG_AFTER``) each frame is hashed while it
        is sent, and the data tag follows the last one."""
        go = iter(readies)
        if not inline:
            payload = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8)
            self._send_frame(payload, len(msg.payload), go, mac)
        if not inline_tensors:
            for t in msg.tensors:
                n = t.numel()
                if n:
                    self._send_frame(t, n, go, mac)
        if mac is not None:
            tag = torch.frombuffer(bytearray(mac.finalize()), dtype=torch.uint8)
            self._wait_sent(self._pg.send([tag], self._dst, DATA_TAG), len(tag))

    def _send_frame(self, t: torch.Tensor, n: int, go: Any, mac: DataMac | None = None) -> None:
        """One data frame of ``n`` bytes; over GO_AHEAD_BYTES after its go-ahead (the next of ``go``).
        With ``mac``: fed the frame while gloo sends it (a large frame in pieces, see ``pieces``)."""
        if n > GO_AHEAD_BYTES:
            self._wait_sent(next(go)[1], n)  # the peer allocates and posts first: as slow as the frame
        tag = DATA_TAG if n <= STAGED_BYTES else LARGE_TAG
        if mac is None:
            self._wait_sent(self._pg.send([t], self._dst, tag), n)
            return
        spans = pieces(n) if n > GO_AHEAD_BYTES else [(0, n)]
        works = [(self._pg.send([t[a:b]], self._dst, tag), b - a) for a, b in spans]
        mac.update(t)  # while gloo's threads send it (the GIL is free between chunks)
        for work, nbytes in works:
            self._wait_sent(work, nbytes)

    def _frame_failed(self, exc: RuntimeError, riders: list[Rider]) -> BaseException:
        """A frame of ours failed in gloo: fail the link (unless it had failed already) and report the
        riders it carried; returns the link's error (the one its messages fail with)."""
        state = self._state
        if state.failed is None:
            self._fail(exc)
        error = state.failed or exc
        report_failed(riders, error)
        return error

    def _wait_sent(self, work: Any, nbytes: int) -> None:
        """Wait until the peer has taken one frame of ours, recording the wait for the liveness check."""
        live = self._live
        allowance = nbytes / MIN_FRAME_RATE
        since = time.monotonic()
        live.sending = (since, allowance)
        timeout = None if self._send_timeout is None else self._send_timeout + allowance
        if self._deadline is not None:  # closing: bounded whatever the link's own bound
            left = max(1.0, self._deadline - since)
            timeout = left if timeout is None else min(timeout, left)
        try:
            if timeout is None:
                work.wait()
                return
            try:
                work.wait(timedelta(seconds=timeout))
            except RuntimeError as exc:
                self._fail(exc)  # while sending is still set: see Liveness.overdue_send
                raise
        finally:
            live.sending = None

    def enqueue(self, msg: Message, on_error: OnError) -> None:
        """Queue ``msg`` without sending it: the next frame takes it, in order, before anything queued
        later (``flush``, or whoever sends next)."""
        self._queue.append(_Queued(msg, on_error))

    def flush(self) -> None:
        """Send what is queued from this thread, which may wait for the peer (not a receiver's)."""
        if self._queue:
            self.lock.acquire()
            self._lead(blocking=True)

    # -- the outbox --------------------------------------------------------------------------------
    def send_later(self, msg: Message, on_error: OnError) -> None:
        """Send from the link's outbox thread (for threads that must not block, see THREAD_ROLE)."""
        self._queue.append(_Queued(msg, on_error))
        self._kick()

    def _kick(self) -> None:
        """Wake the outbox thread (started on first use) to send what is queued; once the link is
        closed, fail it here instead."""
        if self._closed:
            if self.lock.acquire(blocking=False):
                self._lead(blocking=False)
            return
        # Not under the send lock: the timer queues heartbeats here and must never wait for a send
        # that is stuck on a stopped peer (it is the thread that judges that peer). Under the outbox
        # lock, so an outbox thread leaving for idleness (see _OUTBOX_IDLE_EXIT) never misses a kick.
        with self._outbox_lock:
            if self._outbox_thread is None:
                self._outbox_thread = threading.Thread(
                    target=self._outbox_loop, name=f"twinrpc-send-{self._state.peer}", daemon=True
                )
                self._outbox_thread.start()
            self._outbox.put(True)

    def _outbox_loop(self) -> None:
        CALLBACK_ROLE.defer = self._defer_callbacks  # a failed send fails its call's future here
        while True:
            try:
                item = self._outbox.get(timeout=_OUTBOX_IDLE_EXIT)
            except queue.Empty:
                with self._outbox_lock:
                    if self._outbox.empty() and not self._queue:
                        self._outbox_thread = None  # the next kick starts another
                        return
                continue
            if self._queue:
                self.lock.acquire()
                self._lead(blocking=True)  # fails what is queued at once once the link failed
            if item is None:
                return

    def stop_outbox(self) -> None:
        """The link ends at once (a process exiting without shutdown): let the outbox thread end,
        failing what is still queued."""
        self._closed = True
        with self._outbox_lock:
            if self._outbox_thread is not None:
                self._outbox.put(None)

    def outbox_done(self) -> bool:
        """Whether no outbox thread is running (none was started, or it exited)."""
        outbox = self._outbox_thread
        return outbox is None or not outbox.is_alive()

    def threads(self) -> list[threading.Thread]:
        """The sender's own thread (the outbox), if started."""
        return [] if self._outbox_thread is None else [self._outbox_thread]

    def release(self) -> None:
        """Let go of the pair's process group (the link has ended and its threads have exited; see
        Pair.release)."""
        self._pg = None

    # -- heartbeats --------------------------------------------------------------------------------
    def send_heartbeat(self) -> None:
        """Send one heartbeat frame if that cannot block, else queue it on the outbox (never blocks);
        skipped while the outbox is busy, since whatever it is sending tells the peer we are alive
        just as well."""
        state = self._state
        if state.failed is not None or state.closing or state.closed_by_peer or self._queue:
            return
        self.send_beat()

    def send_beat(self) -> None:
        """A heartbeat frame (with any riders waiting) now if that cannot block, else on the outbox."""
        state = self._state
        if state.failed is not None or state.closed_by_peer or state.closing:
            return  # closing: send_close takes the riders
        beat = Message(Kind.HEARTBEAT, 0, state.me, state.peer, b"")
        try:
            if self.try_send_now(beat):  # usually: no outbox thread to wake
                return
        except Exception:
            return  # the link failed (riders were reported): nothing to report for a heartbeat
        self.send_later(beat, _ignore_heartbeat_error)

    # -- closing -----------------------------------------------------------------------------------
    def send_close(self, graceful: bool = False, deadline: float | None = None) -> None:
        """Tell the peer's receiver for us to stop, after anything still queued. ``graceful``: we
        completed graceful shutdown, so the peer must not treat our departure as a failure.
        Waits until ``deadline`` (monotonic; default ``_CLOSE_FLUSH`` from now) at most, but gives the
        close frame itself at least 1 s; a stopped peer leaves it unsent (abandon() cleans up)."""
        with self._close_lock:
            if self._close_started:
                return
            self._close_started = True
        state = self._state
        if deadline is None:
            deadline = time.monotonic() + _CLOSE_FLUSH
        self._deadline = deadline
        if self._queue:
            self._kick()  # what is still queued goes first, from the outbox (a bounded wait here)
        with self._outbox_lock:
            outbox = self._outbox_thread
            if outbox is not None:
                self._outbox.put(None)  # it ends after what is queued (or at once if failed)
        if outbox is not None and state.failed is None:
            # at least a moment: an idle outbox exits within milliseconds
            outbox.join(max(0.5, deadline - time.monotonic()))
        stuck = outbox is not None and outbox.is_alive()
        # a dead peer reads nothing; a stuck outbox holds the send lock (it fails what is queued
        # once its send ends: at the deadline, or when abandon() wakes it)
        if (
            state.failed is not None
            or stuck
            or not self.lock.acquire(timeout=max(1.0, deadline - time.monotonic()))
        ):
            self._closed = True
            self._kick()
            return
        failed = self._send_queued(blocking=True)  # queued after the outbox left
        riders = self._riders.take()
        try:
            if state.failed is None:
                if riders:  # in a heartbeat frame of their own, before the close frames
                    beat = Message(Kind.HEARTBEAT, 0, state.me, state.peer, b"")
                    self._encoder.first(beat, self._receiver.consumed, messages(riders))
                    self._seal_next(self._encoder.used)
                    self._send_closing_header(deadline)
                    riders = []
                encode_close(self._view, state.me, graceful)
                for _ in range(RECEIVERS):  # one for each of the peer's receivers (each ends one)
                    self._seal_next(SIZES_AT)
                    self._send_closing_header(deadline)
        except RuntimeError as exc:
            _log.debug("twinrpc: close frame to %d failed: %s", state.peer, exc)
            report_failed(riders, exc)
        finally:
            self._closed = True
            failed += self._send_queued(blocking=False)  # anything queued meanwhile fails now
            self._lead_after(blocking=False, sent=False, failed=failed)

    def _send_closing_header(self, deadline: float) -> None:
        """A header frame of send_close: waits until ``deadline`` at most (but at least 1 s)."""
        if self._headers_in_ring:
            self._send_header()  # bounded by the close deadline (_wait_room)
            return
        work = self._pg.send([self._header], self._dst, TAG)
        work.wait(timedelta(seconds=max(1.0, deadline - time.monotonic())))

    def _seal_next(self, used: int) -> None:
        """Count the header frame about to go (with a key, seal it with its sequence number)."""
        seq = self.headers_sent
        self.headers_sent = seq + 1
        if self._auth is not None:
            self._auth.seal(self._view, seq, used, b"")

    def _closed_error(self) -> BaseException:
        return RuntimeError(
            f"the link to {self._state.peer_name} was closed (this worker is shutting down) before "
            "the message could be sent"
        )


def _ignore_heartbeat_error(msg: Message, exc: BaseException) -> None:
    """A heartbeat that cannot be sent needs no report: the failed send broke the link already."""


def _detached(msg: Message) -> Message:
    """``msg`` with its storages copied: it waits for a frame after its sender has returned (and may
    change the tensors); a whole message's storages are small."""
    if not msg.tensors:
        return msg
    return Message(msg.kind, msg.id, msg.src, msg.dst, msg.payload, [t.clone() for t in msg.tensors])


def _report(entry: _Queued, exc: BaseException) -> None:
    """Tell a queued message's sender that its frame failed with ``exc``."""
    assert entry.on_error is not None
    try:
        entry.on_error(entry.msg, exc)
    except Exception:
        _log.exception("twinrpc: reporting a failed %s failed", entry.msg.describe())
