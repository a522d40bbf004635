"""Riders: deferrable messages that wait to travel at the end of the next header frame to the peer.

A message that no caller waits on, such as a context's release, then costs neither a frame of its own
nor a wake-up of the peer's receiver (see ``_framing``). The sender takes the riders waiting into each
header frame it encodes; the receiver delivers a header's riders before the header's own message.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from twinrpc._message import Message

from ._framing import MAX_RIDER_BYTES, Header, can_ride, rider_bytes
from ._link_state import LinkState

_log = logging.getLogger("twinrpc.impl")

#: a message waiting to ride, with how to report it if its frame fails: ``on_error(msg, exc)``
Rider = tuple[Message, Callable[[Message, BaseException], None]]


class Riders:
    """The riders waiting on one link, in order (under ``_lock``), and their delivery on arrival."""

    def __init__(self, state: LinkState, on_message: Callable[[Message], None]) -> None:
        self._state = state
        self._on_message = on_message
        self._waiting: list[Rider] = []
        self._lock = threading.Lock()
        #: a receiver is delivering a header's riders: it must not hand its role off (the header's
        #: own message is still to be dispatched by it)
        self.delivering = False

    def __bool__(self) -> bool:
        """Whether any rider is waiting (without the lock: a hint)."""
        return bool(self._waiting)

    def defer(self, msg: Message, on_error: Callable[[Message, BaseException], None]) -> bool:
        """Let ``msg`` (a ``Message.deferrable`` one: small, payload only) wait to ride at the end of
        the next header frame to the peer, which delivers it before that frame's own message. The
        world sends whatever still waits after a short while (PeerLink.flush_riders). False: it cannot
        wait; send it as usual. ``on_error(msg, exc)`` reports a rider whose frame failed."""
        state = self._state
        if not can_ride(msg) or state.failed is not None or state.closed_by_peer or state.closing:
            return False
        with self._lock:
            if sum(rider_bytes(m) for m, _ in self._waiting) + rider_bytes(msg) > MAX_RIDER_BYTES:
                return False
            self._waiting.append((msg, on_error))
        return True

    def take(self) -> list[Rider]:
        """Every rider waiting, in order (for the frame being encoded)."""
        if not self._waiting:
            return []
        with self._lock:
            riders, self._waiting = self._waiting, []
        return riders

    def give_back(self, riders: list[Rider]) -> None:
        """Put riders taken for a frame that was not sent back in front of the queue, in order."""
        if riders:
            with self._lock:
                self._waiting[:0] = riders

    def deliver(self, header: Header) -> None:
        """Deliver a header's riders, in order, before its own message (they were sent before it);
        on the receiver dispatching that header."""
        state = self._state
        self.delivering = True
        try:
            for kind, msg_id, payload in header.riders:
                try:
                    self._on_message(Message(kind, msg_id, state.peer, state.me, payload))
                except Exception:
                    _log.exception("twinrpc: handling a message from %s failed", state.peer_name)
        finally:
            self.delivering = False


def messages(riders: list[Rider]) -> list[Message]:
    return [msg for msg, _ in riders]


def report_failed(riders: list[Rider], exc: BaseException) -> None:
    """Tell each rider's sender that the frame it rode in (or would have) failed with ``exc``."""
    for msg, on_error in riders:
        try:
            on_error(msg, exc)
        except Exception:
            _log.exception("twinrpc: reporting a failed deferred %s failed", msg.describe())
