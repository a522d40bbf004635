"""Where a link is in its life (up, failed, closed by the peer, closing), shared by its parts.

Every part of a ``PeerLink`` (sender, receiver, riders, liveness) holds the one ``LinkState`` and reads
it on its own path; each field is written by one concept (see the field comments). No lock: each
field is a single write, and a reader that sees a stale value finds out on its next step (a send to a
failed link fails in gloo, and reports the link's error).
"""

from __future__ import annotations


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
