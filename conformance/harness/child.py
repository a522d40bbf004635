"""Worker-process side of a :class:`~conformance.harness.ProcessBackend` (never runs in pytest).

A child is forked by a forkserver that preloaded torch and its context's modules (or a ``spawn``-started
interpreter, see :mod:`conformance.harness.processes`). It imports its context's ``rpc`` module at once
(warm), then waits for its first message:

* ``("serve", header, b"")``: become rank ``header["rank"]`` of a pool world: ``init_rpc`` once (with
  :meth:`ProcessContext.pool_options`), then loop on ``("call", header, payload)`` messages, running
  each program in the MAIN thread while the RPC agent's own threads keep serving peers, until
  ``("shutdown", ...)`` or EOF.
* ``("once", header, payload)``: run one ``world.spawn`` program with RPC not initialised, reply, exit.
* ``("exit", ...)``: an unused spare is being released.

``payload`` is ``pickle.dumps((fn, args))`` kept as a separate blob so a payload that cannot be
unpickled here (e.g. a module that fails to import) still gets a readable harness error back.

Replies are pickled tuples: ``("ok", value, healthy)``, ``("raised", exc, traceback_text, healthy)``,
``("harness", message, healthy)`` and ``("ready", pid, True)``. ``healthy`` is False when the
program left this rank's RPC agent shut down, telling the parent to rebuild the pool.

What a child serves is decided by its :class:`ProcessContext` subclass: the modules ``ctx`` exposes,
the options a pool world starts with, and how to tell whether the RPC agent is still up.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from .context import WorldContext

__all__ = ["ProcessContext", "main"]


class ProcessContext(WorldContext):
    """``ctx`` in a worker process of a :class:`~conformance.harness.ProcessBackend`.

    Subclass it to serve another implementation: set ``MODULES`` (attribute -> dotted module name, as
    for every :class:`WorldContext`), and override :meth:`pool_options`, :meth:`_make_options` or
    :meth:`agent_alive` when the implementation's options or agent bookkeeping differ from
    ``torch.distributed.rpc``'s. The class must be importable by its module name: it is pickled by
    reference into the worker processes.

    Rendezvous are ``file://`` paths under a directory private to the call (``base_dir``), so
    parallel runs never race for TCP ports.
    """

    def __init__(self, *, rank: int, world_size: int, backend: str, spawned: bool, base_dir: str) -> None:
        super().__init__(rank=rank, world_size=world_size, backend=backend, spawned=spawned)
        self._base_dir = base_dir

    @classmethod
    def rpc_module(cls) -> ModuleType:
        """The module that plays ``torch.distributed.rpc`` (``MODULES["rpc"]``)."""
        return importlib.import_module(cls.MODULES["rpc"])

    @classmethod
    def pool_options(cls, init_method: str) -> Any:
        """Options a pool world's ranks pass to ``init_rpc`` (``world.run`` worlds).

        Default: ``rpc.TensorPipeRpcBackendOptions(init_method=init_method)``.
        """
        return cls.rpc_module().TensorPipeRpcBackendOptions(init_method=init_method)

    @classmethod
    def agent_alive(cls) -> bool:
        """Whether this process's RPC agent is still installed (not shut down by the program).

        Default: ``rpc._is_current_rpc_agent_set()``, private but stable in PyTorch since 1.6. A pool
        rank whose program shut RPC down is replaced before the next test.
        """
        return bool(cls.rpc_module()._is_current_rpc_agent_set())

    def _make_options(self, k: int, /, **kwargs: Any) -> Any:
        # One file per (world, k) under a directory private to this call: collision-free across tests
        # and pytest-xdist workers without reserving TCP ports, and never reused (a FileStore file must
        # not be recycled between rendezvous).
        Path(self._base_dir).mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("init_method", f"file://{self._base_dir}/rendezvous-{k}")
        return self.rpc.TensorPipeRpcBackendOptions(**kwargs)

    def crash(self) -> NoReturn:
        """SIGKILL this process: no cleanup, sockets closed by the kernel, as a real crash."""
        self._check_crash_allowed()
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL did not kill the process")  # pragma: no cover


#: Set by :func:`main` in each child: the context class and backend name of this process.
_CONTEXT: type[ProcessContext] = ProcessContext
_BACKEND = ""


def _exit(code: int = 0) -> NoReturn:
    # os._exit: skip interpreter teardown, which can block on a half-shut RPC agent's threads.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the pytest process is gone, even while the main thread is stuck in a program.

    A spawned child is the pytest process's own child (its parent changes when that process dies); a
    forked one is the forkserver's, which outlives pytest while children hold it open, so the pytest
    process's pid is checked as well.
    """
    first_parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != first_parent:
            os._exit(70)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(70)
        except PermissionError:  # a pid taken over by another user's process: the parent is gone
            os._exit(70)


def _encode_exception(exc: BaseException, healthy: bool) -> bytes:
    """Pickle a program's exception with its type kept; fall back to a RuntimeError carrying the text."""
    tb = "".join(traceback.format_exception(exc))
    try:
        blob = pickle.dumps(("raised", exc, tb, healthy))
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt (required __init__ args)
        return blob
    except Exception:
        name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        fallback = RuntimeError(f"{name}: {exc!r} (original exception could not be pickled)\n{tb}")
        return pickle.dumps(("raised", fallback, tb, healthy))


def _run_program(header: dict[str, Any], payload: bytes, *, spawned: bool) -> bytes:
    """Unpickle and run one program; always returns an encoded reply, never raises."""
    rank = header["rank"]
    for entry in header.get("sys_path", ()):
        if entry not in sys.path:
            sys.path.append(entry)
    try:
        fn, args = pickle.loads(payload)
    except BaseException as exc:
        message = f"rank {rank} could not unpickle the program: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        return pickle.dumps(("harness", message, True))
    ctx = _CONTEXT(
        rank=rank,
        world_size=header["world_size"],
        backend=_BACKEND,
        spawned=spawned,
        base_dir=header["base_dir"],
    )
    try:
        value = fn(ctx, *args)
    except BaseException as exc:
        return _encode_exception(exc, spawned or _CONTEXT.agent_alive())
    healthy = spawned or _CONTEXT.agent_alive()
    try:
        return pickle.dumps(("ok", value, healthy))
    except Exception as exc:
        message = (
            f"the value {fn.__qualname__} returned on rank {rank} could not be pickled "
            f"({type(exc).__name__}: {exc}); return plain data (numbers, strings, tensors, tuples)"
        )
        return pickle.dumps(("harness", message, healthy))


def _serve(conn: Connection, header: dict[str, Any]) -> NoReturn:
    rpc: Any = _CONTEXT.rpc_module()
    rank, world_size = header["rank"], header["world_size"]
    try:
        options = _CONTEXT.pool_options(header["init_method"])
        rpc.init_rpc(WorldContext.name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    except BaseException as exc:
        conn.send_bytes(_encode_exception(exc, False))
        _exit(1)
    default_timeout = rpc.get_rpc_timeout()
    conn.send_bytes(pickle.dumps(("ready", os.getpid(), True)))
    while True:
        try:
            kind, header, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            _exit(0)
        if kind == "call":
            reply = _run_program(header, payload, spawned=False)
            # Agent-global settings a program may change must not leak into the next test.
            if _CONTEXT.agent_alive() and rpc.get_rpc_timeout() != default_timeout:
                rpc._set_rpc_timeout(default_timeout)
            conn.send_bytes(reply)
        elif kind == "shutdown":
            try:
                rpc.shutdown(graceful=True)
                reply = pickle.dumps(("ok", None, False))
            except BaseException as exc:
                reply = _encode_exception(exc, False)
            conn.send_bytes(reply)
            _exit(0)
        else:
            conn.send_bytes(pickle.dumps(("harness", f"unknown command {kind!r}", False)))


def main(
    conn: Connection,
    parent_pid: int,
    stack_path: str,
    context: type[ProcessContext],
    backend: str,
    environ: dict[str, str] | None = None,
) -> None:
    """Entry point of every worker process of a process backend (see the module docstring).

    Args:
        conn: This child's end of the pipe to the pytest process.
        parent_pid: The pytest process; the child exits on its own when that process is gone.
        stack_path: File faulthandler writes all threads' stacks to on SIGUSR1 (sent before a hung
            world is killed).
        context: The :class:`ProcessContext` subclass programs receive as ``ctx``.
        backend: The backend's name (``ctx.backend``).
        environ: The pytest process's environment when it started this child: a forked child has
            the forkserver's (as of that server's start) until it takes this one.
    """
    global _CONTEXT, _BACKEND
    if environ is not None and environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    _CONTEXT, _BACKEND = context, backend
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    # The parent sends SIGUSR1 before killing a hung world, so the failure shows where it hung.
    stack_file = open(stack_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\..*")
    context.rpc_module()  # warm the import so the first program starts fast

    try:
        kind, header, payload = pickle.loads(conn.recv_bytes())
    except EOFError:
        _exit(0)
    if kind == "serve":
        _serve(conn, header)
    elif kind == "once":
        conn.send_bytes(_run_program(header, payload, spawned=True))
        _exit(0)
    _exit(0)
