"""The gloo world: twinrpc's real, multiprocess implementation of ``twinrpc._world.World``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twinrpc._errors import WorkerUnavailableError
from twinrpc._message import Message
from twinrpc._serialize import copy_storages
from twinrpc._world import TimerHandle

from ._link import THREAD_ROLE, PeerLink, make_pair_group
from ._pool import RequestPool
from ._rendezvous import Joined
from ._timer import TimerThread

if TYPE_CHECKING:
    from twinrpc._agent import RpcAgent

_log = logging.getLogger("twinrpc.impl")
_CLOSE_WAIT = 10.0


class GlooWorld:
    """One process's world: links to every peer, a request pool, a timer. Thread-safe."""

    clock_name = "wall-clock"

    def __init__(self, joined: Joined, num_worker_threads: int) -> None:
        self.rank = joined.rank
        self.workers = joined.workers
        self.agent: RpcAgent | None = None
        self._early: list[Message] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._pool = RequestPool(num_worker_threads, f"twinrpc-pool-{self.rank}")
        self._timer = TimerThread(f"twinrpc-timer-{self.rank}")
        self.links: dict[int, PeerLink] = {}
        # Pairs are created in one global order, so no two processes wait on each other in a cycle.
        for peer in range(joined.world_size):
            if peer != self.rank:
                pg = make_pair_group(joined.store, self.rank, peer)
                self.links[peer] = PeerLink(self.rank, peer, pg, self._deliver, self._peer_failed)
        self._store = joined.store
        for link in self.links.values():
            link.start()

    # -- World interface ---------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic()

    def send(self, msg: Message) -> None:
        if msg.dst == self.rank:
            # To ourselves: no network, but still a copy (the callee must not share the caller's objects).
            local = Message(msg.kind, msg.id, msg.src, msg.dst, msg.payload, copy_storages(msg.tensors))
            self._deliver(local)
            return
        link = self.links[msg.dst]
        if THREAD_ROLE.no_blocking_send:
            link.send_later(msg, self._send_failed)
            return
        try:
            link.send(msg)
        except Exception as exc:
            self._send_failed(msg, exc)

    def _send_failed(self, msg: Message, exc: BaseException) -> None:
        agent = self.agent
        if agent is not None:
            agent.on_send_failed(msg, self._unavailable(msg.dst, exc))

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        threading.Thread(target=fn, args=args, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._pool.submit(fn, *args)

    def call_later(self, delay: float, fn: Callable[[], Any]) -> TimerHandle:
        return self._timer.call_later(delay, fn)

    def start(self, agent: RpcAgent) -> None:
        with self._lock:
            self.agent = agent
            early, self._early = self._early, []
        for msg in early:
            agent.on_message(msg)

    def stop(self, graceful: bool = False) -> None:
        """Close every link (peers' receivers for us stop), then stop the pool and timer."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.agent = None
        for link in self.links.values():
            link.closing = True
            link.send_close(graceful)
        deadline = time.monotonic() + _CLOSE_WAIT
        for link in self.links.values():
            if not link.join(max(0.0, deadline - time.monotonic())):
                _log.debug("twinrpc: receiver for rank %d still running at shutdown", link.peer)
            link.closing = True
        self._pool.stop()
        self._timer.stop()

    # -- incoming ----------------------------------------------------------------------------------
    def _deliver(self, msg: Message) -> None:
        agent = self.agent
        if agent is None:
            with self._lock:
                if self.agent is None and not self._stopped:
                    self._early.append(msg)
                    return
                agent = self.agent
            if agent is None:
                return  # arrived after shutdown: dropped
        agent.on_message(msg)

    def _peer_failed(self, peer: int, exc: BaseException) -> None:
        agent = self.agent
        if agent is not None:
            agent.on_peer_failed(peer, self._unavailable(peer, exc))

    def _unavailable(self, peer: int, exc: BaseException) -> WorkerUnavailableError:
        me, other = self.workers[self.rank], self.workers[peer]
        orderly = getattr(exc, "graceful_exit", False)
        why = "It has shut down RPC" if orderly else "Its process has probably died"
        err = WorkerUnavailableError(
            f"worker '{other.name}' (rank {other.id}) is unavailable to {me}: {exc}. {why}; calls to it "
            "fail from now on, other workers keep working"
        )
        err.graceful_exit = orderly  # type: ignore[attr-defined]
        err.__cause__ = exc
        return err
