"""Time and threads seen from inside a simulation.

A simulated program must not read the wall clock or start OS threads: both make two runs with the
same seed differ. While a simulation runs, this module replaces ``time.time``, ``time.monotonic``,
``time.perf_counter``, ``time.sleep`` (and their ``_ns`` variants), the calendar functions that read
the clock when given no time (``time.localtime()``, ``gmtime()``, ``ctime()``, ``asctime()``,
``strftime(fmt)``), the CPU clocks (``time.process_time``, ``thread_time``) and
``threading.Thread.start`` with wrappers that do one context-variable read and, outside simulated
tasks, call the real function. Inside a simulated task they either

- follow virtual time (``virtual=True``, what ``python -m twinrpc.simulator run`` installs before the
  program is imported): ``time.time()`` is :data:`VIRTUAL_EPOCH` plus the virtual clock,
  ``time.monotonic()``/``time.perf_counter()`` are the virtual clock, ``time.sleep(s)`` parks the
  task for ``s`` virtual seconds; or
- warn (``virtual=False``, every :meth:`~twinrpc.simulator.Simulation.run`): a
  :class:`SimulationWarning` once per call site per run, naming the file and line, and then behave as
  usual.

``threading.Thread.start`` and the CPU clocks inside a simulated task always warn (the thread still
starts; CPU time is not virtualized). ``datetime.datetime.now()`` cannot be replaced (a C type's
method) and reads the real clock unreported. Calls made
from the standard library, installed packages and twinrpc itself are not reported: they are rarely
the program's intent (a log record's timestamp, a progress bar's rate), and reporting them would bury
the program's own reads.

The wrappers stay valid after a run (a module that did ``from time import time`` during the run keeps
one): outside a run they are the real functions plus one check.
"""

from __future__ import annotations

import math
import os
import site
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import twinrpc
from twinrpc._future import CURRENT_BLOCKER, Future

from .._errors import SimulationWarning
from ._blocker import SimBlocker

#: ``time.time()`` inside a virtual-time run is this epoch (2024-01-01T00:00:00Z) plus the virtual
#: clock, so a program's timestamps are the same on every run with the same seed.
VIRTUAL_EPOCH = 1_704_067_200.0


_real_time = time.time
_real_time_ns = time.time_ns
_real_monotonic = time.monotonic
_real_monotonic_ns = time.monotonic_ns
_real_perf_counter = time.perf_counter
_real_perf_counter_ns = time.perf_counter_ns
_real_sleep = time.sleep
_real_thread_start = threading.Thread.start
_real_localtime = time.localtime


def _library_dirs() -> tuple[str, ...]:
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    # package directories a .pth file put on sys.path (a virtualenv layered on another's packages)
    dirs.update(
        p for p in sys.path if os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages")
    )
    # the whole simulator package (this file is in its _kernel/), and impl/ beside it
    simulator = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs.update((os.path.dirname(os.path.abspath(twinrpc.__file__ or "")), simulator))
    dirs.add(os.path.join(os.path.dirname(simulator), "impl"))
    return tuple(sorted(os.path.join(d, "") for d in dirs if d))


class _State:
    """Which mode is on (a stack: the CLI's virtual time wraps the Simulation.run it calls)."""

    __slots__ = ("depth", "epoch", "libraries", "seen", "virtual")

    def __init__(self) -> None:
        self.depth = 0
        self.virtual = False
        self.epoch = VIRTUAL_EPOCH
        self.seen: set[tuple[str, int, str]] = set()
        self.libraries: tuple[str, ...] | None = None


_state = _State()


def _warn(frame: FrameType | None, what: str, why: str) -> None:
    """One :class:`SimulationWarning` per call site (file, line, what) and run; none for library code."""
    if frame is None:
        return
    filename = frame.f_code.co_filename
    key = (filename, frame.f_lineno, what)
    seen = _state.seen
    if key in seen:
        return
    seen.add(key)
    libraries = _state.libraries
    if libraries is None:
        libraries = _state.libraries = _library_dirs()
    if filename.startswith("<frozen") or filename.startswith(libraries):
        return
    warnings.warn_explicit(
        f"{filename}:{frame.f_lineno}: {what} {why}",
        SimulationWarning,
        filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__"),
    )


_CLOCK_WHY = (
    "reads the wall clock inside a simulated task: its value differs from run to run, which breaks "
    "determinism. Use twinrpc.simulator.now(), or run the program with `python -m twinrpc.simulator "
    "run`, where time follows the virtual clock."
)
_CPU_WHY = (
    "reads a CPU-time clock inside a simulated task: it is not virtualized (every simulated worker "
    "shares this process's CPU time) and differs from run to run, which breaks determinism."
)
_SLEEP_WHY = (
    "sleeps in wall time inside a simulated task: every simulated worker stalls and virtual time does "
    "not advance. Use twinrpc.simulator.sleep(), or run the program with `python -m twinrpc.simulator "
    "run`, where time.sleep follows the virtual clock."
)
_THREAD_WHY = (
    "starts an OS thread inside a simulated task: the simulator does not schedule it, so it runs at "
    "wall-clock times that differ from run to run (breaks determinism), and RPC calls made from it do "
    "not belong to any simulated worker. Run that work in the task itself or as an RPC."
)


def _sim_clock() -> float | None:
    """The virtual clock if the caller is a simulated task of a running simulation, else None."""
    blocker = CURRENT_BLOCKER.get()
    if blocker.__class__ is SimBlocker and _state.depth:
        return blocker.sched.now
    return None


def _as_real(wrapper: Callable[..., Any], real: Callable[..., Any]) -> None:
    """Name ``wrapper`` as the function it stands for, so pickle (an RPC of ``time.time``) finds it
    as ``time.time`` while it is installed, and as the real one on a worker where it is not."""
    wrapper.__module__ = real.__module__ or "time"
    wrapper.__name__ = real.__name__
    wrapper.__qualname__ = real.__qualname__
    wrapper.__doc__ = real.__doc__


def _clock(real: Callable[[], float], name: str, offset: bool) -> Callable[[], float]:
    def clock() -> float:
        now = _sim_clock()
        if now is None:
            return real()
        if _state.virtual:
            return _state.epoch + now if offset else now
        _warn(sys._getframe(1), f"{name}()", _CLOCK_WHY)
        return real()

    _as_real(clock, real)
    return clock


def _clock_ns(real: Callable[[], int], name: str, offset: bool) -> Callable[[], int]:
    def clock_ns() -> int:
        now = _sim_clock()
        if now is None:
            return real()
        if _state.virtual:
            return round(((_state.epoch if offset else 0.0) + now) * 1e9)
        _warn(sys._getframe(1), f"{name}()", _CLOCK_WHY)
        return real()

    _as_real(clock_ns, real)
    return clock_ns


def _calendar(real: Callable[..., Any], name: str, time_arg: int) -> Callable[..., Any]:
    """``time.localtime``/``gmtime``/``ctime``/``asctime``/``strftime``: without their time argument
    they read the wall clock, so then they get the virtual ``time.time()`` (or warn)."""
    wants_struct = name in ("time.asctime", "time.strftime")

    def calendar(*args: Any) -> Any:
        if len(args) > time_arg or _sim_clock() is None:
            return real(*args)
        if not _state.virtual:
            _warn(sys._getframe(1), f"{name}()", _CLOCK_WHY)
            return real(*args)
        now = TIME_WRAPPERS["time"]()
        return real(*args, _real_localtime(now) if wants_struct else now)

    _as_real(calendar, real)
    return calendar


def _cpu_clock(real: Callable[[], Any], name: str) -> Callable[[], Any]:
    """``time.process_time``/``thread_time``: CPU clocks, not virtualized; always reported."""

    def cpu_clock() -> Any:
        if _sim_clock() is not None:
            _warn(sys._getframe(1), f"{name}()", _CPU_WHY)
        return real()

    _as_real(cpu_clock, real)
    return cpu_clock


def sleep(secs: float, /) -> None:
    """``time.sleep`` while a simulation runs: virtual inside simulated tasks (or a warning, see the
    module docstring), wall time elsewhere."""
    blocker = CURRENT_BLOCKER.get()
    if blocker.__class__ is not SimBlocker or not _state.depth:
        _real_sleep(secs)
        return
    if not _state.virtual:
        _warn(sys._getframe(1), "time.sleep()", _SLEEP_WHY)
        _real_sleep(secs)
        return
    seconds = float(secs)
    if math.isnan(seconds):
        raise ValueError("Invalid value NaN (not a number)")
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    if math.isinf(seconds):
        raise OverflowError("timestamp too large to convert to C _PyTime_t")
    sched = blocker.sched
    fut: Future[None] = Future()
    fut.label = f"time.sleep({secs!r})"
    sched.call_later(seconds, lambda: fut.set_result(None))
    fut.wait()


def _thread_start(self: threading.Thread) -> None:
    if CURRENT_BLOCKER.get().__class__ is SimBlocker and _state.depth:
        _warn(sys._getframe(1), "threading.Thread.start()", _THREAD_WHY)
    _real_thread_start(self)


_as_real(sleep, _real_sleep)
_as_real(_thread_start, _real_thread_start)

#: the replacements installed while a simulation runs (name in ``time`` -> wrapper)
TIME_WRAPPERS: dict[str, Callable[..., Any]] = {
    "time": _clock(_real_time, "time.time", True),
    "time_ns": _clock_ns(_real_time_ns, "time.time_ns", True),
    "monotonic": _clock(_real_monotonic, "time.monotonic", False),
    "monotonic_ns": _clock_ns(_real_monotonic_ns, "time.monotonic_ns", False),
    "perf_counter": _clock(_real_perf_counter, "time.perf_counter", False),
    "perf_counter_ns": _clock_ns(_real_perf_counter_ns, "time.perf_counter_ns", False),
    "sleep": sleep,
    "localtime": _calendar(time.localtime, "time.localtime", 0),
    "gmtime": _calendar(time.gmtime, "time.gmtime", 0),
    "ctime": _calendar(time.ctime, "time.ctime", 0),
    "asctime": _calendar(time.asctime, "time.asctime", 0),
    "strftime": _calendar(time.strftime, "time.strftime", 1),
    "process_time": _cpu_clock(time.process_time, "time.process_time"),
    "process_time_ns": _cpu_clock(time.process_time_ns, "time.process_time_ns"),
    "thread_time": _cpu_clock(time.thread_time, "time.thread_time"),
    "thread_time_ns": _cpu_clock(time.thread_time_ns, "time.thread_time_ns"),
}


@contextmanager
def simulated_time(*, virtual: bool, epoch: float = VIRTUAL_EPOCH) -> Iterator[None]:
    """Install the wrappers for the duration of the block (nested blocks keep the outer mode).

    Args:
        virtual: inside simulated tasks, time follows the virtual clock (else: warn, real time).
        epoch: what ``time.time()`` returns at virtual time 0.
    """
    outer = _state.depth > 0
    if not outer:
        saved = {name: getattr(time, name) for name in TIME_WRAPPERS}
        saved_start = threading.Thread.__dict__["start"]
        for name, fn in TIME_WRAPPERS.items():
            setattr(time, name, fn)
        threading.Thread.start = _thread_start  # type: ignore[method-assign]
        _state.virtual = virtual
        _state.epoch = epoch
        _state.seen = set()
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if not outer:
            for name, fn in saved.items():
                setattr(time, name, fn)
            threading.Thread.start = saved_start  # type: ignore[method-assign]
            _state.virtual = False
