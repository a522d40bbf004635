"""Process backends: worker programs run in real ``spawn``-started processes, one per rank.

:class:`ProcessBackend` is the machinery behind the built-in ``torch`` (upstream PyTorch, the oracle)
and ``gloo`` (twinrpc's real world) backends, and the base for a third-party implementation that runs
in real processes: subclass it, set ``name`` and ``context`` (a
:class:`~conformance.harness.ProcessContext` subclass naming the implementation's modules), done.

Cost model. Starting an interpreter that imports torch costs ~1-2 s, far too much per test, so:

* ``run`` uses a POOL per world size: N long-lived children that called ``init_rpc`` once and then
  execute programs sent over pipes. A call costs a few milliseconds. Pools live until session end
  (a least-recently-used pool is closed when too many processes would be alive).
* ``spawn`` needs fresh processes, but they are taken from a few SPARES: children that already
  imported torch and wait for their first message. Spares are refilled after each spawn, so their
  start-up overlaps with the next test instead of delaying this one.
* Children are forked by a FORKSERVER that imported torch and the implementation's modules once
  (``multiprocessing``'s ``forkserver`` start method, preloaded), so a child starts without importing
  anything (a new interpreter importing torch took 3.4-4 s of CPU on a loaded 2-core machine, and
  every pool and every ``spawn`` needs new children). A child is still a new process that never ran
  pytest or any program, and it takes the pytest process's current environment. ``TWINRPC_HARNESS_START=spawn`` starts
  every child as a new interpreter instead (to rule the forkserver out).

Every wait is bounded: past the deadline the hung ranks dump their stacks (SIGUSR1 + faulthandler),
the world's processes are SIGKILLed, the test fails with the stacks in its message, and the next test
gets a new pool. Children also exit by themselves when the pytest process disappears.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, ClassVar

from . import child as _child
from .backend import Backend, BackendConfig, WorkerProgram, fail_world
from .child import ProcessContext

__all__ = ["DEATH_GRACE", "MAX_POOLED_PROCESSES", "SHUTDOWN_BOUND", "ProcessBackend"]

#: Above this many pooled processes, the least recently used pool is shut down before starting another.
#: 10 keeps a pool of every world size the suite uses (1 to 4) started: the generated plans of
#: test_dist_autograd.py and test_dist_optim.py alternate sizes 2, 3 and 4, and with 8 each example of
#: another size restarted a pool (7 starts, ~70 of the 98 s of one such test on gloo; 3 with 10).
#: A pooled process holds ~215 MB.
MAX_POOLED_PROCESSES = 10
#: How long session teardown waits for a graceful ``rpc.shutdown()`` of a pool before killing it.
SHUTDOWN_BOUND = 15.0
#: After a rank died, how long the surviving ranks get to notice and finish before they are killed.
DEATH_GRACE = 10.0
#: How children start (module docstring): "forkserver" (default) or "spawn".
START_METHOD_ENV = "TWINRPC_HARNESS_START"


def _start_context(context: type[ProcessContext]) -> Any:
    """The multiprocessing context children start from: a forkserver that preloaded what they import.

    The forkserver is one per pytest process; its preload list is fixed when it starts (the first
    child of the first process backend): a backend used later in the same process still works, its
    children import their own modules.
    """
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use forkserver or spawn")
    mp = multiprocessing.get_context(method)
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", _child.__name__, *context.MODULES.values()])
    return mp


@dataclass(eq=False)
class _Worker:
    """One child process and the parent's end of its pipe."""

    process: BaseProcess
    conn: Connection
    stack_path: Path

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()

    def dump_stacks(self) -> str:
        """Ask a (hung) child for all its threads' stacks via faulthandler; '' if it cannot answer."""
        if not self.alive() or self.pid is None:
            return ""
        try:
            start = self.stack_path.stat().st_size
            os.kill(self.pid, signal.SIGUSR1)
        except OSError:
            return ""
        deadline = time.monotonic() + 2.0
        text, last_size = "", -1
        while time.monotonic() < deadline:
            time.sleep(0.1)
            size = self.stack_path.stat().st_size
            if size > start and size == last_size:  # stopped growing: dump complete
                break
            last_size = size
        with self.stack_path.open() as f:
            f.seek(start)
            text = f.read()
        return text


@dataclass(eq=False)
class _Pool:
    """A started world of ``world_size`` ranks serving ``call`` messages."""

    world_size: int
    workers: list[_Worker]
    broken: bool = False

    def healthy(self) -> bool:
        return not self.broken and all(w.alive() for w in self.workers)

    def kill(self) -> None:
        for worker in self.workers:
            worker.kill()


@dataclass
class _Replies:
    """What came back from one round of messages."""

    replies: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    dead: dict[int, int | None] = field(default_factory=dict)  # rank -> exit code
    hung: list[int] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)


class ProcessBackend(Backend):
    """Runs programs in real processes: pooled worlds for ``run``, warm spares for ``spawn``.

    Subclasses set two class attributes::

        class MyBackend(ProcessBackend):
            name = "mine"
            context = MyContext  # a ProcessContext subclass: MODULES and, if needed, options hooks

    Every rank is a child process running :func:`conformance.harness.child.main`; programs and
    results travel over pipes (pickled), rendezvous are ``file://`` paths under
    ``config.tmp_dir``, and every wait is bounded by the call's ``timeout`` (see the module docstring).
    """

    #: The ``ctx`` class the worker processes build; it also decides which modules they serve.
    context: ClassVar[type[ProcessContext]]

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._mp = _start_context(self.context)
        self._pools: OrderedDict[int, _Pool] = OrderedDict()  # LRU order: last = most recently used
        self._spares: list[_Worker] = []
        self._spares_wanted = 0
        self._ids = itertools.count()
        self._dir = config.tmp_dir / self.name
        self._dir.mkdir(parents=True, exist_ok=True)
        #: (world_size, seconds) for every pool start: reported by the plugin, read by the harness tests.
        self.pool_starts: list[tuple[int, float]] = []

    # -- processes -----------------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        n = next(self._ids)
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        stack_path = self._dir / f"stacks-{n}.txt"
        stack_path.touch()
        process = self._mp.Process(
            target=_child.main,
            args=(child_conn, os.getpid(), str(stack_path), self.context, self.name, dict(os.environ)),
            name=f"twinrpc-{self.name}-{n}",
            daemon=True,  # multiprocessing's atexit handler terminates it if close() never ran
        )
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn, stack_path)

    def _take_workers(self, n: int) -> list[_Worker]:
        self._spares = [w for w in self._spares if w.alive()]
        taken, self._spares = self._spares[:n], self._spares[n:]
        return taken + [self._start_worker() for _ in range(n - len(taken))]

    def _refill_spares(self) -> None:
        self._spares = [w for w in self._spares if w.alive()]
        while len(self._spares) < self._spares_wanted:
            self._spares.append(self._start_worker())

    # -- one round of messages -------------------------------------------------------------------------

    def _exchange(
        self,
        workers: Mapping[int, _Worker],
        messages: Mapping[int, bytes],
        timeout: float,
        expect_dead: frozenset[int] = frozenset(),
    ) -> _Replies:
        """Send ``messages[rank]`` to each worker and collect one reply each, within ``timeout`` s.

        A process that exits without replying is recorded in ``dead`` (the others then get
        DEATH_GRACE to finish, unless the rank is in ``expect_dead``: a planned death leaves the
        survivors the whole ``timeout``); ranks still silent at the deadline are recorded in ``hung``
        with their stacks. The caller decides what to kill.
        """
        out = _Replies()
        for rank, message in messages.items():
            try:
                workers[rank].conn.send_bytes(message)
            except OSError:
                out.dead[rank] = workers[rank].process.exitcode
        pending = {rank for rank in messages if rank not in out.dead}
        deadline = time.monotonic() + timeout
        if set(out.dead) - expect_dead:
            deadline = min(deadline, time.monotonic() + DEATH_GRACE)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables: dict[Any, int] = {}
            for rank in pending:
                waitables[workers[rank].conn] = rank
                waitables[workers[rank].process.sentinel] = rank
            for ready in wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                worker = workers[rank]
                try:
                    # A finished "once" child replies and exits: read the reply before declaring death.
                    if worker.conn.poll():
                        out.replies[rank] = pickle.loads(worker.conn.recv_bytes())
                        pending.discard(rank)
                        continue
                except EOFError:
                    pass
                except Exception as exc:  # reply that cannot be unpickled in the parent
                    out.replies[rank] = (
                        "harness",
                        f"rank {rank}'s reply could not be unpickled: {exc!r}",
                        False,
                    )
                    pending.discard(rank)
                    continue
                if not worker.alive() or ready is worker.conn:
                    worker.process.join(timeout=1)
                    out.dead[rank] = worker.process.exitcode
                    pending.discard(rank)
                    if rank not in expect_dead:
                        deadline = min(deadline, time.monotonic() + DEATH_GRACE)
        out.hung = sorted(pending)
        for rank in out.hung:
            out.stacks[rank] = workers[rank].dump_stacks()
        return out

    @staticmethod
    def _describe_exit(code: int | None) -> str:
        if code is None:
            return "exited"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def _fail_for(self, out: _Replies, what: str, timeout: float, consequence: str) -> None:
        """fail_world() if the round had dead or hung ranks; otherwise return."""
        __tracebackhide__ = True
        if not out.dead and not out.hung:
            return
        lines = [f"{what} on the {self.name} backend:"]
        for rank, code in sorted(out.dead.items()):
            lines.append(f"  rank {rank} (worker{rank}) {self._describe_exit(code)} before replying")
        if out.hung:
            lines.append(
                f"  ranks {out.hung} did not finish within {timeout:g} s "
                "(raise it with --world-timeout, or world.run(..., timeout=...))"
            )
        lines.append(consequence)
        for rank, stacks in sorted(out.stacks.items()):
            lines.append(f"\n--- stacks of rank {rank} at the deadline ---\n{stacks.strip() or '(no dump)'}")
        fail_world("\n".join(lines))

    # -- pools ---------------------------------------------------------------------------------------------

    def _close_pool(self, pool: _Pool, bound: float) -> None:
        """Shut a pool's RPC down gracefully within ``bound`` seconds, then kill whatever is left."""
        if pool.healthy():
            message = pickle.dumps(("shutdown", {}, b""))
            workers = dict(enumerate(pool.workers))
            self._exchange(workers, dict.fromkeys(workers, message), bound)
        pool.kill()

    def _pool(self, world_size: int, timeout: float) -> _Pool:
        __tracebackhide__ = True
        pool = self._pools.pop(world_size, None)
        if pool is not None and not pool.healthy():
            pool.kill()
            pool = None
        if pool is None:
            while (
                self._pools
                and sum(p.world_size for p in self._pools.values()) + world_size > MAX_POOLED_PROCESSES
            ):
                _, oldest = self._pools.popitem(last=False)
                self._close_pool(oldest, bound=5.0)
            pool = self._start_pool(world_size, timeout)
        self._pools[world_size] = pool
        return pool

    def _start_pool(self, world_size: int, timeout: float) -> _Pool:
        __tracebackhide__ = True
        started = time.monotonic()
        workers = self._take_workers(world_size)
        pool = _Pool(world_size, workers)
        pool_dir = self._dir / f"pool-{next(self._ids)}"
        pool_dir.mkdir()
        header = {"world_size": world_size, "init_method": f"file://{pool_dir}/rendezvous"}
        messages = {r: pickle.dumps(("serve", {**header, "rank": r}, b"")) for r in range(world_size)}
        try:
            out = self._exchange(dict(enumerate(workers)), messages, timeout)
            self._fail_for(out, f"starting a pool of {world_size} ranks", timeout, "The pool was killed.")
            errors = [
                f"rank {r}: {reply[1]!r}" for r, reply in sorted(out.replies.items()) if reply[0] != "ready"
            ]
            if errors:
                fail_world(
                    f"starting a {self.name} pool of {world_size} ranks failed in init_rpc:\n"
                    + "\n".join(errors)
                )
        except BaseException:
            pool.kill()
            raise
        self.pool_starts.append((world_size, time.monotonic() - started))
        return pool

    # -- the Backend interface -----------------------------------------------------------------------

    @staticmethod
    def _payload(fn: WorkerProgram, args: tuple[Any, ...]) -> bytes:
        __tracebackhide__ = True
        try:
            return pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            fail_world(
                f"cannot send {fn!r} with args {args!r} to worker processes: {type(exc).__name__}: {exc}"
            )

    def _call_dir(self, kind: str) -> str:
        return str(self._dir / f"{kind}-{next(self._ids)}")

    @staticmethod
    def _results(replies: Mapping[int, tuple[Any, ...]], world_size: int) -> list[Any]:
        """Turn replies into the per-rank result list, re-raising the first worker exception."""
        __tracebackhide__ = True
        harness = [f"rank {r}: {reply[1]}" for r, reply in sorted(replies.items()) if reply[0] == "harness"]
        if harness:
            fail_world("the harness could not run the program:\n" + "\n".join(harness))
        values: list[Any] = [None] * world_size
        errors: list[tuple[int, BaseException, str]] = []
        for rank, reply in sorted(replies.items()):
            if reply[0] == "ok":
                values[rank] = reply[1]
            else:
                errors.append((rank, reply[1], reply[2]))
        if errors:
            rank, first, tb = errors[0]
            first.add_note(
                f"[twinrpc harness] raised on rank {rank} (worker{rank}); its traceback there:\n{tb}"
            )
            for other_rank, other, _ in errors[1:]:
                first.add_note(
                    f"[twinrpc harness] rank {other_rank} raised too: {type(other).__name__}: {other}"
                )
            raise first
        return values

    def run(
        self,
        fn: WorkerProgram,
        args: tuple[Any, ...],
        *,
        world_size: int,
        ranks: Sequence[int],
        timeout: float,
    ) -> list[Any]:
        __tracebackhide__ = True
        payload = self._payload(fn, args)
        pool = self._pool(world_size, timeout)
        base = {"world_size": world_size, "base_dir": self._call_dir("call"), "sys_path": list(sys.path)}
        messages = {r: pickle.dumps(("call", {**base, "rank": r}, payload)) for r in ranks}
        try:
            out = self._exchange(dict(enumerate(pool.workers)), messages, timeout)
        except BaseException:
            pool.kill()  # interrupted mid-round (e.g. pytest-timeout): replies would be out of step
            raise
        if out.dead or out.hung:
            pool.kill()
            self._fail_for(
                out,
                f"world.run({fn.__qualname__})",
                timeout,
                "The pool was killed; the next test gets a new one.",
            )
        if any(not reply[-1] or reply[0] == "harness" for reply in out.replies.values()):
            # The program shut RPC down on some rank, or the harness itself stumbled: rebuild the pool
            # before the next test rather than trust its state.
            pool.broken = True
        return self._results(out.replies, world_size)

    def spawn(
        self,
        fn: WorkerProgram,
        args: tuple[Any, ...],
        *,
        world_size: int,
        timeout: float,
        expect_dead: frozenset[int] = frozenset(),
    ) -> list[Any]:
        __tracebackhide__ = True
        payload = self._payload(fn, args)
        self._spares_wanted = self.config.spares  # spawn tests come in runs: keep the next ones warm
        workers = dict(enumerate(self._take_workers(world_size)))
        base = {"world_size": world_size, "base_dir": self._call_dir("spawn"), "sys_path": list(sys.path)}
        messages = {r: pickle.dumps(("once", {**base, "rank": r}, payload)) for r in workers}
        try:
            out = self._exchange(workers, messages, timeout, expect_dead)
        finally:
            for worker in workers.values():
                worker.kill()  # replied children are exiting already; this reaps them or kills hung ones
            self._refill_spares()
        what = f"world.spawn({fn.__qualname__})"
        # A planned death is ctx.crash(): SIGKILL. Any other end of an expect_dead rank is reported.
        for rank in sorted(expect_dead & set(out.dead)):
            if out.dead[rank] == -signal.SIGKILL:
                del out.dead[rank]
        self._fail_for(out, what, timeout, "Its processes were killed.")
        values = self._results(out.replies, world_size)
        survived = sorted(r for r in expect_dead if r in out.replies)
        if survived:
            got = {r: values[r] for r in survived}
            fail_world(f"{what}: ranks {survived} were expected to die (expect_dead) but returned {got!r}")
        return values

    def warm_up(self) -> None:
        """Start two interpreters importing the implementation now, so the first pool finds them warm."""
        if not self._spares and not self._pools:
            self._spares = [self._start_worker() for _ in range(2)]

    def close(self) -> None:
        """Shut every pool down gracefully (bounded), release the spares, kill anything left."""
        pools, self._pools = list(self._pools.values()), OrderedDict()
        healthy = [p for p in pools if p.healthy()]
        message = pickle.dumps(("shutdown", {}, b""))
        workers: dict[int, _Worker] = {}
        for pool in healthy:  # all pools shut down concurrently: one bound for the whole teardown
            for worker in pool.workers:
                workers[len(workers)] = worker
        if workers:
            self._exchange(workers, dict.fromkeys(workers, message), SHUTDOWN_BOUND)
        for pool in pools:
            pool.kill()
        spares, self._spares = self._spares, []
        for spare in spares:
            spare.conn.close()  # EOF tells a waiting spare to exit
        for spare in spares:
            spare.process.join(timeout=5)
            spare.kill()
