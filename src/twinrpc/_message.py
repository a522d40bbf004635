"""The one message type both worlds carry.

A message has a kind, an id, a source and destination rank, a pickled payload and a list of tensors
(each a flat ``uint8`` view of one storage) that travel out of band: the real world sends them as gloo
buffers, the simulator copies them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Kind(enum.IntEnum):
    """What a message is. Requests are answered by RESPONSE or EXCEPTION carrying the same id."""

    CALL = 1  # run a function, reply with its result
    REMOTE_CALL = 2  # run a function, keep its result in an OwnerRRef, reply with an ack
    RREF_FETCH = 3  # to_here(): reply with a copy of the owner's value
    RREF_USER_DELETE = 4  # a UserRRef died (G1)
    RREF_FORK_REQUEST = 5  # a user forked a user: register the child with the owner
    RREF_CHILD_ACCEPT = 6  # the owner knows the child: the parent may die (G2)
    RREF_TYPE = 7  # _get_type(): the type of the owner's value
    RESPONSE = 10
    EXCEPTION = 11
    GATHER = 20  # follower -> leader: my contribution to a named all-gather (shutdown barrier, join)
    SCATTER = 21  # leader -> followers: the all-gather's result
    GRADIENT = 30  # distributed autograd: gradients for a send function
    CONTEXT_CLEANUP = 31  # distributed autograd: release a context (a control message, acked)
    HEARTBEAT = 40  # gloo world only: "I am alive" on an idle link; never reaches the agent


REQUEST_KINDS = frozenset(
    {
        Kind.CALL,
        Kind.REMOTE_CALL,
        Kind.RREF_FETCH,
        Kind.RREF_USER_DELETE,
        Kind.RREF_FORK_REQUEST,
        Kind.RREF_CHILD_ACCEPT,
        Kind.RREF_TYPE,
        Kind.GRADIENT,
        Kind.CONTEXT_CLEANUP,
    }
)
RREF_CONTROL_KINDS = frozenset({Kind.RREF_USER_DELETE, Kind.RREF_FORK_REQUEST, Kind.RREF_CHILD_ACCEPT})
#: what the control channel sends (resent until acked, handled once: twinrpc._rref_context)
CONTROL_KINDS = RREF_CONTROL_KINDS | {Kind.CONTEXT_CLEANUP}


@dataclass(slots=True)
class Message:
    """One message between two workers (``src`` and ``dst`` are ranks)."""

    kind: Kind
    id: int
    src: int
    dst: int
    payload: bytes
    tensors: list[torch.Tensor] = field(default_factory=list)
    #: a hint to the world, not sent: nothing waits on this message soon (e.g. a context's release), so
    #: it may wait briefly to travel with the next message to ``dst`` (the gloo world's riders; the
    #: simulator sends it as any other, so traces do not depend on it). Order per link is kept.
    deferrable: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: payload plus tensor data (what bandwidth is charged for)."""
        tensors = self.tensors
        return len(self.payload) + (sum(t.numel() for t in tensors) if tensors else 0)

    def describe(self) -> str:
        return f"{self.kind.name}#{self.id} {self.src}->{self.dst} ({self.nbytes} B)"
