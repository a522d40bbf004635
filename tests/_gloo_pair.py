"""Two PeerLinks over a real gloo pair in one process (rank 0 sends, rank 1 listens), for tests of the
gloo world's link layer without starting processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from twinrpc.impl._link import PeerLink, make_pair_group

from twinrpc._message import Message

WAIT = 10.0  # seconds: a bound for things that should take milliseconds


def make_pair_groups(store: Any) -> dict[int, Any]:
    """Both ends (by rank) of a gloo pair group over ``store``, made at once (each waits for the other)."""
    groups: dict[int, Any] = {}

    def make(me: int) -> None:
        groups[me] = make_pair_group(store, me, 1 - me)

    threads = [threading.Thread(target=make, args=(me,)) for me in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    return groups


def make_links(
    on_message: Callable[[Message], None],
    failures: list[BaseException],
    back: Callable[[Message], None] | None = None,
) -> tuple[PeerLink, PeerLink]:
    """Rank 0's link (the sender) and rank 1's (the listener, delivering to ``on_message``) over a
    fresh gloo pair, not started; link failures on either side are appended to ``failures``.
    ``back``: where rank 0 delivers what rank 1 sends it (dropped by default)."""
    groups = make_pair_groups(dist.HashStore())
    sender = PeerLink(0, 1, groups[0], back or (lambda m: None), lambda peer, exc: failures.append(exc))
    listener = PeerLink(1, 0, groups[1], on_message, lambda peer, exc: failures.append(exc))
    return sender, listener


def close_links(*links: PeerLink) -> None:
    """Close both sides (all marked closing first: a close frame reaching a link that is not closing
    is reported as a failure), wait for their receivers, and let their threads and same-host rings go
    as the world's stop does."""
    for link in links:
        link.closing = True
    for link in links:
        link.send_close(deadline=0.0)
    for link in links:
        link.join(WAIT)
    for link in links:
        link.join_threads(WAIT)


class Inbox:
    """The listener's side: records every message delivered, in order."""

    def __init__(self) -> None:
        self.got: list[Message] = []
        self.changed = threading.Condition()

    def __call__(self, msg: Message) -> None:
        with self.changed:
            self.got.append(msg)
            self.changed.notify_all()

    def wait_for(self, n: int) -> list[Message]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.got) >= n, WAIT), [m.describe() for m in self.got]
            return list(self.got)


@contextmanager
def started_links() -> Iterator[tuple[PeerLink, PeerLink, Inbox]]:
    """Both links started, the listener delivering to an :class:`Inbox`; closed at the end, and no
    link may have failed meanwhile."""
    inbox = Inbox()
    failures: list[BaseException] = []
    sender, listener = make_links(inbox, failures)
    sender.start()
    listener.start()
    yield sender, listener, inbox
    close_links(sender, listener)
    assert not failures, failures


def wait_failed(link: PeerLink) -> BaseException:
    """The error ``link`` failed with, once it has (at most WAIT seconds)."""
    deadline = time.monotonic() + WAIT
    while link.failed is None:
        assert time.monotonic() < deadline, "the link did not fail"
        time.sleep(0.005)
    return link.failed


def end_links(*links: PeerLink) -> None:
    """End links at once, whatever state they are in (some failed): all marked closing, their pairs'
    connections closed, their threads joined and their same-host rings given back."""
    for link in links:
        link.closing = True
    for link in links:
        link.abandon()
    for link in links:
        link.join(WAIT)
        link.join_threads(WAIT)  # also gives back the same-host rings (the process has a budget)
