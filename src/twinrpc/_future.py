"""Futures that block correctly in both worlds.

``Future`` is a ``torch.futures.Future`` (a subclass: ``isinstance`` holds, and upstream
``torch.futures.collect_all``/``wait_all`` accept it, see :func:`install_torch_hooks`). How a waiting
caller blocks is the world's business: a simulated task parks its greenlet and hands control to the
scheduler, a real thread waits on a lock. The world installs its blocker in a context variable, so the
same ``wait()`` works in both; torch's C++ ``wait()`` is never used (it would block the OS thread, and
with it the whole simulation).

Where callbacks run: waiters (``wait()``) and the protocol's own callbacks run on whatever completes the
future, at once. User callbacks (``then``, ``add_done_callback``) do too, except on a thread that must
never run user code (a gloo link's receiver, the world's timer): there the world takes them and runs
them elsewhere (``CALLBACK_ROLE``), so a callback that blocks (say, an ``rpc_sync`` back to the peer
whose reply completed the future) never stops the messages it waits for.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from ._errors import RPCTimeoutError

T = TypeVar("T")
S = TypeVar("S")

_log = logging.getLogger("twinrpc")
_PENDING = object()


class Blocker(Protocol):
    """How the current task waits for a future to complete."""

    def wait_done(self, fut: Future[Any]) -> None: ...


class _CallbackRole(threading.local):
    #: set (by the gloo world) on a thread that must never run user code: its link receivers, whose
    #: being blocked would hold up every later message from that peer, and its timer. Completing a
    #: future there hands the user callbacks, as one function, to ``defer``, which runs it on another
    #: thread later; waiters and the protocol's own callbacks still run at once.
    defer: Callable[[Callable[[], None]], None] | None = None
    #: set while a thread runs deferred callbacks for the world: called (once) before that thread
    #: blocks on a future, so the callbacks queued behind the blocking one go to another thread
    on_block: Callable[[], None] | None = None


CALLBACK_ROLE = _CallbackRole()


class _ThreadBlocker:
    """The real world: block this OS thread on a lock released by the completing thread.

    A bare lock rather than a threading.Event: the Event's Condition is Python code, ~5 us more of
    GIL-held work per wait on every rpc_sync, to_here() and wait() (measured).
    """

    def wait_done(self, fut: Future[Any]) -> None:
        lock = _allocate_lock()
        lock.acquire()
        if fut._add_callback_if_pending(lambda _f: lock.release()):
            on_block = CALLBACK_ROLE.on_block
            if on_block is not None:  # a callback runner: others' callbacks must not wait for this one
                on_block()
            lock.acquire()  # released once, by the callback


THREAD_BLOCKER: Blocker = _ThreadBlocker()
CURRENT_BLOCKER: contextvars.ContextVar[Blocker | None] = contextvars.ContextVar(
    "twinrpc_blocker", default=None
)


_torch_future_init = torch._C.Future.__init__


class Future(torch.futures.Future[T]):
    """The result of an asynchronous operation: a ``torch.futures.Future``.

    Thread-safe. On completion, waiters wake first, then callbacks run in registration order, after
    the result is set, on whatever completes the future (an RPC worker task), except that user
    callbacks completed on a gloo receiver or timer thread run on a pool thread instead (see the
    module docstring). Callbacks may block.
    """

    __slots__ = ("_callbacks", "_exception", "_label", "_lock", "_receive", "_result", "_waiters")

    def __init__(self, *, devices: list[Any] | None = None) -> None:
        # torch's C++ future underneath stays pending and unused: every method is overridden here
        # (torch.futures' helpers reach twinrpc's through install_torch_hooks).
        _torch_future_init(self, [])
        self._lock = _allocate_lock()
        self._result: Any = _PENDING
        self._exception: BaseException | None = None
        #: run at once on completion: ``wait()``'s wake-ups and the protocol's own callbacks
        self._waiters: list[Callable[[Future[T]], None]] = []
        #: user callbacks (then, add_done_callback): run after the waiters, maybe elsewhere
        self._callbacks: list[Callable[[Future[T]], None]] = []
        #: see ``label``: a string, or a function that makes it (an RPC's future gets one: the text
        #: is read only by deadlock reports and reprs, and making it costs as much as the RPC's pickling)
        self._label: str | Callable[[], str] | None = None
        #: see ``receive_while_waiting``: how a thread blocking on this future may bring its
        #: completion itself (None: it waits on a lock)
        self._receive: Callable[[Future[T]], None] | None = None

    @property
    def label(self) -> str | None:
        """What completes this future, for deadlock reports and reprs (e.g. "reply to CALL#3 from
        worker1")."""
        label = self._label
        return label() if callable(label) else label

    @label.setter
    def label(self, label: str | Callable[[], str] | None) -> None:
        """A string, or a function that makes it when read (for a label that costs to format)."""
        self._label = label

    # -- state -------------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether a result or an exception has been set. Never blocks."""
        return self._result is not _PENDING or self._exception is not None

    def wait(self) -> T:
        """Block until complete; return the result or raise the exception (again on every call)."""
        if self._result is _PENDING and self._exception is None:  # not done()
            blocker = CURRENT_BLOCKER.get()
            if blocker is None:
                receive = self._receive
                if receive is not None:
                    receive(self)  # returns once done, or at once if it cannot receive now
                if self._result is _PENDING and self._exception is None:
                    THREAD_BLOCKER.wait_done(self)
            else:
                blocker.wait_done(self)
        if self._exception is not None:
            raise self._exception
        return self._result  # type: ignore[no-any-return]

    def value(self) -> T:
        """The result of a completed future (raises its exception); an error if not yet complete."""
        if not self.done():
            raise RuntimeError("Future.value() called before the future completed; call wait() instead")
        if self._exception is not None:
            raise self._exception
        return self._result  # type: ignore[no-any-return]

    # -- completion --------------------------------------------------------------------------
    def set_result(self, result: T) -> None:
        """Complete with ``result`` and run the callbacks. A future completes only once."""
        self._complete(result, None)

    def set_exception(self, result: BaseException) -> None:  # type: ignore[override]
        """Complete with an error: ``wait()`` and ``value()`` raise it."""
        if not isinstance(result, BaseException):
            raise TypeError(f"set_exception needs an exception instance, got {type(result).__name__}")
        self._complete(_PENDING, result)

    def try_set_result(self, result: T) -> bool:
        """Complete with ``result`` unless already complete; returns whether it did (atomic)."""
        return self._complete(result, None, strict=False)

    def try_set_exception(self, exc: BaseException) -> bool:
        """Complete with ``exc`` unless already complete; returns whether it did (atomic)."""
        return self._complete(_PENDING, exc, strict=False)

    def _complete(self, result: Any, exc: BaseException | None, strict: bool = True) -> bool:
        with self._lock:
            if self._result is not _PENDING or self._exception is not None:  # done()
                if not strict:
                    return False
                raise RuntimeError("Future can only be marked completed once.")
            if exc is not None:
                self._exception = exc
            else:
                self._result = result
            waiters = self._waiters
            if waiters:
                self._waiters = []
            callbacks = self._callbacks
            if callbacks:
                self._callbacks = []
        for cb in waiters:
            try:  # _run_callback, inlined: every RPC's reply completes a future
                cb(self)
            except Exception:
                _log.exception("twinrpc: a Future callback raised; the error is ignored")
        if callbacks:
            defer = CALLBACK_ROLE.defer
            if defer is None:
                for cb in callbacks:
                    self._run_callback(cb)
            else:
                defer(lambda: self._run_callbacks(callbacks))
        return True

    def _run_callbacks(self, callbacks: list[Callable[[Future[T]], None]]) -> None:
        for cb in callbacks:
            self._run_callback(cb)

    def _run_callback(self, cb: Callable[[Future[T]], None]) -> None:
        try:
            cb(self)
        except Exception:
            _log.exception("twinrpc: a Future callback raised; the error is ignored")

    # -- chaining ----------------------------------------------------------------------------
    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Run ``callback(self)`` when complete (now, if already complete). Its errors are logged.

        Raises:
            TypeError: ``callback`` is not callable (as torch: at once, not when it would run).
        """
        _check_callable("add_done_callback", callback)
        with self._lock:
            if not self.done():
                self._callbacks.append(callback)
                return
        defer = CALLBACK_ROLE.defer
        if defer is None:
            self._run_callback(callback)
        else:
            defer(lambda: self._run_callback(callback))

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A new future completed with ``callback(self)``'s result, or with the error it raised.

        Raises:
            TypeError: ``callback`` is not callable (as torch: at once, not when it would run).
        """
        _check_callable("then", callback)
        out: Future[S] = Future()
        self.add_done_callback(_chain(callback, out))
        return out

    def _add_internal_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """As add_done_callback, for the protocol's own callbacks, which never block: they run at
        once on whatever completes the future (a gloo receiver included; nothing is handed off)."""
        if not self._add_callback_if_pending(callback):
            self._run_callback(callback)

    def _then_internal(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """As then, for the protocol's own callbacks (see _add_internal_callback)."""
        out: Future[S] = Future()
        self._add_internal_callback(_chain(callback, out))
        return out

    def _add_callback_if_pending(self, callback: Callable[[Future[T]], None]) -> bool:
        """Register a waiter (run at once on completion); False if already complete."""
        with self._lock:
            if self._result is not _PENDING or self._exception is not None:  # done()
                return False
            self._waiters.append(callback)
            return True

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("error" if self._exception else "done")
        label = f": {self.label}" if self.label else ""
        return f"<twinrpc Future {state}{label}>"


# -- the protocol's own uses of a Future (package-internal: users have then, add_done_callback, wait) --
def add_internal_callback(fut: Future[T], callback: Callable[[Future[T]], None]) -> None:
    """Run ``callback(fut)`` on completion, on whatever completes ``fut`` (a gloo receiver included):
    for the protocol's own callbacks, which never block."""
    fut._add_internal_callback(callback)


def then_internal(fut: Future[T], callback: Callable[[Future[T]], S]) -> Future[S]:
    """As ``fut.then(callback)``, for the protocol's own callbacks (see :func:`add_internal_callback`)."""
    return fut._then_internal(callback)


def add_waiter(fut: Future[Any], wake: Callable[[Future[Any]], None]) -> bool:
    """Register ``wake`` to run at once when ``fut`` completes; False (nothing registered) if it
    already has. How a world's blocker parks a task on a future."""
    return fut._add_callback_if_pending(wake)


def receive_while_waiting(fut: Future[Any], receive: Callable[[Future[Any]], None]) -> None:
    """A thread of the real world that blocks on ``fut.wait()`` first calls ``receive(fut)``, which
    brings the completion itself (the gloo world's caller receiving its own reply,
    ``Receiver.receive_until`` in impl/_receiver.py) and returns once ``fut`` is done, or returns at
    once if it cannot; the thread then waits as usual. Not under a world's blocker (the simulator's)."""
    fut._receive = receive


def wait_bounded(
    fut: Future[T],
    timeout: float,
    message: Callable[[], str],
    call_later: Callable[[float, Callable[[], Any]], Any],
) -> T:
    """``fut.wait()``, failing with ``RPCTimeoutError(message())`` after ``timeout`` seconds of the
    world's clock (``call_later``: the world's timer); ``timeout <= 0`` waits forever."""
    if timeout > 0 and not fut.done():
        timer = call_later(timeout, lambda: fut.try_set_exception(RPCTimeoutError(message())))
        try:
            return fut.wait()
        finally:
            timer.cancel()
    return fut.wait()


def _check_callable(method: str, callback: Any) -> None:
    if not callable(callback):
        # torch's fragment ("incompatible function arguments"), without pybind's overload listing
        raise TypeError(
            f"{method}(): incompatible function arguments: the callback must be a callable taking the "
            f"Future, got {type(callback).__name__}"
        )


def _chain(callback: Callable[[Future[T]], S], out: Future[S]) -> Callable[[Future[T]], None]:
    """The callback ``then`` registers: complete ``out`` with ``callback(fut)`` or its error."""

    def chain(fut: Future[T]) -> None:
        try:
            value = callback(fut)
        except BaseException as exc:
            # As torch.futures: an error raised by the callback reaches the chained future as a
            # RuntimeError naming the original type (the original is its __cause__).
            err = RuntimeError(
                f"Got the following error when running the callback: {type(exc).__name__}: {exc}"
            )
            err.__cause__ = exc
            out.set_exception(err)
        else:
            out.set_result(value)

    return chain


AnyFuture = Any  # a twinrpc Future or a torch.futures.Future


def collect_all(futures: Sequence[AnyFuture]) -> Future[list[AnyFuture]]:
    """A future of the list of ``futures``, completed once all of them have completed.

    As ``torch.futures.collect_all``: if one of them fails, the combined future fails at once with
    that error, without waiting for the others.
    """
    futures = list(futures)
    out: Future[list[AnyFuture]] = Future()
    if not futures:
        out.set_result([])
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(f: AnyFuture) -> None:
        error = _error_of(f)
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if error is not None:
            out.try_set_exception(error)
        elif last:
            out.try_set_result(futures)

    for f in futures:
        if isinstance(f, Future):
            f._add_internal_callback(one_done)  # one_done never blocks
        else:
            f.add_done_callback(one_done)
    return out


def wait_all(futures: Sequence[AnyFuture]) -> list[Any]:
    """Wait for every future and return their results; raise the first error as soon as it is seen."""
    futures = list(futures)
    collect_all(futures).wait()
    return [f.wait() for f in futures]


def _error_of(f: AnyFuture) -> BaseException | None:
    if isinstance(f, Future):
        return f._exception
    try:
        f.value()
    except BaseException as exc:
        return exc
    return None


def install_torch_hooks() -> None:
    """Let upstream ``torch.futures.collect_all`` and ``torch.futures.wait_all`` take twinrpc futures.

    Both call ``torch._C._collect_all`` at call time, which combines the C++ futures underneath; a
    twinrpc future's C++ future never completes (nothing but twinrpc's own methods is used, see
    ``Future.__init__``), and a C++ wait would block the OS thread, and in the simulator every simulated
    worker with it. So ``torch._C._collect_all`` is wrapped: a list that holds a twinrpc future goes to
    :func:`collect_all` (values in input order, fails at once with the first error, waits through the
    world's blocker); any other argument goes to torch's own, unchanged. Idempotent; done once when
    this module is imported (no twinrpc future can exist before).
    """
    current = getattr(torch._C, "_collect_all", None)
    if current is None:
        return
    original = getattr(current, "_twinrpc_original", current)

    def _collect_all(futures: Any) -> Any:
        try:
            items = list(futures)
        except TypeError:
            return original(futures)
        for f in items:
            if isinstance(f, Future):
                return collect_all(items)
        return original(futures)

    _collect_all._twinrpc_original = original  # type: ignore[attr-defined]
    _collect_all.__doc__ = original.__doc__
    torch._C._collect_all = _collect_all


install_torch_hooks()
