"""One link per peer: a private 2-rank gloo process group, a send lock and a receiver thread.

A process group per pair (not one for the whole world) keeps failures apart: when a peer dies only
its link breaks, and every other peer keeps working (gloo closes the whole context on an IO error).
The receiver posts receives with an explicit source, which gloo serves much faster than any-source.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from twinrpc._message import Kind, Message

from ._framing import (
    HEADER_BYTES,
    FrameError,
    Header,
    encode_close,
    encode_header,
    new_header_tensor,
    recv_buffer,
)

_log = logging.getLogger("twinrpc.impl")
_TAG = 0  # header frames (and close frames)
_DATA_TAG = 1  # payload and tensor frames, which follow their header in order
#: header receives kept posted ahead: a gloo send waits until the peer has posted the matching
#: receive, so with one posted header a stream of messages pays a notify round trip per message
_RING = 16
_CLOSE_FLUSH = 10.0  # seconds to let the outbox drain before the close frame
#: bytes per second a peer is allowed to be slow at while sending a large frame (heartbeat allowance)
_MIN_FRAME_RATE = 10e6


class _ThreadRole(threading.local):
    #: True on threads that must never block in a gloo send: receivers (a peer's receiver may be
    #: sending to us at the same moment, and gloo sends wait for the matching receive) and the timer.
    no_blocking_send = False
    #: the PeerLink this thread receives for (None: not a receiver); see PeerLink.hand_off
    link: Any = None


THREAD_ROLE = _ThreadRole()


class PeerLink:
    """Messages to and from one peer, in order, over that pair's own gloo process group."""

    def __init__(
        self,
        me: int,
        peer: int,
        pg: Any,
        on_message: Callable[[Message], None],
        on_failure: Callable[[int, BaseException], None],
    ) -> None:
        self.me = me
        self.peer = peer
        self.pg = pg
        self._peer_rank_in_pg = 1 if me < peer else 0
        self._on_message = on_message
        self._on_failure = on_failure
        self._send_lock = threading.Lock()
        self._send_header, self._send_view = new_header_tensor()
        self._ring = [new_header_tensor() for _ in range(_RING)]
        self._ring_works: list[Any] = []
        self._ring_pos = 0
        #: the error that broke the link (IO error, malformed frame): nothing can be sent any more
        self.failed: BaseException | None = None
        #: the peer sent its close frame (it shut down): calls to it fail, our own close frame may still go
        self.closed_by_peer = False
        #: we are shutting down: receive errors are expected and no longer reported
        self.closing = False
        # -- liveness (heartbeat): written by the receiver, read by the world's heartbeat tick --
        #: how logs and errors name the peer (the world sets "'worker1' (rank 1)")
        self.peer_name = f"rank {peer}"
        #: monotonic time of the last frame received from the peer (None: nothing heard yet)
        self.heard: float | None = None
        #: (since, allowance) while the receiver waits in a receive: a silent peer is only suspect
        #: while we wait for it, never while our own receiver is busy handling a message
        self._waiting: tuple[float, float] | None = None
        #: malformed frames rejected so far (each logged, naming the peer)
        self.bad_frames = 0
        self._receiver = threading.Thread(target=self._receive_loop, name=f"twinrpc-recv-{peer}", daemon=True)
        self._receive_done = threading.Event()
        self._run_elsewhere: Callable[[Callable[[], None]], None] | None = None
        self._outbox: queue.SimpleQueue[tuple[Message, Callable[[Message, BaseException], None]] | None] = (
            queue.SimpleQueue()
        )
        self._outbox_thread: threading.Thread | None = None

    def start(self, run_elsewhere: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Start receiving. ``run_elsewhere(fn)`` runs ``fn`` on another (idle) thread: with it, a
        receiver can hand its role over (see hand_off) instead of making a request wait for a thread."""
        self._run_elsewhere = run_elsewhere
        self._receiver.start()

    def hand_off(self) -> bool:
        """Called on this link's receiver thread: another thread takes over receiving (at once, while
        this one finishes handling its message); this thread becomes an ordinary thread that may
        block, run a request or send. Returns False (nothing changed) where that cannot be done."""
        if THREAD_ROLE.link is not self or self._run_elsewhere is None:
            return False
        THREAD_ROLE.link = None
        THREAD_ROLE.no_blocking_send = False
        self._run_elsewhere(self._receive_more)
        return True

    # -- sending -----------------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        """Send one message (header, maybe payload, then each storage). Raises on a broken link."""
        if self.failed is not None:
            raise self.failed
        if self.closed_by_peer:
            raise RuntimeError("the peer has shut down RPC")
        pg, dst = self.pg, self._peer_rank_in_pg
        with self._send_lock:
            try:
                inline, inline_tensors = encode_header(self._send_view, msg)
                pg.send([self._send_header], dst, _TAG).wait()
                if not inline:
                    payload = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8)
                    pg.send([payload], dst, _DATA_TAG).wait()
                if not inline_tensors:
                    for t in msg.tensors:
                        if t.numel():
                            pg.send([t], dst, _DATA_TAG).wait()
            except RuntimeError as exc:
                self._fail(exc)
                raise

    def send_later(self, msg: Message, on_error: Callable[[Message, BaseException], None]) -> None:
        """Send from the link's outbox thread (for threads that must not block, see THREAD_ROLE)."""
        if self._outbox_thread is None:
            with self._send_lock:
                if self._outbox_thread is None:
                    self._outbox_thread = threading.Thread(
                        target=self._outbox_loop, name=f"twinrpc-send-{self.peer}", daemon=True
                    )
                    self._outbox_thread.start()
        self._outbox.put((msg, on_error))

    def _outbox_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            msg, on_error = item
            try:
                self.send(msg)
            except Exception as exc:
                on_error(msg, exc)

    def send_close(self, graceful: bool = False) -> None:
        """Tell the peer's receiver for us to stop, after anything still queued. ``graceful``: we
        completed graceful shutdown, so the peer must not treat our departure as a failure."""
        if self.failed is not None:
            return  # a dead peer reads nothing: don't wait for the outbox to drain
        if self._outbox_thread is not None:
            self._outbox.put(None)
            self._outbox_thread.join(_CLOSE_FLUSH)
        if self.failed is not None:
            return
        with self._send_lock:
            try:
                encode_close(self._send_view, self.me, graceful)
                self.pg.send([self._send_header], self._peer_rank_in_pg, _TAG).wait()
            except RuntimeError as exc:
                _log.debug("twinrpc: close frame to %d failed: %s", self.peer, exc)

    # -- receiving ---------------------------------------------------------------------------------
    def _recv(self, t: torch.Tensor) -> None:
        """Receive one frame into ``t``, recording for the heartbeat that we wait for the peer."""
        self._waiting = (time.monotonic(), t.numel() / _MIN_FRAME_RATE)
        try:
            self.pg.recv([t], self._peer_rank_in_pg, _DATA_TAG).wait()
        finally:
            self._waiting = None
        self.heard = time.monotonic()

    def _post_header(self, i: int) -> None:
        t, _ = self._ring[i]
        # gloo accepts a frame shorter than the buffer silently: clear it, so a truncated
        # header shows as zeros (bad magic/version) rather than as the previous header's tail.
        t.zero_()
        self._ring_works[i] = self.pg.recv([t], self._peer_rank_in_pg, _TAG)

    def _next_header(self) -> Header:
        """Wait for the next header frame (receives are kept posted ahead, see _RING); decode it and
        post that buffer's receive again."""
        i = self._ring_pos
        self._waiting = (time.monotonic(), HEADER_BYTES / _MIN_FRAME_RATE)
        try:
            self._ring_works[i].wait()
        finally:
            self._waiting = None
        self.heard = time.monotonic()
        self._ring_pos = (i + 1) % _RING
        try:
            header = Header(self._ring[i][1], self.peer, self.me, self._ring[i][0])
        except FrameError:
            self._post_header(i)
            raise
        if not header.closing:
            self._post_header(i)
        return header

    def _receive_loop(self) -> None:
        try:
            self._ring_works = [None] * _RING
            for i in range(_RING):
                self._post_header(i)
        except RuntimeError as exc:
            if not self.closing:
                self._fail(exc)
            self._receive_done.set()
            return
        self._receive_more()

    def _receive_more(self) -> None:
        """Receive until the link ends, or until this thread hands its role over (hand_off)."""
        THREAD_ROLE.no_blocking_send = True
        THREAD_ROLE.link = self
        try:
            handed_off = self._receive_messages()
        finally:
            if THREAD_ROLE.link is self:
                THREAD_ROLE.link = None
                THREAD_ROLE.no_blocking_send = False
        if not handed_off:
            self._receive_done.set()

    def _receive_messages(self) -> bool:
        while True:
            try:
                header = self._next_header()
                if self.failed is not None:
                    return False  # declared dead (heartbeat): nothing it still sends is trusted
                if header.closing:
                    self.closed_by_peer = True
                    if not self.closing:
                        left = RuntimeError("the peer has shut down RPC")
                        left.graceful_exit = header.graceful  # type: ignore[attr-defined]
                        self._on_failure(self.peer, left)
                    return False
                if header.kind is Kind.HEARTBEAT:
                    continue
                payload = header.inline_payload
                if payload is None:
                    buf = torch.empty(header.payload_len, dtype=torch.uint8)
                    self._recv(buf)
                    payload = buf.numpy().tobytes()
                tensors = header.inline_tensors
                if tensors is None:
                    tensors = []
                    for size in header.sizes:
                        t = recv_buffer(size)
                        if size:
                            self._recv(t)
                        tensors.append(t)
            except FrameError as exc:
                # gloo is message-based: each receive gets exactly one send's frame, so after a bad
                # header the next frame starts a message again. Reject this one and keep the link.
                self.bad_frames += 1
                _log.error(
                    "twinrpc: rejected a malformed frame from %s: %s; frame dropped, link kept",
                    self.peer_name,
                    exc,
                )
                continue
            except RuntimeError as exc:
                if not self.closing:
                    self._fail(exc)
                return False
            try:
                self._on_message(Message(header.kind, header.id, self.peer, self.me, payload, tensors))
            except Exception:
                _log.exception("twinrpc: handling a message from %s failed", self.peer_name)
            if THREAD_ROLE.link is not self:
                return True  # handed off while handling it: another thread receives now

    # -- liveness ----------------------------------------------------------------------------------
    def check_alive(self, now: float, threshold: float) -> None:
        """Declare the peer dead if we have waited for its next frame for longer than ``threshold``
        seconds (plus time for a large frame at ``_MIN_FRAME_RATE``) since we last heard from it.

        Only a peer heard at least once is judged, so a peer still setting up its world is never
        mistaken for a dead one. Runs on the world's timer thread; never blocks.
        """
        waiting, heard = self._waiting, self.heard
        if waiting is None or heard is None or self.failed is not None or self.closing or self.closed_by_peer:
            return
        since, allowance = waiting
        silent = now - max(since, heard)
        if silent > threshold + allowance:
            self._fail(
                RuntimeError(
                    f"no frame or heartbeat from it for {silent:.1f} s while waiting for one (limit "
                    f"{threshold + allowance:.1f} s: heartbeat_interval x heartbeat_misses); its process is "
                    "stopped, hung or cut off from this one"
                )
            )

    def restart_liveness(self, now: float) -> None:
        """Forget past silence (this process itself was stalled: the peer's frames are still queued)."""
        if self.heard is not None:
            self.heard = now

    def send_heartbeat(self) -> None:
        """Queue one heartbeat frame on the outbox (never blocks); skipped while the outbox is busy,
        since whatever it is sending tells the peer we are alive just as well."""
        if self.failed is not None or self.closing or self.closed_by_peer or not self._outbox.empty():
            return
        self.send_later(Message(Kind.HEARTBEAT, 0, self.me, self.peer, b""), _ignore_heartbeat_error)

    def _fail(self, exc: BaseException) -> None:
        if self.failed is None and not self.closing:
            self.failed = exc
            self._on_failure(self.peer, exc)

    def join(self, timeout: float) -> bool:
        """Wait until receiving has ended (whichever thread receives by then)."""
        return self._receive_done.wait(timeout)


def _ignore_heartbeat_error(msg: Message, exc: BaseException) -> None:
    """A heartbeat that cannot be sent needs no report: the failed send broke the link already."""


#: gloo applies a process group's timeout to every receive, including a receiver idling between
#: messages; RPC timeouts are the agent's business, and a dead peer shows as a closed connection.
_LINK_OP_TIMEOUT = timedelta(days=30)


def make_pair_group(store: Any, me: int, peer: int) -> Any:
    """The 2-rank gloo process group of the pair (me, peer), over its own key prefix."""
    low, high = min(me, peer), max(me, peer)
    prefix = dist.PrefixStore(f"pair/{low}-{high}", store)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(prefix, 0 if me == low else 1, 2, _LINK_OP_TIMEOUT)
