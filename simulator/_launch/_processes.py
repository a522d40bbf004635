"""Simulated processes: the main process of each worker, and the ones it starts with multiprocessing.

PyTorch's RPC examples start their workers with ``torch.multiprocessing.spawn`` or
``mp.Process(...).start()``/``join()`` (the parameter-server tutorial starts its server or trainer that
way inside each rank's process). While a program runs under ``python -m twinrpc.simulator run``,
``multiprocessing.process.BaseProcess.start`` called from a simulated process starts a simulated one
instead of an OS process; ``join``, ``is_alive``, ``exitcode``, ``pid``, ``terminate`` and ``kill``
work on it through the ``Popen`` object the process holds.

What a simulated child process gets, by start method:

- ``fork`` (Python's default on Linux for ``multiprocessing.Process``): the parent's program modules
  (shared, not copied: state the parent and child both change after the start is seen by both, the
  one difference from a real fork), a copy of its environment, ``sys.argv`` and its output streams.
- ``spawn``/``forkserver`` (``torch.multiprocessing.spawn``'s default): fresh program modules, the
  program file run again as ``__mp_main__``, and the process object (target and arguments) pickled
  in the parent and unpickled in the child, as real spawning does.

A child starts on its parent's worker, with no RPC agent. Its ``init_rpc`` makes it the worker of
the rank it asks for (``rank=``, or ``RANK`` in its environment), which the simulation adds if it has
fewer workers (:meth:`~twinrpc.simulator.Simulation.add_worker`): so ``mp.spawn(fn, nprocs=W)`` under
``--nproc-per-node 1`` gives W workers, and each spawn after it is a new world, meeting in the
simulated store's next open round (:meth:`~twinrpc.simulator._rendezvous.Rendezvous.open_round`).
The process that called ``init_rpc`` owns the worker's RPC agent; when it exits without
``rpc.shutdown()``, or is killed, the worker crashes (:meth:`~twinrpc.simulator.Simulation.crash`):
its peers see the connection close, as they would when a real process dies.

multiprocessing's own globals (start method, ``current_process()``, the numbering of processes,
``active_children()``) are each process's (:mod:`._program`); ``torch.multiprocessing.spawn`` and
``start_processes`` are replaced by :func:`_start_processes`, which raises torch's
``ProcessRaisedException``/``ProcessExitedException`` for the first child to fail.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import pickle
import signal
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import greenlet
import torch.multiprocessing as tmp
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from twinrpc._current import CURRENT_SLOT, WorkerSlot
from twinrpc._world import TimerHandle

from ._program import (
    IMAGE,
    ProcessImage,
    ProcessImages,
    RecordingEnviron,
    exec_main,
    main_process,
    new_process_state,
    run_process,
)
from ._random_state import ProcessRandom

if TYPE_CHECKING:
    from .._kernel._scheduler import Task
    from .._simulation import Simulation
    from .._world import SimWorker

#: the launcher of the program run in progress (one at a time per interpreter)
_LAUNCHER: ProcessLauncher | None = None


class SimPopen:
    """The ``Popen`` of a simulated process (what ``Process._popen`` holds)."""

    method = "simulated"

    def __init__(self, launcher: ProcessLauncher, image: ProcessImage, daemon: bool) -> None:
        self.launcher = launcher
        self.image = image
        self.pid = image.pid
        self.daemon = daemon
        self.returncode: int | None = None
        self.sentinel = None
        self._joiners: list[Callable[[], None]] = []

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Block the calling simulated task until the process exits (or ``timeout`` virtual seconds)."""
        if self.returncode is not None:
            return self.returncode
        _park_until_exit(
            [self],
            timeout,
            f"join of simulated process pid {self.pid}",
            "a simulated process can only be joined from a simulated process",
        )
        return self.returncode

    def terminate(self) -> None:
        self.launcher.kill(self.image, signal.SIGTERM)

    def kill(self) -> None:
        self.launcher.kill(self.image, signal.SIGKILL)

    def close(self) -> None:
        pass

    def exited(self, code: int) -> None:
        self.returncode = code
        joiners, self._joiners = self._joiners, []
        for wake in joiners:
            wake()


class ProcessLauncher:
    """Starts and ends the simulated processes of one program run."""

    def __init__(self, sim: Simulation, images: ProcessImages, program: str, code: types.CodeType) -> None:
        self.sim = sim
        self.images = images
        self.program = program
        self.code = code
        #: the process of each rank that called init_rpc last (it owns the worker's agent)
        self.rpc_image: dict[int, ProcessImage] = {}
        #: each process's Popen (the main processes of the ranks have one too, unused by anyone)
        self.popen: dict[ProcessImage, SimPopen] = {}
        #: children of each process, in start order
        self.children: dict[ProcessImage, list[SimPopen]] = {}
        #: processes started by the launcher, by the id of their main task (to tell whose a
        #: not-yet-started task is when a worker crashes)
        self._task_image: dict[int, ProcessImage] = {}
        #: every process, in start order
        self.processes: list[ProcessImage] = []
        #: each worker's own connect (init_rpc's way into the simulated store)
        self._connects: dict[int, Callable[..., Any]] = {}
        for worker in sim.workers:
            self._hook(worker)
        sim.crashes.reaper = self._reap  # a crash kills the RPC process only
        sim.process_of = self._image_of  # process groups are per process

    def _hook(self, worker: SimWorker) -> None:
        self._connects[worker.rank] = worker.slot.connect
        worker.slot.connect = functools.partial(self._connect, worker.rank)

    # -- RPC ownership ----------------------------------------------------------------------------
    def _connect(self, rank: int, /, **kwargs: Any) -> Any:
        image = IMAGE.get()
        if image is not None and image.parent is not None:
            rank = self._join_as(image, rank, kwargs)
        if image is not None:
            # The worker's RPC tasks (requests, deliveries, timers) run in the process that joined.
            self.sim.workers[rank].context.run(IMAGE.set, image)
            self.rpc_image[rank] = image
        return self._connects[rank](**kwargs)

    def _join_as(self, image: ProcessImage, rank: int, kwargs: dict[str, Any]) -> int:
        """``init_rpc`` in a process the program started: it becomes the worker of the rank it asks
        for (for ``-1``: its environment's ``RANK``, else its current one), created, with the rest of a static group's
        ranks, if the world is smaller, and joins the
        round of the simulated store that rank's peers meet in. Returns that rank."""
        sim = self.sim
        requested = kwargs.get("rank", -1)
        if isinstance(requested, int) and requested >= 0:
            target = requested
        else:  # as the real world's env:// does: RANK from the process's environment
            env_rank = os.environ.get("RANK", "")
            target = int(env_rank) if env_rank.isdigit() else rank
        world_size = kwargs.get("world_size") or 0
        while len(sim.workers) < max(target + 1, world_size if isinstance(world_size, int) else 0):
            self._hook(sim.add_worker())
        worker = sim.workers[target]
        if target in sim.crashed:
            raise RuntimeError(
                f"init_rpc(rank={target}) in simulated process pid {image.pid}: rank {target}'s simulated "
                f"worker crashed at t={sim.crashed[target]:.6f} s, and the simulator does not start a "
                "crashed rank again (use another rank, or a new run)"
            )
        if worker.slot.agent is not None:
            owner = self.rpc_image.get(target)
            raise RuntimeError(
                f"init_rpc(rank={target}) in simulated process pid {image.pid}: rank {target} already runs "
                f"RPC in simulated process pid {owner.pid if owner else '?'}; each rank joins from one "
                "process at a time"
            )
        if target != image.rank or CURRENT_SLOT.get() is not worker.slot:
            task = sim.sched.current_task()
            assert task is not None
            task.worker = target  # its blocking, crashes and computation are that worker's now
            CURRENT_SLOT.set(worker.slot)
            if target != image.rank:
                sim.trace.record(sim.now, target, "process-join", f"pid {image.pid} joins as rank {target}")
            image.rank = target
        slot = worker.slot
        slot.generation = kwargs["generation"] = sim.rendezvous.open_round(target, slot.generation)
        return target

    def _reap(self, rank: int) -> None:
        """``Simulation.crash(rank)`` in a program run: kill the process that owns the worker's RPC
        agent (the main process if none does) and its tasks; the worker's other processes live on."""
        sched = self.sim.sched
        victim = self.rpc_image.get(rank) or self.main_image(rank)
        for task in sched.tasks_of(rank):
            if self._image_of(task) not in (victim, None):
                continue
            victim.kill_signal = signal.SIGKILL
            self._stop(task, victim)

    def _stop(self, task: Task, image: ProcessImage) -> None:
        """End ``task`` of the killed process ``image``; a process whose main task has not started
        yet exits here (its joiners must learn it, and the task never runs)."""
        started = self.sim.sched.kill(task)
        if not started and self._task_image.get(task.id) is image and image.exitcode is None:
            code = image.exitcode = -int(image.kill_signal or signal.SIGKILL)
            image.exit_time = self.sim.now
            self._exited(image, code)

    def _image_of(self, task: Task) -> ProcessImage | None:
        if task.g is not None and task.g.gr_context is not None:
            image: ProcessImage | None = task.g.gr_context.get(IMAGE)
            return image
        return self._task_image.get(task.id)

    def main_image(self, rank: int) -> ProcessImage:
        return next(p for p in self.processes if p.rank == rank and p.parent is None)

    # -- processes ------------------------------------------------------------------------------
    def add_main(self, image: ProcessImage) -> None:
        """Register ``image`` as the main process of its rank (the one torchrun would start)."""
        self.processes.append(image)
        self.popen[image] = SimPopen(self, image, daemon=False)
        self.children[image] = []
        self.sim.workers[image.rank].context.run(IMAGE.set, image)

    def run_main(self, image: ProcessImage) -> int:
        """The whole life of a rank's main process: the program as ``__main__``."""
        return self._live(image, lambda: exec_main(self.program, self.code, "__main__"))

    def _live(self, image: ProcessImage, body: Callable[[], Any]) -> int:
        sim = self.sim
        sim.trace.record(sim.now, image.rank, "process-start", f"pid {image.pid}")
        code: int | None = None
        try:
            code = run_process(image, body, program=self.program, now=lambda: sim.now)
            self._exit_children(image)
        finally:
            final = image.exitcode if image.exitcode is not None else -signal.SIGKILL
            if code is None:  # killed: run_process recorded SIGKILL; a terminate() said which signal
                final = -int(image.kill_signal or signal.SIGKILL)
                image.exitcode = final
            image.stdout.flush()
            image.stderr.flush()
            self._exited(image, final)
        return final

    def _exit_children(self, image: ProcessImage) -> None:
        """What multiprocessing does at interpreter exit: terminate daemonic children, join the rest."""
        for popen in list(self.children.get(image, ())):
            if popen.returncode is None and popen.daemon:
                popen.terminate()
        for popen in list(self.children.get(image, ())):
            if popen.returncode is None:
                popen.wait()

    def _exited(self, image: ProcessImage, code: int) -> None:
        sim = self.sim
        rank = image.rank
        sim.trace.record(sim.now, rank, "process-exit", f"pid {image.pid} exit code {code}")
        if image.parent is None:
            image.stdout.finish()  # type: ignore[attr-defined]
            image.stderr.finish()  # type: ignore[attr-defined]
        if self.rpc_image.get(rank) is image and self._connected(rank) and rank not in sim.crashed:
            # The process that ran the worker's RPC agent is gone without rpc.shutdown(): its
            # connections close, and its peers notice as they notice a crash.
            sim.trace.record(
                sim.now,
                rank,
                "process-exit",
                f"pid {image.pid} exited without rpc.shutdown(): connections close",
            )
            sim.sched.schedule(0.0, lambda _: sim.crash(rank))
        self.popen[image].exited(code)

    def _connected(self, rank: int) -> bool:
        """Whether worker ``rank`` is connected to its group: from the moment its group formed (its
        ``init_rpc`` may not have returned yet) until it shut down RPC."""
        world = self.sim.workers[rank].world
        return world is not None and not world.stopped

    def start_child(self, process: multiprocessing.process.BaseProcess) -> SimPopen:
        """``process.start()`` from a simulated process: start it as a simulated process."""
        parent = IMAGE.get()
        assert parent is not None
        # As Process.start does: a process of no context of its own starts with the default
        # context's start method, which that fixes (set_start_method then raises).
        method = process._start_method or multiprocessing.get_context().get_start_method()  # type: ignore[attr-defined]
        forked = method == "fork"
        image = ProcessImage(
            pid=self.images.new_pid(),
            rank=parent.rank,
            local_rank=parent.local_rank,
            environ=_environ_copy(os.environ._data),  # type: ignore[attr-defined]
            argv=list(sys.argv),
            stdout=sys.stdout,
            stderr=sys.stderr,
            modules=parent.modules if forked else {},
            parent=parent,
        )
        if forked:  # fork copies the parent's generators; a spawned process starts fresh
            image.random = ProcessRandom.capture()
        popen = SimPopen(self, image, daemon=bool(process.daemon))
        if forked:
            body: Callable[[], Any] = functools.partial(_run_forked, process)
            start_context = multiprocessing.context._default_context._actual_context  # type: ignore[attr-defined]  # the parent's (it is running)
        else:
            with _spawning(popen):
                data = pickle.dumps(process)
            body = functools.partial(_run_spawned, self.program, self.code, data)
            # spawn's preparation data carries the parent's start method, fixing it in the parent,
            # and the child sets it (multiprocessing.spawn.prepare)
            start_context = multiprocessing.get_context(multiprocessing.get_start_method())
        if process._start_method is not None:  # type: ignore[attr-defined]
            # a context's process forces its own method in the child (BaseProcess._bootstrap)
            start_context = multiprocessing.get_context(process._start_method)  # type: ignore[attr-defined]
        # until it runs its target it is a main process (spawn's child imports the program as one)
        image.multiprocessing = new_process_state(main_process(), start_context)
        self.processes.append(image)
        self.popen[image] = popen
        self.children[image] = []
        self.children[parent].append(popen)
        rank = parent.rank
        context = self.sim.workers[rank].context.copy()
        context.run(IMAGE.set, image)
        # no RPC agent of its own until it calls init_rpc, which makes it the worker of its rank
        context.run(CURRENT_SLOT.set, WorkerSlot(connect=functools.partial(self._connect, rank)))
        task = self.sim.sched.spawn(rank, context, f"process[{image.pid}]", self._live, (image, body))
        self._task_image[task.id] = image
        return popen

    def kill(self, image: ProcessImage, sig: int) -> None:
        """``terminate()``/``kill()``: the process dies at once (its tasks are stopped)."""
        if image.exitcode is not None:
            return
        image.kill_signal = sig
        sim = self.sim
        rank = image.rank
        if self.rpc_image.get(rank) is image and self._connected(rank):
            sim.crash(rank, at=sim.now)  # a dead RPC process is a crashed worker
            return

        def reap(_: object) -> None:
            sched = sim.sched
            for task in sched.tasks_of(image.rank):
                if self._image_of(task) is image:
                    self._stop(task, image)

        sim.sched.schedule(0.0, reap)


def _environ_copy(data: dict[Any, Any]) -> dict[Any, Any]:
    """A child's copy of its parent's environment (recording what the program reads, as the
    parent's does: :class:`~._program.EnvironmentReads`)."""
    return data.child() if isinstance(data, RecordingEnviron) else dict(data)


@contextmanager
def _spawning(popen: SimPopen) -> Iterator[None]:
    """Pickle a process object as spawning does (its authkey may be pickled only then)."""
    multiprocessing.context.set_spawning_popen(popen)  # type: ignore[arg-type]
    try:
        yield
    finally:
        multiprocessing.context.set_spawning_popen(None)


def _bootstrap(process: multiprocessing.process.BaseProcess) -> None:
    """What ``BaseProcess._bootstrap`` prints for an uncaught exception (``Process-1:`` and the
    traceback), then the exit code as usual."""
    multiprocessing.process._current_process = process  # type: ignore[attr-defined]
    try:
        process.run()
    except (SystemExit, greenlet.GreenletExit):
        raise
    except BaseException:
        print(f"Process {process.name}:", file=sys.stderr)
        raise


def _run_forked(process: multiprocessing.process.BaseProcess) -> None:
    _bootstrap(process)


def _run_spawned(program: str, code: types.CodeType, data: bytes) -> None:
    exec_main(program, code, "__mp_main__")
    process = pickle.loads(data)
    _bootstrap(process)


# -- torch.multiprocessing.spawn -----------------------------------------------------------------------
class _SpawnEntry:
    """The target of each process of a simulated ``torch.multiprocessing.spawn``: ``fn(i, *args)``;
    an exception's traceback goes to the parent (as torch's ``_wrap`` does through a file)."""

    def __init__(self, fn: Callable[..., Any], index: int, args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.index = index
        self.args = args

    def __call__(self) -> None:
        try:
            self.fn(self.index, *self.args)
        except KeyboardInterrupt:
            pass
        except Exception as exc:
            image = IMAGE.get()
            if image is not None:  # from fn's frame on: this wrapper is not the program's
                tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
                image.error = "".join(traceback.format_exception(type(exc), exc, tb))
            sys.exit(1)


class SimProcessContext:
    """What ``torch.multiprocessing.start_processes(join=False)`` returns, for simulated processes."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess]) -> None:
        self.processes = processes

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.processes]  # type: ignore[arg-type]

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for every process; the first to fail terminates the others and raises torch's
        ``ProcessRaisedException``/``ProcessExitedException``, as torch's ``ProcessContext.join``."""
        popens: list[SimPopen] = [p._popen for p in self.processes]  # type: ignore[attr-defined]
        while True:
            failed = [i for i, p in enumerate(popens) if p.returncode not in (None, 0)]
            if failed:
                break
            pending = [p for p in popens if p.returncode is None]
            if not pending:
                return True
            _wait_any(pending, timeout)
            if timeout is not None:
                return all(p.returncode is not None for p in popens)
        first = min(failed, key=lambda i: popens[i].image.exit_time or 0.0)
        for p in popens:
            if p.returncode is None:
                p.terminate()
        for p in popens:
            if p.returncode is None:
                p.wait()
        popen = popens[first]
        code = int(popen.returncode or 0)
        if popen.image.error is None:
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"<Unknown signal {-code}>"
                raise ProcessExitedException(
                    f"process {first:d} terminated with signal {name}",
                    error_index=first,
                    error_pid=popen.pid,
                    exit_code=code,
                    signal_name=name,
                )
            raise ProcessExitedException(
                f"process {first:d} terminated with exit code {code:d}",
                error_index=first,
                error_pid=popen.pid,
                exit_code=code,
            )
        msg = f"\n\n-- Process {first:d} terminated with the following error:\n" + popen.image.error
        raise ProcessRaisedException(msg, first, popen.pid)


def _wait_any(popens: list[SimPopen], timeout: float | None) -> None:
    """Park until one of ``popens`` exits (or ``timeout`` virtual seconds)."""
    _park_until_exit(
        popens,
        timeout,
        "join of simulated processes " + ", ".join(str(p.pid) for p in popens),
        "simulated processes can only be joined from a simulated process",
    )


def _park_until_exit(popens: list[SimPopen], timeout: float | None, reason: str, outside: str) -> None:
    """Park the calling simulated task until one of ``popens`` exits (or ``timeout`` virtual seconds):
    one join for :meth:`SimPopen.wait` and :func:`_wait_any`. ``outside`` is the error when no
    simulated task is calling."""
    sched = popens[0].launcher.sim.sched
    task = sched.current_task()
    if task is None:
        raise RuntimeError(outside)
    woken = [False]
    timer: TimerHandle | None = None

    def wake() -> None:
        if not woken[0]:
            woken[0] = True
            if timer is not None:
                timer.cancel()
            sched.wake(task)

    for p in popens:
        p._joiners.append(wake)
    if timeout is not None:
        timer = sched.call_later(max(0.0, float(timeout)), wake)
    sched.park(reason)
    for p in popens:
        if wake in p._joiners:
            p._joiners.remove(wake)


def _start_processes(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> SimProcessContext | None:
    """``torch.multiprocessing.start_processes`` from a simulated process."""
    mp = multiprocessing.get_context(start_method)
    processes = []
    for i in range(nprocs):
        process = mp.Process(target=_SpawnEntry(fn, i, tuple(args)), daemon=daemon)  # type: ignore[attr-defined]
        process.start()
        processes.append(process)
    context = SimProcessContext(processes)
    if not join:
        return context
    while not context.join():
        pass
    return None


# -- the patches -----------------------------------------------------------------------------------------
_real_start = multiprocessing.process.BaseProcess.start


def _start(self: multiprocessing.process.BaseProcess) -> None:
    launcher = _LAUNCHER
    if launcher is None or IMAGE.get() is None:
        _real_start(self)
        return
    self._check_closed()  # type: ignore[attr-defined]
    assert self._popen is None, "cannot start a process twice"  # type: ignore[attr-defined]
    self._popen = launcher.start_child(self)  # type: ignore[attr-defined]
    self._sentinel = None  # type: ignore[attr-defined]
    multiprocessing.process._children.add(self)  # type: ignore[attr-defined]  # active_children()


def _torch_wrapper(real: Callable[..., Any], simulated: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _LAUNCHER is None or IMAGE.get() is None:
            return real(*args, **kwargs)
        return simulated(*args, **kwargs)

    return wrapper


@contextmanager
def simulated_processes(launcher: ProcessLauncher) -> Iterator[None]:
    """While the block runs, processes started from simulated processes are simulated."""
    global _LAUNCHER
    tmp_spawn = sys.modules["torch.multiprocessing.spawn"]  # the attribute of that name is the function

    if _LAUNCHER is not None:
        raise RuntimeError("a program is already running under the simulator in this interpreter")
    targets: list[tuple[Any, str, Any]] = [(multiprocessing.process.BaseProcess, "start", _start)]
    for module in (tmp, tmp_spawn):
        # torch's spawn is start_processes under another name (same parameters, same defaults)
        for name, simulated in (("spawn", _start_processes), ("start_processes", _start_processes)):
            real = module.__dict__[name]
            targets.append((module, name, _torch_wrapper(real, simulated)))
    saved = [(obj, name, obj.__dict__[name]) for obj, name, _ in targets]
    for obj, name, value in targets:
        setattr(obj, name, value)
    _LAUNCHER = launcher
    try:
        yield
    finally:
        _LAUNCHER = None
        for obj, name, value in saved:
            setattr(obj, name, value)
