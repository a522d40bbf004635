"""Ctrl-C on the main thread while it dispatches a link's messages: held back until the frame is done.

A caller that receives its own reply (``Receiver.receive_until``) dispatches whatever the peer sent
first, in order, on its own thread. On the main thread, Python raises ``KeyboardInterrupt`` wherever
that thread happens to be when SIGINT arrives: in the middle of a frame, a message half handled (a
reply's pending call taken but its future never completed) or the rest of the frame never handed on.
So while such a caller receives, SIGINT's handler is a shield: while the caller only *waits* (for the
link's door, or on the doorbell: nothing taken yet) it calls the program's handler at once, which
raises there as before; otherwise it notes the signal, and the caller delivers it (calls the program's
handler) once the frame is dispatched and it has left the link in order. Other threads never see
SIGINT's handler run, so they need no shield.
"""

from __future__ import annotations

# signal.signal's C function, without the module's conversions of handlers to and from enums: a
# caller swaps SIGINT's handler twice per call it receives for, and the wrapper costs ~8 us a pair
# against ~0.6 (benchmarks: rpc_sync latency). The same checks (main thread, main interpreter).
import _signal
import signal
import threading
from types import FrameType
from typing import Any

_MAIN = threading.main_thread().ident
_SIGINT = int(signal.SIGINT)


class InterruptShield:
    """SIGINT's handler while the main thread receives for a link (see the module docstring).

    Only the main thread uses it (``install``); ``open`` is set around the waits that may be cut short.
    """

    __slots__ = ("_prev", "caught", "open")

    def __init__(self) -> None:
        self._prev: Any = None
        #: the thread only waits now: a signal raises here as it would without the shield
        self.open = False
        #: a signal noted while the thread was dispatching (signal number, frame)
        self.caught: tuple[int, FrameType | None] | None = None

    @classmethod
    def install(cls) -> InterruptShield | None:
        """On the main thread with a Python handler for SIGINT (the default raises KeyboardInterrupt):
        put a shield in its place. None: another thread, or no Python handler (nothing to hold back)."""
        if threading.get_ident() != _MAIN:
            return None
        shield = cls()
        try:
            prev = _signal.signal(_SIGINT, shield._on_signal)
        except ValueError:  # not the main interpreter
            return None
        if not callable(prev):
            _signal.signal(_SIGINT, prev)
            return None
        shield._prev = prev
        return shield

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.open:
            self._prev(signum, frame)
        else:
            self.caught = (signum, frame)

    def lift(self) -> None:
        """Put the program's handler back, then call it for a signal noted meanwhile (the default
        raises KeyboardInterrupt here)."""
        _signal.signal(_SIGINT, self._prev)
        caught, self.caught = self.caught, None
        if caught is not None:
            self._prev(*caught)
