"""Peer departures, decided once for both worlds (SHUT-3, SHUT-6, ERR-7).

A world observes that a peer is gone and says how (:class:`Departure`): the peer announced that it
shut down RPC (gloo's close frame; the simulator's announcement, sent with the network's delay), its
connection broke (a crash), or it fell silent for longer than the heartbeat bound. Everything that
follows is the core's: the one error text (:func:`departure_error`), which calls and collectives fail
(``RpcAgent.on_peer_failed``), and that a worker that has left sends nothing more (``RpcAgent``
drops the replies of handlers still running after ``finalize``; each world drops sends after
``stop``).
"""

from __future__ import annotations

import enum

from ._errors import WorkerUnavailableError
from ._worker_info import WorkerInfo

__all__ = ["Departure", "departure_error", "relayed_departure"]


class Departure(enum.Enum):
    """How a peer left, as a world observed it."""

    #: it completed the graceful shutdown protocol (every worker passed the final join, or a dynamic
    #: member left its group): an orderly departure, which fails no collective
    LEFT = "left"
    #: it shut down RPC without completing a graceful shutdown (``shutdown(graceful=False)``, or a
    #: graceful shutdown that failed): calls to it and collectives that need it fail
    SHUT_DOWN = "shut down"
    #: its connection broke (its process died)
    CRASHED = "crashed"
    #: nothing came from it for longer than the heartbeat bound (stopped, hung or cut off)
    SILENT = "silent"
    #: a frame on its link failed the job key's check (the gloo world with a key): nothing more from
    #: that link can be trusted, whoever sent it
    REFUSED = "refused"

    @property
    def orderly(self) -> bool:
        """The peer completed a graceful shutdown: its departure is not a failure."""
        return self is Departure.LEFT

    @property
    def shut_down(self) -> bool:
        """The peer itself shut down RPC (it announced it), as opposed to dying or going silent."""
        return self is Departure.LEFT or self is Departure.SHUT_DOWN


#: what the core says happened, for the departures it knows all about (no transport detail needed)
_SHUTDOWN_CAUSE = {
    Departure.LEFT: "its graceful shutdown completed",
    Departure.SHUT_DOWN: "it shut down RPC without completing a graceful shutdown",
}


def departure_error(
    peer: WorkerInfo | int, me: WorkerInfo | str, departure: Departure, detail: str = ""
) -> WorkerUnavailableError:
    """The error calls to a departed ``peer`` fail with on ``me``: the one place its text is built.

    The text names the peer in quotes with its rank and "is unavailable" (ERR-7), says why (``detail``,
    the world's transport words for a crash or silence; for a shutdown the core's own words),
    then "It has shut down RPC" for a shutdown, what failed for a link refused by authentication, or
    "Its process has probably died" for a crash or silence, and what follows for the caller.

    Args:
        peer: the departed worker (its rank when this worker never knew its name).
        me: this worker.
        departure: how it left.
        detail: the world's words for a crash or silence; empty for a shutdown, which the core
            describes itself (so both worlds say the same).
    """
    who = f"'{peer.name}' (rank {peer.id})" if isinstance(peer, WorkerInfo) else f"of rank {peer}"
    cause = detail or _SHUTDOWN_CAUSE.get(departure) or departure.value
    if departure.shut_down:
        verdict = "It has shut down RPC"
    elif departure is Departure.REFUSED:
        verdict = "Its link failed this job's authentication (a peer without the job's key, or tampering)"
    else:
        verdict = "Its process has probably died"
    err = WorkerUnavailableError(
        f"worker {who} is unavailable to {me}: {cause}. {verdict}; calls to it fail from now on, other "
        "workers keep working"
    )
    err.departure = departure
    return err


def relayed_departure(text: str, departure: str | None, relay: str | None = None) -> WorkerUnavailableError:
    """A departure error raised again: a fresh instance for each waiter, with the first error's
    ``text`` (so every worker names the departed worker in the same words) and ``departure`` (a
    :class:`Departure` value; None if unknown). ``relay``: who passed it on (the shutdown leader that
    aborted a collective because of it), for a worker that did not see the departure itself."""
    err = WorkerUnavailableError(text if relay is None else f"{relay} aborted _all_gather: {text}")
    err.departure = Departure(departure) if departure is not None else None
    return err
