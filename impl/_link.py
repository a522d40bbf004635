"""One link per peer: a private 2-rank gloo process group, a send lock and a receiver thread.

A process group per pair (not one for the whole world) keeps failures apart: when a peer dies only
its link breaks, and every other peer keeps working (gloo closes the whole context on an IO error).
The receiver posts receives with an explicit source, which gloo serves much faster than any-source.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from twinrpc._message import Message

from ._framing import FrameError, Header, encode_close, encode_header, new_header_tensor

_log = logging.getLogger("twinrpc.impl")
_TAG = 0
_CLOSE_FLUSH = 10.0  # seconds to let the outbox drain before the close frame


class _ThreadRole(threading.local):
    #: True on threads that must never block in a gloo send: receivers (a peer's receiver may be
    #: sending to us at the same moment, and gloo sends wait for the matching receive) and the timer.
    no_blocking_send = False


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
        self._recv_header, self._recv_view = new_header_tensor()
        #: the error that broke the link (IO error, malformed frame): nothing can be sent any more
        self.failed: BaseException | None = None
        #: the peer sent its close frame (it shut down): calls to it fail, our own close frame may still go
        self.closed_by_peer = False
        #: we are shutting down: receive errors are expected and no longer reported
        self.closing = False
        self._receiver = threading.Thread(target=self._receive_loop, name=f"twinrpc-recv-{peer}", daemon=True)
        self._outbox: queue.SimpleQueue[tuple[Message, Callable[[Message, BaseException], None]] | None] = (
            queue.SimpleQueue()
        )
        self._outbox_thread: threading.Thread | None = None

    def start(self) -> None:
        self._receiver.start()

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
                inline = encode_header(self._send_view, msg)
                pg.send([self._send_header], dst, _TAG).wait()
                if not inline:
                    payload = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8)
                    pg.send([payload], dst, _TAG).wait()
                for t in msg.tensors:
                    if t.numel():
                        pg.send([t], dst, _TAG).wait()
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
    def _receive_loop(self) -> None:
        THREAD_ROLE.no_blocking_send = True
        pg, src = self.pg, self._peer_rank_in_pg
        while True:
            try:
                pg.recv([self._recv_header], src, _TAG).wait()
                header = Header(self._recv_view, self.peer, self.me)
                if header.closing:
                    self.closed_by_peer = True
                    if not self.closing:
                        left = RuntimeError("the peer has shut down RPC")
                        left.graceful_exit = header.graceful  # type: ignore[attr-defined]
                        self._on_failure(self.peer, left)
                    return
                payload = header.inline_payload
                if payload is None:
                    buf = torch.empty(header.payload_len, dtype=torch.uint8)
                    pg.recv([buf], src, _TAG).wait()
                    payload = buf.numpy().tobytes()
                tensors = []
                for size in header.sizes:
                    t = torch.empty(size, dtype=torch.uint8)
                    if size:
                        pg.recv([t], src, _TAG).wait()
                    tensors.append(t)
            except FrameError as exc:
                # The frame boundary can no longer be trusted: drop the link, keep the process.
                _log.error("twinrpc: malformed frame from rank %d: %s; closing that link", self.peer, exc)
                self._fail(exc)
                return
            except RuntimeError as exc:
                if not self.closing:
                    self._fail(exc)
                return
            try:
                self._on_message(Message(header.kind, header.id, self.peer, self.me, payload, tensors))
            except Exception:
                _log.exception("twinrpc: handling a message from rank %d failed", self.peer)

    def _fail(self, exc: BaseException) -> None:
        if self.failed is None and not self.closing:
            self.failed = exc
            self._on_failure(self.peer, exc)

    def join(self, timeout: float) -> bool:
        self._receiver.join(timeout)
        return not self._receiver.is_alive()


#: gloo applies a process group's timeout to every receive, including a receiver idling between
#: messages; RPC timeouts are the agent's business, and a dead peer shows as a closed connection.
_LINK_OP_TIMEOUT = timedelta(days=30)


def make_pair_group(store: Any, me: int, peer: int) -> Any:
    """The 2-rank gloo process group of the pair (me, peer), over its own key prefix."""
    low, high = min(me, peer), max(me, peer)
    prefix = dist.PrefixStore(f"pair/{low}-{high}", store)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(prefix, 0 if me == low else 1, 2, _LINK_OP_TIMEOUT)
