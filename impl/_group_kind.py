"""The group's ``kind`` entry (``static`` or ``dynamic``), set by the first worker on a store, as
PyTorch's TensorPipe agent sets its own: a worker of the other kind is refused with PyTorch's
"mixes statically and dynamically initialized members" error.

**Vouched for by a live worker.** With a job key the entry's MAC is the same in every run with that
key, so an entry recorded in an earlier run and written back into this run's store would pass, and
stop every worker of this run with the mixed-group error. So a keyed worker that finds the other kind
raises that error only once a live worker of that kind has answered a fresh challenge (128 random
bits, in the name of the answer, which the answering worker MACs with the job key):

* finding ``dynamic``: the challenge goes to the inbox of every member the store's list names
  (``vouch <challenge>``; impl/_dynamic_group.py), and any member's ``vouched/<challenge>/<uid>``
  vouches for the group;
* finding ``static``: it goes to every rank's link inbox under that group's run key, hashed from the
  ranks' nonces in the store as a static worker does (impl/_link_table.py, impl/_auth.py), and any
  rank's ``vouched/<challenge>/<rank>`` vouches for it.

A group of an earlier run has no live worker to answer, so once none has within ``seconds`` the entry
is refused with an ``AuthenticationError`` that says so, and this worker joins nothing. Without a key
nothing in the store is authenticated, and the entry is taken as found.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from twinrpc._membership import MIXED_GROUP_ERROR

from ._auth import AuthenticationError, JobAuth, refuse_marked
from ._dynamic_group import parse_members, post
from ._link_table import post_ask

#: polling for an answer: first and longest pause between two looks at the store
_POLL_FIRST = 0.005
_POLL_MAX = 0.1


class StaleKindEntry(AuthenticationError):
    """The ``kind`` entry found was vouched for by no live worker (see the module docstring)."""


def mark_kind(store: Any, kind: str, vouch: Callable[[str], bool] | None = None) -> None:
    """Record this group's kind (``static`` or ``dynamic``) unless a worker did already. On the other
    kind, raises PyTorch's error, once ``vouch(found)`` (None: at once) says a live worker of that
    kind answered.

    Raises:
        RuntimeError: PyTorch's mixed-group error.
        AuthenticationError: the group's workers do not share this worker's key (impl/_auth.py), or
            the entry found was vouched for by no live worker (left by, or written back from, an
            earlier run).
    """
    raw = store.compare_set("kind", "", kind)
    refuse_marked(raw, "the group's rendezvous entry 'kind'")
    found = raw.decode()
    if found == kind:
        return
    if vouch is None or vouch(found):
        raise RuntimeError(MIXED_GROUP_ERROR)
    raise StaleKindEntry(
        f"authentication failed: the group's rendezvous entry 'kind' says a {found} group uses this "
        f"store, but no live worker of one answered this worker's challenge: the entry was left by an "
        "earlier run, or recorded in one and written back; it was not used and this worker joined "
        f"nothing. Use a new init_method (a new MASTER_PORT or file), or, if a {found} group is still "
        "starting on this store, start this worker once it has"
    )


def live_dynamic_group(store: Any, seconds: float) -> bool:
    """Whether a member of the dynamic group that the keyed ``store``'s list names answers a fresh
    challenge within ``seconds``."""
    if not store.check(["members"]):
        return False  # a group with no members has nobody to vouch for it
    uids = [m.uid for m in parse_members(store.get("members").decode())]
    challenge = uuid.uuid4().hex
    for uid in uids:
        post(store, uid, f"vouch {challenge}")
    return _answered(lambda: [(store, f"vouched/{challenge}/{uid}") for uid in uids], seconds)


def live_static_group(store: Any, auth: JobAuth, seconds: float) -> bool:
    """Whether a rank of the static group whose nonces the keyed ``store`` holds answers a fresh
    challenge within ``seconds`` (a group still posting its nonces is looked at again as it does)."""
    challenge = uuid.uuid4().hex
    runs: dict[tuple[str, ...], Any] = {}

    def answers() -> list[tuple[Any, str]]:
        nonces: list[str] = []
        while store.check([f"nonce/{len(nonces)}"]):
            nonces.append(store.get(f"nonce/{len(nonces)}").decode())
        if nonces and tuple(nonces) not in runs:
            run = runs[tuple(nonces)] = auth.run_of(store, nonces)
            for rank in range(len(nonces)):
                post_ask(run, rank, f"vouch {challenge}")
        return [(run, f"vouched/{challenge}/{r}") for key, run in runs.items() for r in range(len(key))]

    return _answered(answers, seconds)


def _answered(answers: Callable[[], list[tuple[Any, str]]], seconds: float) -> bool:
    """Poll until one of the ``(store, key)`` pairs ``answers()`` names holds an authenticated answer
    (True), or ``seconds`` pass (False)."""
    deadline = time.monotonic() + seconds
    pause = _POLL_FIRST
    while True:
        for where, key in answers():
            if where.check([key]):
                where.get(key)  # with the key: raises unless a worker of this job wrote it
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)
