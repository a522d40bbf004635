"""Futures that block correctly in both worlds.

``Future`` has the methods of ``torch.futures.Future``. How a waiting caller blocks is the world's
business: a simulated task parks its greenlet and hands control to the scheduler, a real thread waits on
an event. The world installs its blocker in a context variable, so the same ``wait()`` works in both.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
S = TypeVar("S")

_log = logging.getLogger("twinrpc")
_PENDING = object()


class Blocker(Protocol):
    """How the current task waits for a future to complete."""

    def wait_done(self, fut: Future[Any]) -> None: ...


class _ThreadBlocker:
    """The real world: block this OS thread on a lock released by the completing thread.

    A bare lock rather than a threading.Event: the Event's Condition is Python code, ~5 us more of
    GIL-held work per wait on every rpc_sync, to_here() and wait() (measured).
    """

    def wait_done(self, fut: Future[Any]) -> None:
        lock = _allocate_lock()
        lock.acquire()
        if fut._add_callback_if_pending(lambda _f: lock.release()):
            lock.acquire()  # released once, by the callback


THREAD_BLOCKER: Blocker = _ThreadBlocker()
CURRENT_BLOCKER: contextvars.ContextVar[Blocker | None] = contextvars.ContextVar(
    "twinrpc_blocker", default=None
)


def current_blocker() -> Blocker:
    blocker = CURRENT_BLOCKER.get()
    return THREAD_BLOCKER if blocker is None else blocker


class Future(Generic[T]):
    """The result of an asynchronous operation, as ``torch.futures.Future``.

    Thread-safe. Callbacks run in registration order on whichever task completes the future (in
    twinrpc, an RPC worker task), after the result is set; they may block.
    """

    __slots__ = ("__weakref__", "_callbacks", "_exception", "_lock", "_result", "label")

    def __init__(self, *, devices: list[Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._result: Any = _PENDING
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future[T]], None]] = []
        #: what completes this future, for deadlock reports and reprs (e.g. "reply to CALL#3 from worker1")
        self.label: str | None = None

    # -- state -------------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether a result or an exception has been set. Never blocks."""
        return self._result is not _PENDING or self._exception is not None

    def wait(self) -> T:
        """Block until complete; return the result or raise the exception (again on every call)."""
        if not self.done():
            current_blocker().wait_done(self)
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

    def set_exception(self, result: BaseException) -> None:
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
            if self.done():
                if not strict:
                    return False
                raise RuntimeError("Future can only be marked completed once.")
            if exc is not None:
                self._exception = exc
            else:
                self._result = result
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            self._run_callback(cb)
        return True

    def _run_callback(self, cb: Callable[[Future[T]], None]) -> None:
        try:
            cb(self)
        except Exception:
            _log.exception("twinrpc: a Future callback raised; the error is ignored")

    # -- chaining ----------------------------------------------------------------------------
    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Run ``callback(self)`` when complete (now, if already complete). Its errors are logged."""
        if self._add_callback_if_pending(callback):
            return
        self._run_callback(callback)

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A new future completed with ``callback(self)``'s result, or with the error it raised."""
        out: Future[S] = Future()

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

        self.add_done_callback(chain)
        return out

    def _add_callback_if_pending(self, callback: Callable[[Future[T]], None]) -> bool:
        with self._lock:
            if self.done():
                return False
            self._callbacks.append(callback)
            return True

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("error" if self._exception else "done")
        label = f": {self.label}" if self.label else ""
        return f"<twinrpc Future {state}{label}>"


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
