"""Where a link is in its life (up, failed, closed by the peer, closing), shared by its parts.

Every part of a ``PeerLink`` (sender, receiver, riders, liveness) holds the one ``LinkState`` and reads
it on its own path; each field is written by one concept (see the field comments). No lock: each
field is a single write, and a reader that sees a stale value finds out on its next step (a send to a
failed link fails in gloo, and reports the link's error).
"""

from __future__ import annotations

import re

#: where in gloo's sources an error was raised, at the start of its text ("[.../pair.cc:553] ")
_GLOO_LOCATION = re.compile(r"^\[[^\]]*:\d+\]\s*")


class LinkBroken(RuntimeError):
    """The transport failed on a link: what happened, in twinrpc's words, then gloo's own text
    (the gloo error is the ``__cause__``)."""


def link_broken(exc: BaseException) -> BaseException:
    """``exc`` as the link's error: gloo's bare ``RuntimeError`` becomes a :class:`LinkBroken` that says
    what happened to the connection; twinrpc's own errors (a silent peer, a bad frame, a refused
    frame, a shutdown) already say it and are returned as they are."""
    if type(exc) is not RuntimeError:
        return exc
    text = _GLOO_LOCATION.sub("", str(exc))
    low = text.lower()
    if "closed by peer" in low or "reset by peer" in low or "broken pipe" in low or low.startswith("eof"):
        what = "its connection to this worker closed without a close frame (its process exited or died)"
    elif "timed out" in low or "timeout" in low:
        what = "a transfer on its connection to this worker timed out"
    else:
        what = "its connection to this worker failed"
    broken = LinkBroken(f"{what}; gloo said: {text}")
    broken.__cause__ = exc
    return broken


class PeerShutDown(RuntimeError):
    """The peer sent its close frame: it shut down RPC (``graceful``: after completing the graceful
    shutdown protocol, an orderly departure; twinrpc._departure decides what follows)."""

    def __init__(self, graceful: bool) -> None:
        super().__init__("the peer has shut down RPC")
        self.graceful = graceful


class LinkState:
    """Who the link connects, and whether it may still carry messages."""

    __slots__ = ("closed_by_peer", "closing", "failed", "me", "peer", "peer_graceful", "peer_name")

    def __init__(self, me: int, peer: int) -> None:
        self.me = me
        self.peer = peer
        #: how logs and errors name the peer (the world sets "'worker1' (rank 1)")
        self.peer_name = f"rank {peer}"
        #: the error that broke the link (IO error, malformed frame, silence): nothing can be sent any
        #: more (set once, by PeerLink.fail)
        self.failed: BaseException | None = None
        #: the peer sent its close frame (it shut down): calls to it fail, our own close frame may
        #: still go (set by the receiver)
        self.closed_by_peer = False
        #: the peer's close frame said it completed graceful shutdown (set by the receiver)
        self.peer_graceful = False
        #: we are shutting down: receive errors are expected and no longer reported (set by the world,
        #: or by the link closing in reply to its peer)
        self.closing = False
