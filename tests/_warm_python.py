"""``python ARGS`` for the docs examples, without paying for ``import torch`` every time.

Every docs example is a program run as ``python docs/examples/x.py`` (or ``python -m ...``), and most
of a short one's time was the interpreter importing torch and twinrpc, then tearing them down. A
:class:`WarmPython` is one interpreter per pytest process that imports them once (and nothing else
runs in it); for each command it forks a child that becomes that command: its own working directory,
environment, ``sys.argv``, ``sys.path[0]`` and ``__main__``, stdin from /dev/null, stdout and stderr to
files. The child runs what an interpreter runs at exit (non-daemon threads joined, ``atexit``) and
then leaves with the program's exit status, skipping only the module teardown. Processes the
program starts (``mp.spawn``, torchrun's workers) are fresh interpreters, as before.

Only for programs whose work happens in the processes they start: a forked child keeps the warm
interpreter's history (torch's state, the cyclic collector's counts), so a program that computes in
this process, as one run on the simulator does, could see other results than in a new interpreter.

``TWINRPC_DOCS_COLD=1`` runs every command in a new interpreter instead (to rule this out).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: what every docs example imports; nothing here starts a thread or touches a device before the fork
PRELOAD = ("torch", "torch.multiprocessing", "torch.distributed", "numpy", "twinrpc.rpc")


class WarmPython:
    """A warm interpreter serving ``python ARGS`` commands, one at a time (see the module docstring)."""

    def __init__(self, env: Mapping[str, str], cwd: Path) -> None:
        self._env = dict(env)
        self._dir = Path(tempfile.mkdtemp(prefix="twinrpc-warm-"))
        self._server = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            cwd=cwd,
            env=self._env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._count = 0

    def run(
        self, args: Sequence[str], *, env: Mapping[str, str], cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run([python, *args], ...)`` with text output captured, in a forked child."""
        if env != self._env:  # imports read the environment: only the one it started with is warm
            return _cold(args, env=env, cwd=cwd, timeout=timeout)
        self._count += 1
        out, err = self._dir / f"{self._count}.out", self._dir / f"{self._count}.err"
        request = {"argv": list(args), "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        assert self._server.stdin is not None and self._server.stdout is not None
        self._server.stdin.write((json.dumps(request) + "\n").encode())
        self._server.stdin.flush()
        pid = int(self._read_line(timeout=300))  # the first call waits for the imports
        try:
            returncode = int(self._read_line(timeout=timeout))
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)  # the child and whatever it started
            self._read_line(timeout=30)
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None
        finally:
            stdout, stderr = _take(out), _take(err)
        return subprocess.CompletedProcess([sys.executable, *args], returncode, stdout, stderr)

    def _read_line(self, timeout: float) -> str:
        assert self._server.stdout is not None
        fd = self._server.stdout.fileno()
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1)
            if not chunk:
                raise RuntimeError(f"the warm interpreter exited ({self._server.wait()})")
            line += chunk
        return line.decode()

    def close(self) -> None:
        if not self._dir.exists():  # closed already
            return
        if self._server.poll() is None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
        for path in self._dir.iterdir():
            path.unlink()
        self._dir.rmdir()


def _take(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    path.unlink()
    return text


def _cold(
    args: Sequence[str], *, env: Mapping[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout
    )


_WARM: WarmPython | None = None


def python(
    args: Sequence[str], *, env: Mapping[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` (text output captured): in this process's warm interpreter, started on first use,
    or in a new one with ``TWINRPC_DOCS_COLD=1``."""
    global _WARM
    if os.environ.get("TWINRPC_DOCS_COLD") == "1":
        return _cold(args, env=env, cwd=cwd, timeout=timeout)
    if _WARM is None:
        import atexit

        _WARM = WarmPython(env, cwd)
        atexit.register(_WARM.close)
    return _WARM.run(args, env=env, cwd=cwd, timeout=timeout)


def close() -> None:
    """Stop this process's warm interpreter, if it started one (a later command starts another)."""
    global _WARM
    if _WARM is not None:
        _WARM.close()
        _WARM = None


# -- the warm interpreter (this file run as a script) --------------------------------------------------
def _serve() -> None:
    """Read one JSON request a line from stdin; fork a child per request; write its pid, then its exit
    status, a line each, to stdout. Exits when stdin closes (the pytest process is gone)."""
    for name in PRELOAD:
        __import__(name)
    requests, replies = sys.stdin.buffer, sys.stdout.fileno()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_become(request))
        os.write(replies, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(replies, f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _become(request: dict[str, Any]) -> int:
    """In the forked child: run ``python ARGV`` as the interpreter would; its exit status."""
    import atexit
    import runpy
    import threading
    import traceback
    import types
    from importlib.machinery import SourceFileLoader

    os.setpgid(0, 0)  # a timeout kills the whole group
    os.chdir(request["cwd"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    args = request["argv"]
    code = 0
    try:
        if args[0] == "-m":  # python -m NAME ARGS: runpy, as the interpreter does it
            sys.argv = ["-m", *args[2:]]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(args[1], alter_argv=True)  # type: ignore[attr-defined]
        else:  # python FILE ARGS
            path = os.path.abspath(args[0])
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(path)
            main = types.ModuleType("__main__")
            main.__dict__.update(
                __file__=path, __cached__=None, __builtins__=__builtins__, __spec__=None,
                __loader__=SourceFileLoader("__main__", path),
            )  # fmt: skip
            sys.modules["__main__"] = main
            with open(path, "rb") as f:
                source = f.read()
            exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # what Py_FinalizeEx does before it tears the modules down
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    return code


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _serve()
