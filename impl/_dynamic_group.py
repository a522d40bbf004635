"""The rendezvous store's part of a dynamic group (LIFE-5): its members, its token, each member's inbox.

The simulator keeps the same things in memory (``simulator/_dynamic_group.py``); the protocol that uses
them is the core's (``twinrpc._membership``). Keys, under the generation's ``twinrpc/<n>/`` prefix:

* ``kind``: ``static`` or ``dynamic``, set by the group's first worker (impl/_group_kind.py).
* ``token``: the membership token, as PyTorch's ``_group_membership_management``: taken with
  ``compare_set("", mine)``, given back by setting it to ``""`` and ``released/<mine>``.
* ``members``: the current members, one ``rank uid name`` line each (written only under the token,
  by a joiner once the members confirmed it, or by a leaver from its own view; deleted, never
  emptied, when the last member leaves).
* ``inbox/<uid>/<n>``: what member ``uid`` must do next; a joiner posts ``join <rank> <uid> <name>``
  to every member, whose world then connects its link to the joiner (GlooWorld.connect_peer), and a
  member posts ``stop`` to its own inbox when its world stops, which ends its watcher. A static
  worker that found this group's ``kind`` posts ``vouch <challenge>``, which the member answers in
  ``vouched/<challenge>/<uid>`` (impl/_group_kind.py).
* ``ready/<joiner uid>/<member uid>``: a member's answer to a join notice: ``dynamic`` and the group's
  members as *that member* knows them (its own view: the list it joined with, the joins and leaves
  it was told of since), in the list's format.
* ``outcome/<uid>``: ``accepted`` once joiner ``uid`` went on with its join (the members that
  answered connect to it), ``refused`` if it refused the list (they connect nothing).

**Bound to this run.** The member list in the store is only what some worker wrote there, and with
a job key its MAC is the same in every run with the same key: a list recorded earlier (in an earlier
run or torchrun attempt, or before the last join or leave) and written back would pass. So a joiner
does not act on the list until every member it names (but those that stopped) has answered: the
joiner's uid (128 fresh random bits) is its challenge, carried in its notices and in the name of each
answer, which the member MACs with the job key over its own view. The joiner refuses the list unless
every answer lists exactly its members, and waits for answers at most the heartbeat timeout: a list
of an earlier run names members whose inboxes no live worker reads, so nobody answers it, and a
rolled-back one is contradicted by the live members' answers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from twinrpc._departure import Departure, departure_error
from twinrpc._errors import RPCError
from twinrpc._worker_info import WorkerInfo

from ._auth import AuthenticationError
from ._stores import next_entry

_log = logging.getLogger("twinrpc.impl")


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


class StoreGroup:
    """One member's handle on its dynamic group's keys (a ``twinrpc._world.GroupMembership``).
    ``keyed``: the store authenticates every value with the job key (impl/_auth.py)."""

    def __init__(self, store: Any, info: WorkerInfo, timeout: timedelta, keyed: bool = False) -> None:
        self.store = store
        self.me = Member(info, uuid.uuid4().hex)
        self.timeout = timeout
        self.keyed = keyed
        self._token = f"{info.name}/{info.id}/{self.me.uid}"
        self._inbox = f"inbox/{self.me.uid}"
        self._next = 1
        #: the other members the list named when this worker joined (add_me)
        self._others: dict[int, Member] = {}
        #: whether this worker is on the store's list (confirm wrote it there)
        self._listed = False
        #: this worker's own view of the group, by rank: what it answers joiners with (see the module
        #: docstring); replaced, never changed in place, under _view_lock
        self._view: dict[int, Member] = {}
        #: the uid of each worker whose join notice the watcher read, by rank (changed() lists it)
        self._joining: dict[int, str] = {}
        self._view_lock = threading.Lock()
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
                    f"the membership token held by {holder.split('/')[0]!r} (joining or leaving; or, if "
                    f"no such worker runs now, a token recorded in an earlier run and written back): {exc}"
                ) from exc

    def unlock(self) -> None:
        self.store.set("token", "")
        self.store.set(f"released/{self._token}", "1")

    # -- members ----------------------------------------------------------------------------------
    def members(self) -> list[Member]:
        """The store's member list, as written (not yet confirmed by anyone: see confirm)."""
        if not self.store.check(["members"]):
            return []
        raw = self.store.get("members").decode()
        if not raw and self.keyed:  # an empty value carries no MAC; no worker writes one
            raise AuthenticationError(
                "authentication failed: the group's rendezvous entry 'members' is empty, which no worker "
                "with the key writes (the last member to leave deletes it); it was not used"
            )
        return _parse(raw)

    def _write(self, members: list[Member]) -> None:
        if members:
            self.store.set("members", _format(members))
        else:
            self.store.delete_key("members")

    def add_me(self) -> list[Member]:
        """Holding the token: check this worker's name and rank are free in the store's list and post
        a join notice to every member it names that did not stop (the challenge: see confirm).
        Returns those members."""
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
        others = [Member(m.info, m.uid, self.store.check([f"stopped/{m.uid}"])) for m in others]
        for m in others:
            if not m.stopped:
                self._post(m.uid, f"join {me.id} {self.me.uid} {me.name}")
        self._others = {m.info.id: m for m in others}
        return others

    def confirm(self, seconds: float) -> None:
        """Holding the token, after add_me: wait until every member the list named (but those that
        stopped) has answered this worker's join notice (its watcher then connects to us), check that
        each answer lists the very members the list named, then put this worker on the list.

        Raises:
            WorkerUnavailableError: a member did not answer within ``seconds``: its process died
                without leaving the group (a crash, or an exit through os._exit), or the list was
                recorded in an earlier run and names workers of that run.
            AuthenticationError (with a job key; else RPCError): an answer lists other members
                than the list: the list was recorded earlier and written back.
        """
        outcome = f"outcome/{self.me.uid}"  # what the members that answered wait for
        try:
            self._confirm(seconds)
        except BaseException:
            with contextlib.suppress(Exception):  # they connect nothing
                self.store.set(outcome, "refused")
            raise
        with self._view_lock:
            self._view = {**self._others, self.me.info.id: self.me}
        self._write(list(self._view.values()))
        self._listed = True
        self.store.set(outcome, "accepted")  # they connect to us now

    def _confirm(self, seconds: float) -> None:
        listed = _format(list(self._others.values()))
        deadline = time.monotonic() + seconds
        for member in sorted(self._others.values(), key=lambda m: m.info.id):
            if member.stopped:
                continue
            key = f"ready/{self.me.uid}/{member.uid}"
            try:
                left = max(deadline - time.monotonic(), 0.001)
                self.store.wait([key], timedelta(seconds=left))
            except RuntimeError as exc:  # a timeout (FileStore raises a plain RuntimeError)
                raise departure_error(
                    member.info,
                    self.me.info,
                    Departure.CRASHED,
                    f"it did not answer this worker's join within {seconds:g} s (it died without leaving "
                    "the group; or, if no such worker runs now, the group's member list naming it was "
                    "recorded in an earlier run and written back)",
                ) from exc
            self._check_answer(member, self.store.get(key).decode(), listed)

    def _check_answer(self, member: Member, answer: str, listed: str) -> None:
        kind, _, view = answer.partition("\n")
        if kind == "dynamic" and _parse(view) == _parse(listed):
            return
        what = (
            f"the group's member list in the store ({_describe(listed)}) is not what "
            f"{member.info.name!r} (rank {member.info.id}), "
            f"a live member answering this join, knows ({_describe(view)} in a group of kind {kind!r}): "
            "the list was recorded earlier (in an earlier run or torchrun attempt, or before the last "
            "join or leave) and written back; this worker did not join"
        )
        if self.keyed:
            raise AuthenticationError(f"authentication failed: {what}")
        raise RPCError(f"RPC group membership: {what}")

    def changed(self, info: WorkerInfo, is_join: bool) -> None:
        """``info`` joined (after its notice reached the watcher) or left: update this worker's view."""
        with self._view_lock:
            view = dict(self._view)
            if not is_join:
                view.pop(info.id, None)
            elif info.id in self._joining:
                view[info.id] = Member(info, self._joining[info.id])
            else:  # no worker of the group tells a join it did not notify: keep the view as it is
                _log.warning("twinrpc: told that %s joined, whose join notice never came", info)
            self._view = view

    def remove(self) -> None:
        """Holding the token: take this worker off the member list: the list becomes this worker's
        own view of the others (not what the store holds, which anyone may have written back). A
        no-op if this worker was never listed."""
        if not self._listed:
            return
        with self._view_lock:
            others = [m for m in self._view.values() if m.uid != self.me.uid]
        self._write(others)
        self._listed = False

    def joiner_went_on(self, notice: JoinNotice) -> bool:
        """On the watcher, after answering ``notice``: wait until its joiner accepted the group's
        list (True: connect to it) or refused it (False), at most the store's timeout (False)."""
        try:
            self._watch_store.wait([f"outcome/{notice.member.uid}"], self.timeout)
            went_on = self._watch_store.get(f"outcome/{notice.member.uid}") == b"accepted"
        except RuntimeError as exc:  # a timeout, or AuthenticationError: not a keyed worker's
            _log.warning(
                "twinrpc: %s never said whether it went on with its join: %s", notice.member.info, exc
            )
            return False
        if not went_on:
            _log.info("twinrpc: %s did not join: it refused the group's member list", notice.member.info)
        return went_on

    def pair_store(self, joiner_uid: str) -> Any:
        """The keys the gloo pairs of one join meet under (unique per joiner incarnation)."""
        return dist.PrefixStore(f"join/{joiner_uid}", self.store)  # type: ignore[attr-defined]

    # -- the inbox --------------------------------------------------------------------------------
    def _post(self, uid: str, entry: str) -> None:
        post(self.store, uid, entry)

    def post_stop(self) -> None:
        """This member's world stops: joiners must not wait for it to connect (a member that leaves
        is off the list already), and its watcher wakes for the last time."""
        self.store.set(f"stopped/{self.me.uid}", "1")
        self._post(self.me.uid, "stop")

    def next_notice(self) -> JoinNotice | None:
        """Block until the next inbox entry; None when it is ``stop``. A join notice is answered
        (``ready/<joiner>/<me>``: this worker's view of the group) before it is returned. With a job
        key, an entry that is not authenticated (not posted by a worker of this job) is logged and
        skipped."""
        while True:
            entry, self._next = next_entry(self._watch_store, self._inbox, self._next)
            if not entry.startswith("vouch "):
                break
            # a worker of a static group found this group's 'kind' entry: a live member says so
            self._watch_store.set(f"vouched/{entry.removeprefix('vouch ')}/{self.me.uid}", "dynamic")
        if entry == "stop":
            return None
        _, rank, uid, name = entry.split(" ", 3)
        with self._view_lock:
            self._joining[int(rank)] = uid
            view = list(self._view.values())
        # the joiner waits for this (confirm): MACed with the job key under a name holding its uid
        self._watch_store.set(f"ready/{uid}/{self.me.uid}", f"dynamic\n{_format(view)}")
        return JoinNotice(Member(WorkerInfo(name, int(rank)), uid), self.pair_store(uid))


def post(store: Any, uid: str, entry: str) -> None:
    """Post ``entry`` to member ``uid``'s inbox (its watcher reads it: StoreGroup.next_notice)."""
    n = int(store.add(f"inbox/{uid}/count", 1))
    store.set(f"inbox/{uid}/{n}", entry)


def parse_members(text: str) -> list[Member]:
    """A ``members`` entry's members (in the list's format)."""
    return _parse(text)


def _format(members: list[Member]) -> str:
    return "\n".join(f"{m.info.id} {m.uid} {m.info.name}" for m in sorted(members, key=lambda m: m.info.id))


def _parse(text: str) -> list[Member]:
    out = []
    for line in text.splitlines():
        rank, uid, name = line.split(" ", 2)
        out.append(Member(WorkerInfo(name, int(rank)), uid))
    return sorted(out, key=lambda m: m.info.id)


def _describe(text: str) -> str:
    members = _parse(text)
    if not members:
        return "no members"
    return ", ".join(f"{m.info.name!r} (rank {m.info.id}, incarnation {m.uid[:8]})" for m in members)
