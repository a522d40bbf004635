"""Simulated processes: each has its own copy of the program's modules, environment, argv and output.

Real workers are processes: a module-level singleton, ``os.environ["RANK"]`` or ``sys.argv`` differ
from one worker to the next. In the simulator every worker shares one interpreter, so each simulated
process gets a :class:`ProcessImage` (its program modules, ``os.environ``, ``sys.argv``,
``sys.stdout``/``sys.stderr``), and :class:`ProcessImages` swaps the running task's image in whenever
the scheduler switches to a task of another process.

- Which task belongs to which process: the :data:`IMAGE` context variable of the task's context
  (greenlets carry their own ``contextvars`` context). A process's main task and the tasks its RPC
  agent starts (request handlers, deliveries, timers) carry its image.
- When: a ``greenlet.settrace`` hook sees every switch; it does nothing unless the target task belongs
  to a different process than the one whose image is in place (one context lookup per switch), so a
  burst of work inside one process costs no swaps. Installed only for a program run by
  ``python -m twinrpc.simulator run``: plain :class:`~twinrpc.simulator.Simulation` runs pay nothing.
- What a swap moves: ``sys.modules`` entries of *program modules* (the program file itself as
  ``__main__``, and every module it imports from outside the standard library, installed packages and
  twinrpc: found by a meta-path finder the first time any process imports it), ``os.environ``'s
  storage, ``sys.argv``, ``sys.stdout`` and ``sys.stderr``, and multiprocessing's globals of a process
  (its start method: ``set_start_method`` in one process does not set another's; ``current_process()``;
  the numbering of the processes it starts; ``active_children()``). Installed packages (torch, numpy) stay
  shared, as read-only code mostly is; their global state (torch's default RNG, for one) is shared too.

Processes started with ``multiprocessing`` from a simulated process are simulated too
(:mod:`twinrpc.simulator._launch._processes`).
"""

from __future__ import annotations

import builtins
import contextvars
import copy
import importlib.abc
import importlib.machinery
import io
import itertools
import multiprocessing.context
import multiprocessing.process
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from string import Template
from typing import Any, TextIO

import greenlet

from .._kernel._virtual_time import _library_dirs
from ._random_state import ProcessRandom

#: multiprocessing's globals that are each process's own: its start method once chosen
#: (``set_start_method``, or the first ``get_start_method``/``get_context()``), the process object it
#: is (``current_process()``), the counter that numbers the processes it creates (``Process-1``) and
#: the set of its live children (``active_children()``)
_PER_PROCESS: tuple[tuple[Any, str], ...] = (
    (multiprocessing.context._default_context, "_actual_context"),
    (multiprocessing.process, "_current_process"),
    (multiprocessing.process, "_process_counter"),
    (multiprocessing.process, "_children"),
)


#: this interpreter's ``current_process()``, whatever process is simulated when one is made
_INTERPRETER_MAIN: Any = multiprocessing.process.current_process()


def new_process_state(current: Any, start_context: Any = None) -> list[Any]:
    """The multiprocessing globals (:data:`_PER_PROCESS`) of a process that starts now, as
    ``current`` (``current_process()``), with ``start_context`` as its start method."""
    return [start_context, current, itertools.count(1), set()]


def main_process() -> Any:
    """A ``current_process()`` for a new main process: this interpreter's own, copied (its name
    ``MainProcess`` and authentication key), so no process sees another's changes."""
    main = copy.copy(_INTERPRETER_MAIN)
    main._config = dict(main._config)
    return main


#: the simulated process a task belongs to (None: not a simulated process, e.g. the scheduler)
IMAGE: contextvars.ContextVar[ProcessImage | None] = contextvars.ContextVar("twinrpc_image", default=None)

#: module names every process has its own copy of, whatever imports them
_ALWAYS_PRIVATE = ("__main__", "__mp_main__")


class RankStream(io.TextIOBase):
    """A worker's ``sys.stdout``/``sys.stderr``: whole lines go to the real stream behind a prefix
    (torchrun's ``[rank0]:`` style); a partial line waits for its newline or the process's exit."""

    def __init__(self, sink: TextIO, prefix: str, *, show: bool = True) -> None:
        super().__init__()
        self._sink = sink
        self.prefix = prefix
        self.show = show
        self._partial = ""
        #: every complete line written, without the prefix (for tests and failure reports)
        self.lines: list[str] = []

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._sink, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._sink.fileno()

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        text = self._partial + s
        *complete, self._partial = text.split("\n")
        if complete:
            self.lines.extend(complete)
            if self.show:
                prefix = self.prefix
                self._sink.write("".join(f"{prefix}{line}\n" for line in complete))
        return len(s)

    def flush(self) -> None:
        self._sink.flush()

    def finish(self) -> None:
        """The process exited: emit a last partial line."""
        if self._partial:
            self.write("\n")
        self.flush()


class ProcessImage:
    """What one simulated process has of its own (see the module docstring)."""

    def __init__(
        self,
        *,
        pid: int,
        rank: int,
        local_rank: int,
        environ: dict[Any, Any],
        argv: list[str],
        stdout: TextIO,
        stderr: TextIO,
        modules: dict[str, types.ModuleType] | None = None,
        parent: ProcessImage | None = None,
    ) -> None:
        self.pid = pid
        self.rank = rank
        self.local_rank = local_rank
        #: program modules while another image is in place (shared with the parent after a fork)
        self.modules: dict[str, types.ModuleType] = {} if modules is None else modules
        self.environ = environ
        self.argv = argv
        self.stdout = stdout
        self.stderr = stderr
        self.parent = parent
        self.exitcode: int | None = None
        #: virtual time of the exit
        self.exit_time: float | None = None
        #: the formatted traceback of the exception that ended the process, if one did
        self.error: str | None = None
        #: the signal that killed the process (terminate(), kill(), a crash of its worker)
        self.kill_signal: int | None = None
        #: its multiprocessing globals (:data:`_PER_PROCESS`), in place while another process runs
        self.multiprocessing: list[Any] = new_process_state(main_process())
        #: its global random generators (None until it first runs: then fresh from the run's seed)
        self.random: ProcessRandom | None = None

    def __repr__(self) -> str:
        return f"<simulated process pid={self.pid} rank={self.rank}>"


class _ProgramFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` during a run: asks the other finders, and marks a module found
    outside the standard library, installed packages and twinrpc as a program module."""

    def __init__(self, images: ProcessImages) -> None:
        self.images = images

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if fullname not in self.images.private and self.images.is_program(spec):
            self.images.private.append(fullname)
        return spec  # type: ignore[no-any-return]


class ProcessImages:
    """The simulated processes of one run and the hook that swaps their images in.

    Use as a context manager around the simulation; on exit the interpreter's own state (the
    ``outside`` image) is back in place and the hook is gone.
    """

    def __init__(self, program_dir: str, seed: int = 0) -> None:
        self.program_dir = os.path.abspath(program_dir)
        #: what a fresh process's random generators start from
        self.seed = seed
        self.outside = ProcessImage(
            pid=os.getpid(),
            rank=-1,
            local_rank=-1,
            environ=os.environ._data,  # type: ignore[attr-defined]
            argv=sys.argv,
            stdout=sys.stdout,
            stderr=sys.stderr,
        )
        self.outside.multiprocessing = [getattr(obj, name) for obj, name in _PER_PROCESS]
        self.outside.random = ProcessRandom.installed()
        self.active = self.outside
        #: names of the program modules (every process has its own copy)
        self.private: list[str] = list(_ALWAYS_PRIVATE)
        for name in _ALWAYS_PRIVATE:
            if name in sys.modules:
                self.outside.modules[name] = sys.modules[name]
        self._libraries = _library_dirs()
        #: the environment variables the program reads (each process's ``os.environ`` records them)
        self.environment = EnvironmentReads(self._libraries)
        self._finder = _ProgramFinder(self)
        self._previous_tracer: Any = None
        self._next_pid = 1000
        self.swaps = 0

    # -- which modules are the program's -------------------------------------------------------
    def is_program(self, spec: importlib.machinery.ModuleSpec) -> bool:
        origin = spec.origin
        if origin in (None, "built-in", "frozen") or not spec.has_location:
            locations = list(spec.submodule_search_locations or ())
            if not locations:
                return False
            origin = locations[0]
        assert origin is not None
        return not os.path.abspath(origin).startswith(self._libraries)

    # -- images ---------------------------------------------------------------------------------
    def new_pid(self) -> int:
        self._next_pid += 1
        return self._next_pid

    def activate(self, image: ProcessImage) -> None:
        """Put ``image`` in place of the active one (saving the active one's state into it)."""
        old = self.active
        if image is old:
            return
        self.swaps += 1
        old_modules, new_modules = old.modules, image.modules
        if old_modules is not new_modules:
            mods = sys.modules
            for name in self.private:
                module = mods.pop(name, None)
                if module is None:
                    old_modules.pop(name, None)
                else:
                    old_modules[name] = module
                module = new_modules.get(name)
                if module is not None:
                    mods[name] = module
        environ = os.environ
        old.environ = environ._data  # type: ignore[attr-defined]
        environ._data = image.environ  # type: ignore[attr-defined]
        old.argv = sys.argv
        sys.argv = image.argv
        old.stdout, old.stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = image.stdout, image.stderr
        saved, installed = old.multiprocessing, image.multiprocessing
        for i, (obj, name) in enumerate(_PER_PROCESS):
            saved[i] = getattr(obj, name)
            setattr(obj, name, installed[i])
        if old.random is not None:
            old.random.save_torch()
        if image.random is None:
            image.random = ProcessRandom.fresh(self.seed, image.pid)
        image.random.install()
        self.active = image

    def _on_switch(self, event: str, args: tuple[greenlet.greenlet, greenlet.greenlet]) -> None:
        if event == "switch" or event == "throw":
            context = args[1].gr_context
            if context is not None:
                image = context.get(IMAGE)
                if image is not None and image is not self.active:
                    self.activate(image)
        previous = self._previous_tracer
        if previous is not None:
            previous(event, args)

    def __enter__(self) -> ProcessImages:
        sys.meta_path.insert(0, self._finder)
        sys.path.insert(0, self.program_dir)
        self._previous_tracer = greenlet.settrace(self._on_switch)
        return self

    def __exit__(self, *exc: object) -> None:
        greenlet.settrace(self._previous_tracer)
        self.activate(self.outside)
        for name in self.private:  # program modules no process had before the run
            if name not in self.outside.modules:
                sys.modules.pop(name, None)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        if sys.path and sys.path[0] == self.program_dir:
            del sys.path[0]
        else:
            try:
                sys.path.remove(self.program_dir)
            except ValueError:
                pass


def encode_environ(base: dict[Any, Any], updates: dict[str, str]) -> dict[Any, Any]:
    """A copy of ``os.environ``'s storage ``base`` with ``updates`` applied (encoded as it encodes)."""
    env = dict(base)
    for key, value in updates.items():
        env[os.environ.encodekey(key)] = os.environ.encodevalue(value)
    return env


#: modules whose frames are ``os.environ``'s own machinery (``os.getenv``, ``Mapping.get``,
#: ``in``, ``setdefault``, ``copy``...), skipped to find the code that asked for a variable
_ENVIRON_MACHINERY = frozenset({"os", "_collections_abc", "collections.abc", __name__})


class EnvironmentReads:
    """Which environment variables a run's program read: the launcher's record, for the replay command.

    Every simulated process's ``os.environ`` storage is a :class:`RecordingEnviron` tied to this record.
    A variable counts when the *program's own code* (a program module, as :class:`ProcessImages` tells
    them apart: not the standard library, an installed package or twinrpc) reads it, through
    ``os.environ[...]``, ``os.environ.get``, ``os.getenv``, ``in os.environ`` or ``setdefault``, before
    that process wrote it; a read of an unset variable counts too (a replay must not set it). What does
    not count: reads by libraries (torch's, the standard library's: their settings describe the
    installation, and torch reads most of them at import, before any worker runs), a variable the
    process set or deleted before reading it (it reads its own value), and reading the whole
    environment at once (``dict(os.environ)``, ``os.environ.copy()``, iterating over it), which is
    not a read of each variable.
    """

    def __init__(self, libraries: tuple[str, ...]) -> None:
        self._libraries = libraries
        #: the names read, in the order first read (os.environ's encoded keys)
        self.keys: dict[Any, None] = {}
        #: where the environment was last enumerated: (frame, instruction); reads from there are bulk
        self._bulk: tuple[types.FrameType, int] | None = None

    def names(self) -> list[str]:
        """The variables the program read, in the order it first read them."""
        return [os.environ.decodekey(k) for k in self.keys]

    def environ(self, data: dict[Any, Any]) -> RecordingEnviron:
        """A process environment (``os.environ``'s storage) holding ``data``, recorded here."""
        return RecordingEnviron(data, self)

    def _caller(self) -> tuple[types.FrameType, int] | None:
        """The frame (and its instruction) outside os.environ's machinery that is reading, if it is
        the program's own code."""
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__") in _ENVIRON_MACHINERY:
            frame = frame.f_back
        if frame is None:
            return None
        filename = frame.f_code.co_filename
        if filename.startswith("<frozen") or filename.startswith(self._libraries):
            return None
        return frame, frame.f_lasti

    def _enumerated(self) -> None:
        self._bulk = self._caller()

    def _read(self, key: Any) -> None:
        if key in self.keys:
            return
        site = self._caller()
        if site is None:
            return
        bulk = self._bulk
        if bulk is not None and bulk[0] is site[0] and bulk[1] == site[1]:
            return  # one of the reads of dict(os.environ), os.environ.copy(), a loop over items()
        self.keys[key] = None


class RecordingEnviron(dict[Any, Any]):
    """A simulated process's ``os.environ`` storage that tells :class:`EnvironmentReads` what the
    program reads (see there). ``written``: the keys this process set or deleted."""

    def __init__(
        self, data: dict[Any, Any], reads: EnvironmentReads, written: set[Any] | None = None
    ) -> None:
        super().__init__(data)
        self.reads = reads
        self.written: set[Any] = set() if written is None else written

    def __getitem__(self, key: Any) -> Any:
        if key not in self.written:
            self.reads._read(key)
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.written.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.written.add(key)
        super().__delitem__(key)

    def __iter__(self) -> Iterator[Any]:
        self.reads._enumerated()
        return super().__iter__()

    def child(self) -> RecordingEnviron:
        """A copy for a process this one starts (a copy of its environment, as ``fork`` and
        ``spawn`` give), recorded in the same record; what this process wrote stays its own value."""
        return RecordingEnviron(dict.copy(self), self.reads, set(self.written))


def prefix_for(template: str, rank: int, local_rank: int, role: str = "default") -> str:
    """torchrun's log line prefix: ``$rank``, ``$local_rank`` and ``$role_name`` substituted."""
    return Template(template).safe_substitute(rank=rank, local_rank=local_rank, role_name=role)


def exec_main(path: str, code: types.CodeType, run_name: str) -> types.ModuleType:
    """Run the program file as this process's ``run_name`` module (``__main__``, or ``__mp_main__``
    in a spawned child), as ``python path`` (``runpy.run_path``) would."""
    module = types.ModuleType(run_name)
    module.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=None,
        __package__=None,
        __spec__=None,
        __builtins__=builtins,
    )
    sys.modules[run_name] = module
    if run_name != "__main__":
        sys.modules["__main__"] = module  # as multiprocessing's spawn does
    exec(code, module.__dict__)
    return module


def exit_code(exc: SystemExit, stderr: TextIO) -> int:
    """The status a process exiting with ``exc`` has, printing a non-integer code as Python does."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=stderr)
    return 1


def format_uncaught(exc: BaseException, program: str | None) -> str:
    """The traceback Python prints for an uncaught exception, without the simulator's own frames
    (they start at the program file when ``program`` is given)."""
    tb = exc.__traceback__
    if program is not None:
        walk = tb
        while walk is not None and walk.tb_frame.f_code.co_filename != program:
            walk = walk.tb_next
        if walk is not None:
            tb = walk
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_process(
    image: ProcessImage, body: Callable[[], Any], *, program: str | None, now: Callable[[], float]
) -> int:
    """Run ``body`` as the whole life of a simulated process; returns (and records) its exit code:
    0, ``sys.exit``'s code, or 1 with the traceback printed to the process's stderr."""
    try:
        body()
    except SystemExit as exc:
        code = exit_code(exc, image.stderr)
    except greenlet.GreenletExit:
        image.exitcode = -9  # killed (a crash): SIGKILL, as the real world would report it
        image.exit_time = now()
        raise
    except BaseException as exc:
        image.error = format_uncaught(exc, program)
        image.stderr.write(image.error)
        code = 1
    else:
        code = 0
    image.exitcode = code
    image.exit_time = now()
    return code
