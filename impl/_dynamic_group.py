"""The rendezvous store's part of a dynamic group (LIFE-5): its members, its token, each member's inbox.

The simulator keeps the same things in memory (``simulator/_dynamic_group.py``); the protocol that uses
them is the core's (``twinrpc._membership``). Keys, under the generation's ``twinrpc/<n>/`` prefix:

* ``kind``: ``static`` or ``dynamic``, set by the group's first worker; a worker of the other kind is
  refused with PyTorch's "mixes statically and dynamically initialized members" error.
* ``token``: the membership token, as PyTorch's ``_group_membership_management``: taken with
  ``compare_set("", mine)``, given back by setting it to ``""`` and ``released/<mine>``.
* ``members``: the current members, one ``rank name uid`` line each (changed only under the token).
* ``inbox/<uid>/<n>``: what member ``uid`` must do next; a joiner posts ``join <rank> <uid> <name>``
  to every member, whose world then connects its link to the joiner (GlooWorld.connect_peer), and a
  member posts ``stop`` to its own inbox when its world stops, which ends its watcher.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from twinrpc._departure import Departure, departure_error
from twinrpc._membership import MIXED_GROUP_ERROR
from twinrpc._worker_info import WorkerInfo

from ._auth import refuse_marked
from ._stores import next_entry


@dataclass(frozen=True, slots=True)
class Member:
    info: WorkerInfo
    #: this incarnation's id: a rank may be taken again by a later worker once its holder left
    uid: str
    #: its world stopped without leaving the group (shutdown(graceful=False), or exit without shutdown)
    stopped: bool = False


@dataclass(frozen=True, slots=True)
class JoinNotice:
    """An inbox entry: ``member`` joined; connect to it over ``pair_store``."""

    member: Member
    pair_store: Any


def mark_kind(store: Any, kind: str) -> None:
    """Record this group's kind (``static`` or ``dynamic``); raises PyTorch's error on a mix, and
    AuthenticationError if the group's workers do not share this worker's key (impl/_auth.py)."""
    raw = store.compare_set("kind", "", kind)
    refuse_marked(raw, "the group's rendezvous entry 'kind'")
    found = raw.decode()
    if found != kind:
        raise RuntimeError(MIXED_GROUP_ERROR)


class StoreGroup:
    """One member's handle on its dynamic group's keys (a ``twinrpc._world.GroupMembership``)."""

    def __init__(self, store: Any, info: WorkerInfo, timeout: timedelta) -> None:
        self.store = store
        self.me = Member(info, uuid.uuid4().hex)
        self.timeout = timeout
        self._token = f"{info.name}/{info.id}/{self.me.uid}"
        self._inbox = f"inbox/{self.me.uid}"
        self._next = 1
        #: the other members when this worker joined (add_me)
        self._others: dict[int, Member] = {}
        #: the watcher's own connection: a TCPStore client serves one request at a time, so a wait
        #: for the next inbox entry on the shared one would block every other use of the store
        self._watch_store = store.clone()

    # -- the token --------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the membership token, waiting while another worker joins or leaves."""
        while True:
            holder = self.store.compare_set("token", "", self._token).decode()
            if holder == self._token:
                return
            try:
                self.store.wait([f"released/{holder}"], self.timeout)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"RPC group membership: {self.me.info} waited {self.timeout.total_seconds():g} s for "
                    f"the membership token held by {holder.split('/')[0]!r} (joining or leaving): {exc}"
                ) from exc

    def unlock(self) -> None:
        self.store.set("token", "")
        self.store.set(f"released/{self._token}", "1")

    # -- members ----------------------------------------------------------------------------------
    def members(self) -> list[Member]:
        if not self.store.check(["members"]):
            return []
        out = []
        for line in self.store.get("members").decode().splitlines():
            rank, uid, name = line.split(" ", 2)
            out.append(Member(WorkerInfo(name, int(rank)), uid))
        return out

    def _write(self, members: list[Member]) -> None:
        self.store.set("members", "\n".join(f"{m.info.id} {m.uid} {m.info.name}" for m in members))

    def add_me(self) -> list[Member]:
        """Holding the token: check this worker's name and rank are free, list it, and post a join
        notice to every other member. Returns the others."""
        others = self.members()
        me = self.me.info
        for m in others:
            if m.info.name == me.name:
                raise RuntimeError(
                    f"RPC worker name {me.name} is not unique. Workers {me.id} and {m.info.id} share the "
                    "same name."
                )
            if m.info.id == me.id:
                raise RuntimeError(
                    f"RPC worker id {me.id} is not unique. Worker {m.info.name} already has id {me.id}, so "
                    f"{me.name} cannot be added."
                )
        self._next = int(self.store.add(f"{self._inbox}/count", 0)) + 1
        self._write([*others, self.me])
        others = [Member(m.info, m.uid, self.store.check([f"stopped/{m.uid}"])) for m in others]
        for m in others:
            if not m.stopped:
                self._post(m.uid, f"join {me.id} {self.me.uid} {me.name}")
        self._others = {m.info.id: m for m in others}
        return others

    def wait_ready(self, rank: int, seconds: float) -> None:
        """Wait until member ``rank`` has read this worker's join notice (it then connects to us).

        Raises:
            WorkerUnavailableError: no answer within ``seconds``: its process died without leaving
                the group (a crash, or an exit through os._exit), so it cannot connect.
        """
        member = self._others[rank]
        try:
            self.store.wait([f"ready/{self.me.uid}/{member.uid}"], timedelta(seconds=seconds))
        except RuntimeError as exc:  # a timeout (FileStore raises a plain RuntimeError)
            raise departure_error(
                member.info,
                self.me.info,
                Departure.CRASHED,
                f"it did not answer this worker's join within {seconds:g} s (it died without leaving the group)",
            ) from exc

    def remove(self) -> None:
        """Holding the token: take this worker off the member list."""
        self._write([m for m in self.members() if m.uid != self.me.uid])

    def pair_store(self, joiner_uid: str) -> Any:
        """The keys the gloo pairs of one join meet under (unique per joiner incarnation)."""
        return dist.PrefixStore(f"join/{joiner_uid}", self.store)  # type: ignore[attr-defined]

    # -- the inbox --------------------------------------------------------------------------------
    def _post(self, uid: str, entry: str) -> None:
        n = int(self.store.add(f"inbox/{uid}/count", 1))
        self.store.set(f"inbox/{uid}/{n}", entry)

    def post_stop(self) -> None:
        """This member's world stops: joiners must not wait for it to connect (a member that leaves
        is off the list already), and its watcher wakes for the last time."""
        self.store.set(f"stopped/{self.me.uid}", "1")
        self._post(self.me.uid, "stop")

    def next_notice(self) -> JoinNotice | None:
        """Block until the next inbox entry; None when it is ``stop``. With a job key, an entry that is
        not authenticated (not posted by a worker of this job) is logged and skipped."""
        entry, self._next = next_entry(self._watch_store, self._inbox, self._next)
        if entry == "stop":
            return None
        _, rank, uid, name = entry.split(" ", 3)
        self._watch_store.set(f"ready/{uid}/{self.me.uid}", "1")  # the joiner waits for this (wait_ready)
        return JoinNotice(Member(WorkerInfo(name, int(rank)), uid), self.pair_store(uid))
