"""A link's receive side: the ring of header receives posted ahead, the staging buffer for data
frames, and the receive loop whose threads decode and dispatch the peer's messages in order.

gloo is message-based: each posted receive gets exactly one send's frame, and receives of one tag on
a pair are matched in the order they were posted. The receiver keeps ``RING`` header receives posted
(with an explicit source, which gloo serves much faster than any-source) so that the peer's header
sends complete without waiting for this process, and one staging receive for data frames up to
``STAGED_BYTES``. It posts them again off the critical path (see Receiver._repost), and tells the
sender (through ``consumed`` and ``peer_acked``) how many header receives each side has posted again.

On one host the peer's header frames come through its ring instead, and one thread of the link at a
time sleeps on the link's doorbell (the *door*); an idle link parks the doorbell with the process's
watcher. A thread blocking on a reply from the peer joins the loop as that thread until its future
is done (``Receiver.receive_until``): the reply then wakes only the thread that wants it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from _thread import allocate_lock
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from twinrpc._future import CALLBACK_ROLE, Future, add_waiter
from twinrpc._message import Kind, Message

from . import _framing
from ._auth import AuthenticationError, DataMac, FrameAuth, sent_apart
from ._door_watch import DOOR_WATCH
from ._framing import (
    TAG_BYTES,
    FrameError,
    FrameTooLarge,
    Header,
    Record,
    check_announced,
    new_header_tensor,
    pieces,
)
from ._interrupt_shield import InterruptShield
from ._link_state import LinkState
from ._liveness import MIN_FRAME_RATE, Liveness
from ._pair import DATA_TAG, LARGE_TAG, READY_TAG, TAG, Pair
from ._recv_buffers import RECV_BUFFERS
from ._riders import Riders
from ._same_host import InRing

_log = logging.getLogger("twinrpc.impl")
#: data frames up to this size land in a receive posted ahead of time (the staging buffer), so the
#: sender writes them right behind their header instead of waiting until the receiving process has
#: woken up, decoded the header and posted a receive (a notify round trip plus a Python wake-up per
#: frame); they are copied out of it. Larger frames are received in place into their own buffer.
STAGED_BYTES = 1 << 20
#: data frames over this size wait for the receiver's go-ahead (``READY_TAG``): the receiver posts their
#: receive first, so gloo does not take them into a buffer of its own and copy them again; below it
#: the go-ahead's round trip costs more than it saves (the figures: docs/explanation/benchmarks.md)
GO_AHEAD_BYTES = 4 << 20
#: header receives kept posted ahead: a gloo send waits until the peer has posted the matching
#: receive, so with one posted header a stream of messages pays a notify round trip per message
RING = 16
#: header slots a receiver lets wait for this worker's next send before it posts their receives
#: again itself (see Receiver._repost): one is the usual backlog of a request and its reply; two mean
#: messages arrive faster than this worker sends (many calls in flight), and a sender that posts
#: receives for every reply would be the bottleneck (4 here was measurably slower:
#: docs/explanation/benchmarks.md)
_REPOST_BATCH = 2
#: the most threads per link in the receive loop: while one handles a message, another is already
#: blocked in gloo on the next header, so a receiver that goes off to run a request (or to make a
#: blocking send) wakes nobody; it rejoins when done. Messages are still dispatched one at a time, in
#: order. The peer sends one close frame for each (each ends one). A link keeps its second receiver
#: only while it hands requests off (see LINGER): an idle link holds one thread.
RECEIVERS = 2
#: seconds a link keeps its second receiver after its last hand-off: a receiver done with a message
#: while another already waits in gloo for the next one leaves the loop (back to the pool) unless the
#: link handed a message off this recently. gloo offers no way to wait for many receives with one
#: thread (its receive Work has no future, and a receive waited on with a timeout closes the pair),
#: so a receiver, once waiting in gloo, leaves only with a frame: an idle link's next frame (at the
#: latest its peer's heartbeat) retires its second receiver.
#: On one host (header frames through the peer's ring), a link whose last receiver has had nothing
#: to do for LINGER since its last message (heartbeats aside) *parks*: its doorbell goes to the
#: process's watcher (impl/_door_watch.py) and the receiver leaves, so an idle link holds no thread.
LINGER = 1.0
#: links on one host with a receiver (not parked) beyond which a link parks PARK_SOON after its last
#: message, not LINGER: after a burst of calls to many peers, the process soon holds few receivers
#: (see docs/explanation/gloo-world.md)
PARK_CAP = 8
#: seconds without a message after which a link parks while more than PARK_CAP links are awake. Not
#: at once: a link busy with messages every few milliseconds stays awake, rather than paying the
#: watcher's wake-up (a thread hop and four epoll changes) for each; a link that waits longer for its
#: next message pays that wake-up once per wait, a small part of it
PARK_SOON = 0.02


class _ThreadRole(threading.local):
    #: True on threads that must never block in a gloo send: receivers (a peer's receiver may be
    #: sending to us at the same moment, and gloo sends wait for the matching receive) and the timer.
    no_blocking_send = False
    #: the link Receiver this thread receives for (None: not a receiver); see Receiver.hand_off
    link: Any = None
    #: this thread is a caller receiving its own reply (Receiver.receive_until): it never hands
    #: its role off (it returns to its caller once its future is done)
    guest = False


THREAD_ROLE = _ThreadRole()


class _Retired:
    """What _next_header returns to a receiver that leaves the loop while another serves it, or
    that parked the link (see LINGER)."""


_RETIRED = _Retired()


class _Idle:
    """What _take_slot returns when no header came by the time the link may park (see LINGER)."""


_IDLE = _Idle()


class Receiver:
    """Receives one peer's messages, in order, and hands each to ``on_message``.

    Thread safety: ``_post_lock`` keeps the posts of receives in slot order (ring, staging buffer,
    ``_repost_queue``, ``consumed``); ``_rx_lock`` guards which receiver thread waits on or
    dispatches which slot. A failure is reported through ``fail`` (the link's), the peer's close
    frame through ``peer_closed``.
    """

    def __init__(
        self,
        state: LinkState,
        pair: Pair,
        liveness: Liveness,
        riders: Riders,
        on_message: Callable[[Message], None],
        fail: Callable[[BaseException], None],
        peer_closed: Callable[[], None],
        auth: FrameAuth | None = None,
    ) -> None:
        """``auth``: the link's frame MACs with a job key (every frame is checked before it is decoded
        or handed on; the ``n``-th header frame must carry sequence number ``n``); None: none."""
        self._state = state
        self._auth = auth
        self._pg = pair.pg
        self._src = pair.peer_rank
        #: the same-host rings (``rings.inbound`` None: the peer's data comes in data frames)
        self._rings = pair.rings
        #: the peer's header frames come through its ring too (the same-host doorbell), for the link's
        #: whole life: no header receive is ever posted, and data frames' only on demand
        inbound = pair.rings.inbound
        self._headers_in_ring = inbound is not None and inbound.door is not None
        #: held by the one receiver thread that waits on the doorbell (claims, takes and frees
        #: header slots in order)
        self._door_lock = threading.Lock()
        #: receivers queued for the door lock (under _rx_lock): one of them may leave (see LINGER)
        self._at_door = 0
        self._live = liveness
        self._riders = riders
        self._on_message = on_message
        self._fail = fail
        self._peer_closed = peer_closed
        #: the most bytes one message from the peer may announce (checked before allocating them)
        self._max_message_bytes = _framing.MAX_MESSAGE_BYTES
        self._ring = [new_header_tensor() for _ in range(RING)]
        self._ring_works: list[Any] = []
        #: the staging buffer for data frames up to STAGED_BYTES, with its posted receive
        self._staging = torch.empty(STAGED_BYTES, dtype=torch.uint8)
        #: the one byte of a go-ahead for a large frame (see READY_TAG)
        self._go_ahead = torch.zeros(1, dtype=torch.uint8)
        #: the staging buffer's posted receive (None: its last frame was taken, not posted again yet)
        self._staging_work: Any = None
        #: ring slots whose header frame was taken and whose receive is not posted again yet, in
        #: slot order (see _repost); under _post_lock, which keeps the posts in that order
        self._repost_queue: collections.deque[int] = collections.deque()
        self._post_lock = threading.Lock()
        # -- the receive loop's threads (see RECEIVERS), under _rx_lock ---------------------------
        self._rx_lock = threading.Lock()
        #: next header slot (absolute index; ring buffer slot % RING) a receiver thread waits on
        self._claimed = 0
        #: next header slot to dispatch (decode, receive its data frames, deliver): in order
        self._turn = 0
        #: a receiver is dispatching slot _turn
        self._busy = False
        #: slots whose frame has arrived, not yet dispatched (their receiver parked as a spare)
        self._ready: set[int] = set()
        #: slots a receiver waits on in gloo
        self._native: set[int] = set()
        #: locks of parked spare receivers (woken only when no receiver waits for slot _turn)
        self._spares: list[Any] = []
        #: threads in the receive loop (THREAD_ROLE.link is this receiver)
        self._receivers = 0
        #: receiving has ended for good (close frame, IO error): receivers leave, none rejoin
        self._ended = False
        #: when a receiver last handed its role off (monotonic; see LINGER)
        self._handed_off_at = float("-inf")
        #: when the link last had a message (not a heartbeat) or a hand-off (monotonic; see LINGER)
        self._active_at = float("-inf")
        #: the link's doorbell is with the watcher (no receiver; see LINGER and _idle)
        self._parked = False
        #: counted in DOOR_WATCH.awake (a doorbell link receiving, not parked, not ended)
        self._awake = False
        # -- credit, read by the sender: header receives each side has posted again ---------------
        #: header frames we have taken from our ring and posted a receive again for (under
        #: _post_lock); every header we send carries it as ``ack``
        self.consumed = 0
        #: the peer's latest ``ack``: it has re-posted a receive for that many of our headers, and
        #: gloo has learnt of those receives before the header carrying the ack reached us (same
        #: connection, in order); so ``headers_sent - peer_acked < RING`` means a header send
        #: completes without the peer's receiver doing anything
        self.peer_acked = 0
        #: malformed frames rejected so far (each logged, naming the peer)
        self.bad_frames = 0
        #: messages of the frame being dispatched still to come after the current one (written and
        #: read by the dispatching thread): it must not hand its role off before they are dispatched
        self._frame_left = 0
        # -- a caller receiving its own reply (see receive_until), under _rx_lock -----------------
        #: the thread (``threading.get_ident``) receiving now as a caller; None: none
        self._guest: int | None = None
        #: the future that caller waits for (it leaves once that is done)
        self._guest_fut: Future[Any] | None = None
        #: its Ctrl-C shield (main thread only, see impl/_interrupt_shield.py)
        self._shield: InterruptShield | None = None
        #: a caller waits for the door: the receiver sleeping there leaves the loop (see _idle)
        self._knock = False
        #: when the link last dispatched a message other than a reply (monotonic): a caller does not
        #: push aside the receiver of a link that serves requests (see receive_until)
        self._request_at = float("-inf")
        #: the watcher's handle of the parked doorbell, and which parking it is (a wake-up of an
        #: earlier one, taken back by a caller meanwhile, is ignored: see _unpark)
        self._park_handle: object = None
        self._park_gen = 0
        self._thread = threading.Thread(
            target=self._receive_loop, name=f"twinrpc-recv-{state.peer}", daemon=True
        )
        self._receive_done = threading.Event()
        self._run_elsewhere: Callable[[Callable[[], None]], None] | None = None
        self._defer_callbacks: Callable[[Callable[[], None]], None] | None = None

    def start(
        self,
        run_elsewhere: Callable[[Callable[[], None]], None] | None,
        defer_callbacks: Callable[[Callable[[], None]], None] | None,
    ) -> None:
        """Start receiving (see PeerLink.start). A link whose header frames come through the peer's
        ring starts parked (see LINGER): the peer's first frame starts a receiver, or a caller takes
        the doorbell back for its reply (receive_until), so a burst of new links holds no thread per
        link until each has idled out."""
        self._run_elsewhere = run_elsewhere
        self._defer_callbacks = defer_callbacks
        self._active_at = time.monotonic()
        ring = self._rings.inbound
        if self._headers_in_ring and run_elsewhere is not None:
            assert ring is not None
            with self._rx_lock:
                if ring.arm(0):
                    self._park(ring, 0)
                    return
        self._receivers = 1
        if self._headers_in_ring:
            self._awake = True
            DOOR_WATCH.counted_awake(1)
        self._thread.start()

    def hand_off(self) -> bool:
        """Called on this link's receiver thread, while it handles a message (all of whose frames it
        has received): the next message may be dispatched at once, by the receiver already waiting
        for it (a new one is started only if none is left), and this thread becomes an ordinary
        thread that may block, run a request or send; it rejoins the receive loop when done. Returns
        False (nothing changed) where that cannot be done: before a frame's last message (the rest
        of the frame is this thread's to dispatch, in order)."""
        if (
            THREAD_ROLE.link is not self
            or self._run_elsewhere is None
            or self._riders.delivering
            or self._frame_left
            or THREAD_ROLE.guest
        ):
            return False
        THREAD_ROLE.link = None
        THREAD_ROLE.no_blocking_send = False
        CALLBACK_ROLE.defer = None
        self._handed_off_at = self._active_at = time.monotonic()
        with self._rx_lock:
            self._receivers -= 1
            self._turn += 1
            self._busy = False
            spare, start = None, False
            if not self._ended and (self._turn in self._ready or self._turn not in self._native):
                # nobody waits for the next slot (or its frame is here already): wake a spare, or
                # start a receiver if there is none
                if self._spares:
                    spare = self._spares.pop()
                elif not self._parks_on_hand_off():
                    start = True
                    self._receivers += 1
        if spare is not None:
            spare.release()
        if start:
            self._run_elsewhere(self._receive_more)
        return True

    def _parks_on_hand_off(self) -> bool:
        """Under _rx_lock, in hand_off with no receiver left: park the link (see LINGER) rather than
        start a receiver, while more than PARK_CAP links are awake (a burst of calls from many peers:
        a receiver per link and hand-off would hold a thread each until they idle out). False: a
        receiver must start (the link does not park, or the next frame is here already)."""
        ring = self._rings.inbound
        if (
            not self._headers_in_ring
            or self._receivers
            or self._turn in self._ready
            or self._claimed != self._turn
            or DOOR_WATCH.awake <= PARK_CAP
        ):
            return False
        assert ring is not None
        if not ring.arm(self._claimed):
            return False
        self._park(ring, self._claimed)
        return True

    def receive_until(self, fut: Future[Any]) -> None:
        """Called by a thread about to block on ``fut``, which a reply from this peer completes: let
        it receive that reply itself, so that one wake-up (this thread's, by the peer's doorbell)
        brings it, not two (a receiver's, then this thread's). Returns once ``fut`` is done, or at
        once where that cannot be done (the caller then waits for ``fut`` as usual).

        The caller joins the receive loop as a receiver that never hands its role off: it takes the
        doorbell back from the watcher if the link is parked, or, if a receiver sleeps at the door
        of a link that serves no requests lately (see LINGER), knocks (that receiver wakes and
        leaves the loop, see _idle); it then sleeps on the doorbell and dispatches, in order,
        whatever arrives until its reply has (requests go to the pool as from any receiver). It
        leaves at a frame's end once ``fut`` is done (completed by itself, or elsewhere: a time-out,
        the link's failure; its completion then nudges the doorbell), handing the link to the
        receivers still in the loop, or parking it. On the main thread, Ctrl-C cuts short only its
        waits; one that comes while it dispatches is delivered once it has left
        (impl/_interrupt_shield.py). Only same-host links whose headers take the doorbell; not on a
        receiver, the timer or a callback runner."""
        role = THREAD_ROLE
        if role.link is not None or role.no_blocking_send or CALLBACK_ROLE.on_block is not None:
            return
        if not self._headers_in_ring or self._run_elsewhere is None:
            return
        # first: from here on a Ctrl-C is held back until the link is left in order
        shield = InterruptShield.install()
        try:
            if not self._join_as_guest(fut, shield):
                return
            defer = CALLBACK_ROLE.defer
            role.link, role.no_blocking_send, role.guest = self, True, True
            CALLBACK_ROLE.defer = self._defer_callbacks
            ended = True
            try:
                ended = self._receive_messages() is not _RETIRED
            except Exception as exc:  # a fault of ours: as in _receive_more
                if not self._state.closing:
                    _log.exception("twinrpc: receiving from %s failed", self._state.peer_name)
                    self._fail(exc)
            except BaseException:  # Ctrl-C while it waited: nothing was taken, the link goes on
                ended = False
                raise
            finally:
                role.link, role.no_blocking_send, role.guest = None, False, False
                CALLBACK_ROLE.defer = defer
                self._guest_leaves(ended)
        finally:
            if shield is not None:
                shield.lift()  # delivers a Ctrl-C held back meanwhile

    def _join_as_guest(self, fut: Future[Any], shield: InterruptShield | None) -> bool:
        """Join the receive loop as the caller waiting for ``fut`` (see receive_until); False: not now."""
        ring = self._rings.inbound
        if ring is None or ring.door is None:
            return False
        with self._rx_lock:
            if self._ended or self._guest is not None:
                return False
            if (
                not self._parked
                and (self._door_lock.locked() or self._at_door)
                and time.monotonic() - self._request_at < LINGER
            ):
                return False  # a receiver waits, and the link serves requests: leave it be
            if not add_waiter(fut, self._wake_guest):
                return False  # done already
            if self._parked:
                DOOR_WATCH.take_back(self._park_handle)  # if it rang already, its _unpark is ignored
                self._parked = False
                self._park_handle = None
                self._park_gen += 1
                self._live.header_waiters -= 1
                self._awake = True
                DOOR_WATCH.counted_awake(1)
                ring.disarm()
            self._guest = threading.get_ident()
            self._guest_fut = fut
            self._shield = shield
            self._receivers += 1
        return True

    def _wake_guest(self, _fut: Future[Any]) -> None:
        """The future of the caller receiving its reply was completed: if that was another thread,
        wake the caller on the doorbell (see receive_until)."""
        guest = self._guest
        ring = self._rings.inbound
        if (
            guest is not None
            and guest != threading.get_ident()
            and ring is not None
            and ring.door is not None
        ):
            ring.door.nudge()

    def _guest_leaves(self, ended: bool) -> None:
        """The caller receiving its reply leaves the loop (at a frame's end, or while it waited): the
        receivers still in it serve the link; else it is parked (or, with something already in the
        ring, a receiver started). ``ended``: receiving has ended for good."""
        start = False
        gate = None
        with self._rx_lock:
            self._guest = self._guest_fut = self._shield = None
            self._knock = False
            if ended:
                self._ended = True
            if self._ended:
                self._receivers -= 1
                gates, self._spares = self._spares, []
                done = self._receivers <= 0
                if done and self._awake:
                    self._awake = False
                    DOOR_WATCH.counted_awake(-1)
            else:
                gates, done = [], False
                self._receivers -= 1
                ring = self._rings.inbound
                if self._receivers == 0:
                    slot = self._claimed
                    if ring is not None and ring.door is not None and ring.arm(slot):
                        self._park(ring, slot)
                    else:
                        self._receivers += 1
                        start = True
                elif self._spares and self._receivers == len(self._spares) and not self._busy:
                    gate = self._spares.pop()  # nobody else dispatches: a spare does
        for g in gates:
            g.release()
        if done:
            self._receive_done.set()
        if gate is not None:
            gate.release()
        if start:
            assert self._run_elsewhere is not None
            self._run_elsewhere(self._receive_more)

    def join(self, timeout: float) -> bool:
        """Wait until receiving has ended (whichever thread receives by then)."""
        return self._receive_done.wait(timeout)

    @property
    def parks(self) -> bool:
        """Whether the link parks when idle (see LINGER): its header frames come through the peer's
        same-host ring, so the process's doorbell watcher can wait for them."""
        return self._headers_in_ring

    def receiving(self) -> int:
        """Threads in the receive loop now (0: receiving ended, or the link is parked)."""
        with self._rx_lock:
            return self._receivers

    def done(self) -> bool:
        """Whether receiving has ended (every receiver thread has left the loop)."""
        return self._receive_done.is_set()

    def threads(self) -> list[threading.Thread]:
        """The receiver's own thread (receivers on pool threads are the pool's to join)."""
        return [self._thread]

    def release(self) -> None:
        """Let go of the pair's process group and the receives posted on it (receiving has ended and
        the threads have exited; see Pair.release)."""
        self._pg = None
        self._ring_works = []
        self._staging_work = None

    # -- receiving ---------------------------------------------------------------------------------
    def _recv_data(self, nbytes: int, as_bytes: bool = False, mac: DataMac | None = None) -> Any:
        """Receive the next data frame (``nbytes`` long) as a tensor of its own (or as ``bytes``),
        recording for the heartbeat that we wait for the peer: copied out of the staging buffer (whose
        receive is then posted again), or, for a large frame, received in place. With ``mac`` (a
        message sent tag after, see ``_framing.FLAG_TAG_AFTER``) the frame is fed to it, a large one
        piece by piece as the pieces arrive."""
        live = self._live
        live.data_wait = (time.monotonic(), nbytes / MIN_FRAME_RATE)
        try:
            if nbytes > STAGED_BYTES:
                t = RECV_BUFFERS.take(nbytes)
                spans = pieces(nbytes) if mac is not None and nbytes > GO_AHEAD_BYTES else [(0, nbytes)]
                works = [(self._pg.recv([t[a:b]], self._src, LARGE_TAG), a, b) for a, b in spans]
                if nbytes > GO_AHEAD_BYTES:
                    # the sender posted the go-ahead's receive before the header, so this send does
                    # not wait for the peer's threads
                    self._pg.send([self._go_ahead], self._src, READY_TAG).wait()
                for work, a, b in works:
                    work.wait()
                    if mac is not None:  # while the next piece arrives
                        mac.update(t[a:b])
                out: Any = t.numpy().tobytes() if as_bytes else t
            else:
                with self._post_lock:
                    if self._staging_work is None:  # not posted again since the last frame (_repost)
                        self._staging_work = self._post_staging()
                    work = self._staging_work
                work.wait()
                staged = self._staging[:nbytes]
                out = staged.numpy().tobytes() if as_bytes else staged.clone()
                if mac is not None:
                    mac.update(out)
                with self._post_lock:
                    self._staging_work = None  # posted again by the next idle receiver (_repost)
        finally:
            live.data_wait = None
        live.heard = time.monotonic()
        return out

    def _take_from_ring(self, record: Record) -> tuple[bytes, list[torch.Tensor]]:
        """The payload and storages of a message whose data is in the peer's same-host ring: the
        payload and small storages copied out (freeing their room), large ones over the ring until
        freed (``InRing.take``)."""
        ring = self._rings.inbound
        positions = record.positions
        assert positions is not None
        if ring is None:
            if self._state.failed is not None or self._state.closing:
                raise RuntimeError("the link has ended")
            raise FrameError(
                f"{self._state.peer_name} sent data through a shared-memory ring never mapped here"
            )
        try:
            payload = record.inline_payload
            if payload is None:
                payload = ring.take_bytes(positions[0], record.payload_len)
            tensors = [
                ring.take(pos, size, RECV_BUFFERS.take)
                for pos, size in zip(positions[1:], record.sizes, strict=True)
            ]
        except ValueError as exc:
            raise FrameError(f"{self._state.peer_name} sent a bad shared-memory position: {exc}") from exc
        return payload, tensors

    def _post_staging(self) -> Any:
        return self._pg.recv([self._staging], self._src, DATA_TAG)

    def _post_header(self, i: int) -> None:
        t, _ = self._ring[i]
        # gloo accepts a frame shorter than the buffer silently: clear it, so a truncated
        # header shows as zeros (bad magic/version) rather than as the previous header's tail.
        t.zero_()
        self._ring_works[i] = self._pg.recv([t], self._src, TAG)

    def _repost(self) -> None:
        """Post again the receives of the frames already taken: the header slots (in slot order: gloo
        matches a pair's receives of one tag in the order they were posted, which is how a frame
        lands in the slot the receivers expect) and the staging buffer.

        Posting a receive is a socket write under the pair's lock that wakes the peer's event loop
        (CPU on both sides), so it is kept off the critical path of a request and its reply: not done
        by the receiver that has just taken a frame (it delivers the message first), nor right after
        that (it would hold the GIL while the thread it woke runs), but after this worker's next send
        on the link, while the peer is busy with that message (repost_after_send). Receivers post
        again themselves once _REPOST_BATCH slots are waiting (a peer that sends faster than it hears
        back), and always before claiming a slot whose receive is still pending (see _next_header),
        so a frame never lands in a slot whose receive is not posted again; a data frame's receive is
        posted on demand (_recv_data) if it is still pending then."""
        if (not self._repost_queue and self._staging_work is not None) or self._headers_in_ring:
            return
        with self._post_lock:
            while self._repost_queue:
                self._post_header(self._repost_queue[0])
                self._repost_queue.popleft()
                self.consumed += 1
            if self._staging_work is None:
                self._staging_work = self._post_staging()

    def repost_after_send(self) -> None:
        """See _repost; called by the sender once a message went out: a failure here is the
        receivers' to report."""
        try:
            self._repost()
        except RuntimeError as exc:
            if not self._state.closing:
                self._fail(exc)

    def _pass_turn(self) -> None:
        """The dispatching receiver is done with slot _turn (it goes on to the next, see
        _next_header, which takes a frame that is already here without waiting)."""
        with self._rx_lock:
            self._turn += 1
            self._busy = False

    def _next_header(self) -> Header | _Retired | None:
        """Become the dispatcher of the next slot: take it at once if its frame is here, else claim
        a slot and wait in gloo for its frame (receives are kept posted ahead, see RING); a frame
        that arrives before its turn is left for the dispatcher and this thread parks as a spare.
        Decode the header; its buffer's receive is posted again later (_repost). None: receiving
        ended meanwhile; _RETIRED: this thread has left the loop, which another receiver serves
        (see LINGER)."""
        if self._headers_in_ring:
            return self._next_header_from_slots()
        while True:
            if len(self._repost_queue) >= _REPOST_BATCH:
                self._repost()
            with self._rx_lock:
                if self._ended:
                    return None
                turn = self._ready_turn()
                if turn is None:
                    if self._retires(another_waits=bool(self._native)):
                        return _RETIRED
                    slot = self._claimed
                    # the receive of slot s is the s-th one posted: RING at first, one per consumed
                    unposted = slot >= RING + self.consumed
                    if not unposted:
                        self._claimed += 1
                        work = self._ring_works[slot % RING]
                        self._waiting(slot)
            if turn is not None:
                return self._decode(turn)
            if unposted:  # its buffer still holds a frame taken earlier, whose receive is pending
                if not self._repost_queue:
                    raise RuntimeError(
                        f"twinrpc: header ring out of step (slot {slot} has no receive to post)"
                    )
                self._repost()
                continue
            try:
                work.wait()
            finally:
                self._waited(slot)
            arrived = self._arrived(slot)
            if arrived is None:
                return None
            if arrived:
                return self._decode(slot)

    def _next_header_from_slots(self) -> Header | _Retired | None:
        """_next_header for header frames that come through the peer's ring: the thread holding the
        door lock claims the next slot, sleeps on the doorbell until the peer has written it, copies
        it into a header buffer of ours and frees it; dispatching is shared as over gloo."""
        if THREAD_ROLE.guest:
            return self._next_header_as_guest()
        while True:
            with self._rx_lock:
                if self._ended:
                    return None
                turn = self._ready_turn()
                if turn is None:
                    # a receiver waits for a slot, or holds the door on its way to waiting for one
                    if self._retires(bool(self._native) or self._door_lock.locked()):
                        return _RETIRED
                    self._at_door += 1
            if turn is not None:
                return self._decode(turn)
            with self._door_lock:
                with self._rx_lock:
                    self._at_door -= 1
                    if self._ended:
                        return None
                    # another receiver queues for the door behind this one: it can serve the link
                    if self._retires(self._at_door > 0):
                        return _RETIRED
                    slot = self._claimed
                    self._claimed += 1
                    self._waiting(slot)
                    idle_at = self._idle_at(slot)
                try:
                    error = self._take_slot(slot, idle_at, self._knocked)
                finally:
                    self._waited(slot)
                if error is _IDLE:
                    if self._idle(slot) is None:
                        continue
                    return _RETIRED
            if error is not None:
                assert not isinstance(error, _Idle)
                raise error
            arrived = self._arrived(slot)
            if arrived is None:
                return None
            if arrived:
                return self._decode(slot)

    def _next_header_as_guest(self) -> Header | _Retired | None:
        """_next_header_from_slots for a caller receiving its own reply (see receive_until): _RETIRED
        once its future is done or a Ctrl-C was held back (it is called at a frame's end); it never
        idles, parks or waits as a spare (a frame that arrives before its turn is left to the
        dispatcher, and the caller leaves)."""
        fut = self._guest_fut
        shield = self._shield
        assert fut is not None
        while True:
            with self._rx_lock:
                if self._ended:
                    return None
                if fut.done() or (shield is not None and shield.caught is not None):
                    return _RETIRED
                turn = self._ready_turn()
                if turn is None:
                    self._at_door += 1
                    self._knock = True  # a receiver at the door (or about to be) leaves it (_idle)
                    knock = self._door_lock.locked()
            if turn is not None:
                return self._decode(turn)
            if knock:
                door = self._rings.inbound.door if self._rings.inbound is not None else None
                if door is not None:
                    door.nudge()
            # not cut short by Ctrl-C (held back, see the shield): a knocked receiver leaves at once
            self._door_lock.acquire()
            try:
                with self._rx_lock:
                    self._at_door -= 1
                    self._knock = False
                    if self._ended:
                        return None
                    if fut.done():
                        continue
                    slot = self._claimed
                    self._claimed += 1
                    self._waiting(slot)
                try:
                    error = self._take_slot(slot, None, fut.done, shield)
                except BaseException:  # Ctrl-C in the wait: nothing taken
                    with self._rx_lock:
                        self._claimed = slot
                    raise
                finally:
                    self._waited(slot)
                if error is _IDLE:
                    with self._rx_lock:
                        self._claimed = slot
                    continue
            finally:
                self._door_lock.release()
            if error is not None:
                assert not isinstance(error, _Idle)
                raise error
            with self._rx_lock:
                if self._ended:
                    return None
                if not self._busy and self._turn == slot:
                    self._busy = True
                    mine = True
                else:
                    self._ready.add(slot)  # early: the dispatcher takes it when its turn comes
                    mine = False
            self._live.heard = time.monotonic()
            if mine:
                return self._decode(slot)
            return _RETIRED

    def _idle_at(self, slot: int) -> float | None:
        """Under _rx_lock, for the door's holder about to wait for ``slot``: when to look whether the
        link may park (see LINGER and _idle); None: never (nobody could start a receiver again)."""
        if self._run_elsewhere is None:
            return None
        if self._may_idle(slot):
            return self._idle_since()
        return time.monotonic() + LINGER  # another receiver is busy: look again later

    def _may_idle(self, slot: int) -> bool:
        """Under _rx_lock: no frame is in flight (the holder of the door waits for ``slot``, the next
        to dispatch) and any other receiver only queues for the door."""
        return self._receivers == 1 + self._at_door and not self._busy and self._turn == slot

    def _idle_since(self) -> float:
        """When the link has been idle long enough to park (see LINGER and PARK_SOON)."""
        return self._active_at + (PARK_SOON if DOOR_WATCH.awake > PARK_CAP else LINGER)

    def _knocked(self) -> bool:
        """Whether a caller waits for the door (see receive_until): its holder wakes and leaves."""
        return self._knock

    def _idle(self, slot: int) -> _Retired | None:
        """The door's holder found nothing by its idle bound (or a caller knocked, see
        receive_until): leave the loop (_RETIRED) to the caller that knocked or to a receiver queued
        for the door if the link has been idle long enough (_idle_since), else, unless something
        is there after all, leave it with the link parked (_park). The watcher counts as a receiver
        waiting for a header (``Liveness.header_waiters``), so a silent peer is judged as before.
        None: carry on receiving. Either way the slot is unclaimed."""
        ring = self._rings.inbound
        with self._rx_lock:
            self._claimed = slot
            if self._knock and not self._ended:
                self._receivers -= 1
                return _RETIRED
            if self._ended or not self._may_idle(slot) or time.monotonic() < self._idle_since():
                return None
            if self._at_door:
                self._receivers -= 1
                return _RETIRED
            if ring is None or not ring.arm(slot):
                return None
            self._receivers -= 1
            self._park(ring, slot)
        return _RETIRED

    def _park(self, ring: InRing, slot: int) -> None:
        """Under _rx_lock, with no receiver left and the doorbell armed for ``slot`` (``InRing.arm``):
        hand the doorbell to the process's watcher (impl/_door_watch.py), which calls _unpark when it
        rings. Under the lock, so that a caller taking the link back (receive_until) finds it with the
        watcher already."""
        self._parked = True
        self._park_gen += 1
        live = self._live
        if not live.header_waiters:
            live.header_since = time.monotonic()
        live.header_waiters += 1
        if self._awake:
            self._awake = False
            DOOR_WATCH.counted_awake(-1)
        door = ring.door
        assert door is not None
        self._park_handle = DOOR_WATCH.park(
            door, door.fds, partial(ring.has_news, slot), partial(self._unpark, self._park_gen)
        )

    def _unpark(self, parking: int) -> None:
        """On the watcher's thread: the parked link's doorbell rang, the peer's process ended or the
        link was stopped here. Start a receiver again (it takes what the peer wrote, or fails the
        link as a sleeping receiver would), or, if the link was stopped here, end receiving. Nothing
        if a caller took the link back meanwhile (``parking`` is not the latest)."""
        ring = self._rings.inbound
        with self._rx_lock:
            if not self._parked or parking != self._park_gen:
                return
            self._parked = False
            self._park_handle = None
            self._live.header_waiters -= 1
            gone = ring is None or ring.door is None or ring.door.stopped
            if gone:
                self._ended = True
                done = self._receivers <= 0
            else:
                self._receivers += 1
                self._awake = True
                DOOR_WATCH.counted_awake(1)
                # under the lock: a caller that joins next may sleep on the doorbell at once
                assert ring is not None
                ring.disarm()
        if gone:
            if done:
                self._receive_done.set()
            return
        assert self._run_elsewhere is not None
        self._run_elsewhere(self._receive_more)

    def _ready_turn(self) -> int | None:
        """Under _rx_lock: become the dispatcher of slot _turn if its frame is here already."""
        if self._busy or self._turn not in self._ready:
            return None
        slot = self._turn
        self._ready.discard(slot)
        self._busy = True
        return slot

    def _retires(self, another_waits: bool) -> bool:
        """Under _rx_lock: leave the loop (see LINGER) when another receiver already waits for an
        earlier frame and the link has not handed a message off lately."""
        if another_waits and time.monotonic() - self._handed_off_at > LINGER:
            self._receivers -= 1
            return True
        return False

    def _waiting(self, slot: int) -> None:
        """Under _rx_lock: this thread waits for the frame of ``slot`` (for hand_off and liveness)."""
        live = self._live
        self._native.add(slot)
        if not live.header_waiters:
            live.header_since = time.monotonic()
        live.header_waiters += 1

    def _waited(self, slot: int) -> None:
        with self._rx_lock:
            self._live.header_waiters -= 1
            self._native.discard(slot)

    def _arrived(self, slot: int) -> bool | None:
        """The frame of ``slot`` is here: True if it is this thread's to dispatch now; else it is left
        for the dispatcher and this thread parks as a spare until woken (False: look again). None:
        receiving ended meanwhile."""
        self._live.heard = time.monotonic()
        with self._rx_lock:
            if self._ended:
                return None
            if not self._busy and self._turn == slot:
                self._busy = True
                return True
            self._ready.add(slot)  # early: the dispatcher takes it when its turn comes
            gate = allocate_lock()
            gate.acquire()
            self._spares.append(gate)
        gate.acquire()  # woken when no receiver waits for the next slot (or at the end)
        return False

    def _take_slot(
        self,
        slot: int,
        idle_at: float | None = None,
        stop: Callable[[], bool] | None = None,
        shield: InterruptShield | None = None,
    ) -> BaseException | _Idle | None:
        """Wait for header ``slot`` in the peer's ring and copy it into its buffer; the error that ends
        receiving instead (a fresh one: a traceback through here would keep the ring mapped), or
        _IDLE: nothing came by ``idle_at`` (monotonic; None: no bound) or ``stop()`` held first.
        ``shield``: a caller's Ctrl-C may cut the wait short (nothing is taken yet), not the take."""
        ring = self._rings.inbound
        if ring is None:  # released: the link has ended
            return RuntimeError("the link has ended")
        try:
            if shield is not None:
                shield.open = True
            try:
                written = ring.wait_header(slot, idle_at, stop)
            finally:
                if shield is not None:
                    shield.open = False
            if not written:
                return _IDLE
            ring.take_header(slot, self._ring[slot % RING][1])
            return None
        except ValueError as exc:
            text = f"{self._state.peer_name} broke its header slots: {exc}"
        except RuntimeError as exc:
            text, kind = str(exc), type(exc)
            return kind(text)
        return RuntimeError(text)

    def _decode(self, slot: int) -> Header:
        """Check (with a key) and decode the header frame of ``slot``, now in its buffer."""
        i = slot % RING
        state = self._state
        auth = self._auth
        # with a key, the frame is checked before anything of it is decoded
        data_tag = None if auth is None else auth.check_header(self._ring[i][1], slot, state.peer_name)
        try:
            header = Header(self._ring[i][1], state.peer, state.me, self._ring[i][0])
        except FrameError:
            if not self._headers_in_ring:
                self._repost_queue.append(i)
            raise
        if data_tag is not None:
            header.data_tag = data_tag
        if not header.closing and not self._headers_in_ring:
            self._repost_queue.append(i)  # posted again after this message is handled (_repost)
            self.peer_acked = header.ack
        return header

    def _receive_loop(self) -> None:
        try:
            self._ring_works = [None] * RING
            if not self._headers_in_ring:
                with self._post_lock:  # a send may already have posted the staging receive (_repost)
                    for i in range(RING):
                        self._post_header(i)
                    if self._staging_work is None:
                        self._staging_work = self._post_staging()
        except RuntimeError as exc:
            if not self._state.closing:
                self._fail(exc)
            self._leave(ended=True)
            return
        self._receive_more()

    def _receive_more(self) -> None:
        """Receive (this thread is counted in _receivers) until the link ends; after handing the
        role off (to run a request or make a blocking send), rejoin if the link is short of
        receivers, else return (to the pool)."""
        while True:
            THREAD_ROLE.no_blocking_send = True
            THREAD_ROLE.link = self
            CALLBACK_ROLE.defer = self._defer_callbacks
            try:
                handed_off = self._receive_messages()
            except Exception as exc:
                # a fault of ours: the link fails (calls to the peer fail, naming it) rather than
                # going silent with this thread gone until the heartbeat judges the peer
                if not self._state.closing:
                    _log.exception("twinrpc: receiving from %s failed", self._state.peer_name)
                    self._fail(exc)
                self._leave(ended=True)
                return
            except BaseException:
                self._leave(ended=True)
                raise
            finally:
                if THREAD_ROLE.link is self:
                    THREAD_ROLE.link = None
                    THREAD_ROLE.no_blocking_send = False
                CALLBACK_ROLE.defer = None
            if isinstance(handed_off, _Retired):
                return  # it left the loop, which another receiver serves (see LINGER)
            if not handed_off:
                self._leave(ended=True)
                return
            with self._rx_lock:
                rejoin = self._receivers < RECEIVERS and not self._ended and not self._parked
                if rejoin:
                    self._receivers += 1
            if not rejoin:
                return

    def _leave(self, ended: bool) -> None:
        """This thread leaves the receive loop; ``ended``: receiving has ended for good."""
        with self._rx_lock:
            self._receivers -= 1
            if ended:
                self._ended = True
            gates: list[Any] = []
            if self._ended:
                gates, self._spares = self._spares, []
            done = self._ended and self._receivers <= 0
            if done and self._awake:
                self._awake = False
                DOOR_WATCH.counted_awake(-1)
        for gate in gates:
            gate.release()
        if done:
            self._receive_done.set()

    def _refuse(self, exc: AuthenticationError) -> None:
        """A frame failed the job key's check: nothing of it was handed on; the link fails."""
        self.bad_frames += 1
        _log.error("twinrpc: %s", exc)
        self._fail(exc)

    def _receive_messages(self) -> bool | _Retired:
        """Dispatch messages in turn; True: this thread handed its role off, False: receiving ended,
        _RETIRED: this thread left the loop, which another receiver serves (see LINGER).
        A frame's messages (riders, its first message, the further ones) are dispatched in order by
        this thread: it hands its role off only at the frame's last message (see hand_off)."""
        state = self._state
        while True:
            try:
                header = self._next_header()
                if header is None:
                    return False
                if isinstance(header, _Retired):
                    return header
                if state.failed is not None:
                    return False  # declared dead (heartbeat): nothing it still sends is trusted
                if header.closing:  # the peer sends one per receiver of ours: each ends one
                    first = not state.closed_by_peer
                    state.closed_by_peer = True
                    if first and not state.closing:
                        state.peer_graceful = bool(header.graceful)
                        self._peer_closed()
                    self._pass_turn()
                    return False
            except AuthenticationError as exc:
                self._refuse(exc)
                return False
            except FrameError as exc:
                # gloo is message-based: each receive gets exactly one send's frame, so after a bad
                # header the next frame starts a message again. Reject this one and keep the link.
                self.bad_frames += 1
                _log.error(
                    "twinrpc: rejected a malformed frame from %s: %s; frame dropped, link kept",
                    state.peer_name,
                    exc,
                )
                self._pass_turn()
                continue
            except RuntimeError as exc:
                if not state.closing:
                    self._fail(exc)
                return False
            if header.riders:
                self._riders.deliver(header)
            records: list[Record] = [header] if header.kind is not Kind.HEARTBEAT else []
            if header.more:
                records += [r for r in header.more if r.kind is not Kind.HEARTBEAT]
            if records:
                now = self._active_at = time.monotonic()
                for record in records:
                    if record.kind is not Kind.RESPONSE and record.kind is not Kind.EXCEPTION:
                        self._request_at = now  # see receive_until
                        break
            try:
                for record in records:
                    check_announced(record, state.peer_name, self._max_message_bytes)
            except FrameTooLarge as exc:
                _log.error("twinrpc: %s", exc)
                self.bad_frames += 1
                self._fail(exc)
                return False
            left = len(records)
            for record in records:
                left -= 1
                try:
                    mac = None
                    if record.positions is not None:
                        payload, tensors = self._take_from_ring(record)
                    else:
                        if self._auth is not None and record is header and header.tag_after:
                            mac = self._auth.incoming_mac(header.data_tag)
                        inline_payload, inline_tensors = record.inline_payload, record.inline_tensors
                        payload = (
                            inline_payload
                            if inline_payload is not None
                            else self._recv_data(record.payload_len, as_bytes=True, mac=mac)
                        )
                        if inline_tensors is not None:
                            tensors = inline_tensors
                        else:
                            tensors = [
                                self._recv_data(size, mac=mac) if size else torch.empty(0, dtype=torch.uint8)
                                for size in record.sizes
                            ]
                    if mac is not None:  # the tag follows the data: checked before any of it is used
                        assert self._auth is not None
                        tag = self._recv_data(TAG_BYTES, as_bytes=True)
                        self._auth.check_tag_after(mac, tag, record.id, state.peer_name)
                    elif self._auth is not None:  # before the payload is unpickled, a tensor built
                        apart = sent_apart(
                            record.inline_payload is not None,
                            record.inline_tensors is not None or record.positions is not None,
                            payload,
                            tensors,
                        )
                        if apart:
                            self._auth.check_data(apart, header.data_tag, record.id, state.peer_name)
                        # not kept past the check: the storages are the handler's (see the del below)
                        del apart
                except AuthenticationError as exc:
                    self._refuse(exc)
                    return False
                except FrameError as exc:  # a bad ring position: what follows cannot be trusted
                    _log.error("twinrpc: %s", exc)
                    self.bad_frames += 1
                    self._fail(exc)
                    return False
                except RuntimeError as exc:
                    if not state.closing:
                        self._fail(exc)
                    return False
                self._frame_left = left
                try:
                    self._on_message(Message(record.kind, record.id, state.peer, state.me, payload, tensors))
                except Exception:
                    _log.exception("twinrpc: handling a message from %s failed", state.peer_name)
                # the message is the handler's now: this frame must not keep its storages (some
                # hold room in the peer's ring until freed) while waiting, nor in a traceback
                del payload, tensors
                if THREAD_ROLE.link is not self:
                    return True  # handed off while handling the frame's last message (the turn went with it)
            self._frame_left = 0
            self._pass_turn()
