"""Worker-process side of the torch backend (runs in ``spawn``-started interpreters, never in pytest).

A child starts warm (torch.distributed.rpc imported), then waits for its first message:

* ``("serve", header, b"")``: become rank ``header["rank"]`` of a pool world: ``init_rpc`` once, then
  loop on ``("call", header, payload)`` messages, running each program in the MAIN thread while the
  RPC agent's own threads keep serving peers, until ``("shutdown", ...)`` or EOF.
* ``("once", header, payload)``: run one ``world.spawn`` program with RPC not initialised, reply, exit.
* ``("exit", ...)``: an unused spare is being released.

``payload`` is ``pickle.dumps((fn, args))`` kept as a separate blob so a payload that cannot be
unpickled here (e.g. a module that fails to import) still gets a readable harness error back.

Replies are pickled tuples: ``("ok", value, healthy)``, ``("raised", exc, traceback_text, healthy)``,
``("harness", message, healthy)`` and ``("ready", pid, True)``. ``healthy`` is False when the
program left this rank's RPC agent shut down, telling the parent to rebuild the pool.
"""

from __future__ import annotations

import faulthandler
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
from typing import Any, NoReturn

from ._context import WorldContext

__all__ = ["TorchContext", "main"]


#: The modules ``ctx`` exposes for each flavour of real-process backend: upstream PyTorch (the oracle)
#: and twinrpc's own gloo world. Both take ``TensorPipeRpcBackendOptions`` (twinrpc accepts PyTorch's).
FLAVOURS: dict[str, dict[str, str]] = {
    "torch": {
        "rpc": "torch.distributed.rpc",
        "dist_autograd": "torch.distributed.autograd",
        "optim": "torch.distributed.optim",
        "futures": "torch.futures",
    },
    "gloo": {
        "rpc": "twinrpc.rpc",
        "dist_autograd": "twinrpc.autograd",
        "optim": "twinrpc.optim",
        "futures": "twinrpc.futures",
    },
}
_FLAVOUR = "torch"


class TorchContext(WorldContext):
    """``ctx`` in a real process: the flavour's modules and TensorPipe options on file:// rendezvous."""

    MODULES = FLAVOURS["torch"]

    def __init__(self, *, rank: int, world_size: int, spawned: bool, base_dir: str) -> None:
        super().__init__(rank=rank, world_size=world_size, backend=_FLAVOUR, spawned=spawned)
        self._base_dir = base_dir

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


class GlooContext(TorchContext):
    """``ctx`` on twinrpc's gloo world: twinrpc's modules, same options and rendezvous."""

    MODULES = FLAVOURS["gloo"]


_CONTEXTS: dict[str, type[TorchContext]] = {"torch": TorchContext, "gloo": GlooContext}


def _exit(code: int = 0) -> NoReturn:
    # os._exit: skip interpreter teardown, which can block on a half-shut RPC agent's threads.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the pytest process is gone, even while the main thread is stuck in a program."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(70)


def _rpc() -> Any:
    import importlib

    return importlib.import_module(FLAVOURS[_FLAVOUR]["rpc"])


def _agent_alive() -> bool:
    if _FLAVOUR == "gloo":
        from twinrpc._current import maybe_current_agent

        return maybe_current_agent() is not None
    import torch.distributed.rpc as rpc

    # Private but stable since torch 1.6: whether init_rpc's agent is still installed (not shut down).
    return bool(rpc._is_current_rpc_agent_set())  # type: ignore[attr-defined]


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
    ctx = _CONTEXTS[_FLAVOUR](
        rank=rank, world_size=header["world_size"], spawned=spawned, base_dir=header["base_dir"]
    )
    try:
        value = fn(ctx, *args)
    except BaseException as exc:
        return _encode_exception(exc, spawned or _agent_alive())
    healthy = spawned or _agent_alive()
    try:
        return pickle.dumps(("ok", value, healthy))
    except Exception as exc:
        message = (
            f"the value {fn.__qualname__} returned on rank {rank} could not be pickled "
            f"({type(exc).__name__}: {exc}); return plain data (numbers, strings, tensors, tuples)"
        )
        return pickle.dumps(("harness", message, healthy))


def _serve(conn: Connection, header: dict[str, Any]) -> NoReturn:
    rpc = _rpc()
    rank, world_size = header["rank"], header["world_size"]
    try:
        options = rpc.TensorPipeRpcBackendOptions(init_method=header["init_method"])
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)  # type: ignore[no-untyped-call]
    except BaseException as exc:
        conn.send_bytes(_encode_exception(exc, False))
        _exit(1)
    default_timeout = rpc.get_rpc_timeout()  # type: ignore[attr-defined]
    conn.send_bytes(pickle.dumps(("ready", os.getpid(), True)))
    while True:
        try:
            kind, header, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            _exit(0)
        if kind == "call":
            reply = _run_program(header, payload, spawned=False)
            # Agent-global settings a program may change must not leak into the next test.
            if _agent_alive() and rpc.get_rpc_timeout() != default_timeout:  # type: ignore[attr-defined]
                rpc._set_rpc_timeout(default_timeout)  # type: ignore[attr-defined]
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


def main(conn: Connection, parent_pid: int, stack_path: str, flavour: str = "torch") -> None:
    """Entry point of every real-process backend child (see the module docstring)."""
    global _FLAVOUR
    _FLAVOUR = flavour
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    # The parent sends SIGUSR1 before killing a hung world, so the failure shows where it hung.
    stack_file = open(stack_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\..*")
    _rpc()  # warm the import so the first program starts fast

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
