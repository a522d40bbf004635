"""Where a worker's job key comes from: ``auth_key=``, a key file, or the environment.

The environment is the weakest place for a secret: every child process inherits it and it is easy to
print. So ``TWINRPC_AUTH_KEY`` is read once and removed (its bytes overwritten first, so that
``/proc/<pid>/environ`` no longer shows them on Linux), and ``TWINRPC_AUTH_KEY_FILE`` names a file
instead, which must be readable by its owner only; the file's path is no secret and stays in the
environment for the processes a launcher starts.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
from typing import Any

#: the environment variable a launcher may set to the job's key; read once, then removed from the
#: process's environment (see ``auth_key``)
AUTH_KEY_ENV = "TWINRPC_AUTH_KEY"
#: the environment variable naming a file that holds the job's key, readable by its owner only
AUTH_KEY_FILE_ENV = "TWINRPC_AUTH_KEY_FILE"


class _EnvironmentKey:
    """The key taken from ``TWINRPC_AUTH_KEY``: the variable is removed from ``os.environ`` when read
    (so the process's children and later readers of the environment do not see it), and the key is
    kept here for the process's later ``init_rpc`` calls (every simulated worker, a second run)."""

    key: bytes | None = None


def auth_key_of(options: Any) -> bytes | None:
    """The job's key a worker runs with: ``options.auth_key``, else the file named by
    ``TWINRPC_AUTH_KEY_FILE``, else ``TWINRPC_AUTH_KEY`` (UTF-8; removed from the environment once
    read), else None (no key). Both worlds ask this, so they agree on which workers share a key.

    Raises:
        ValueError: a variable is set but empty, both are set, or the key file is empty or can be
            read or written by its group or others.
        OSError: the key file cannot be read.
    """
    key = getattr(options, "auth_key", None)  # a subclass may skip RpcBackendOptions.__init__
    if key is not None:
        return bytes(key)
    text = os.environ.get(AUTH_KEY_ENV)
    if text is not None:
        _scrub_environment_block(AUTH_KEY_ENV)
        del os.environ[AUTH_KEY_ENV]
        if not text:
            raise ValueError(
                f"{AUTH_KEY_ENV} is set but empty: set it to the job's secret (the same on every worker) or "
                "unset it to run without authentication"
            )
        _EnvironmentKey.key = text.encode()
    path = os.environ.get(AUTH_KEY_FILE_ENV)
    if path is None:
        return _EnvironmentKey.key
    if text is not None:
        raise ValueError(
            f"both {AUTH_KEY_ENV} and {AUTH_KEY_FILE_ENV} are set: set one (the file keeps the key out of "
            "the environment)"
        )
    return _read_key_file(path)


def _read_key_file(path: str) -> bytes:
    """The key in ``path`` (one trailing newline dropped), refused unless only its owner can read it."""
    if not path:
        raise ValueError(f"{AUTH_KEY_FILE_ENV} is set but empty: set it to the path of the job's key file")
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"the key file {path} ({AUTH_KEY_FILE_ENV}) can be read or written by its group or others "
                f"(mode {stat.filemode(mode)}): anyone who reads it can run code on the job's workers. "
                f"Make it readable by its owner only (chmod 600 {path})"
            )
        key = f.read()
    key = key[:-1] if key.endswith(b"\n") else key
    if not key:
        raise ValueError(f"the key file {path} ({AUTH_KEY_FILE_ENV}) is empty: write the job's secret to it")
    return key


def _scrub_environment_block(name: str) -> None:
    """Overwrite the value of ``name`` in the C environment before it is removed: ``unsetenv`` only
    drops the pointer, and ``/proc/<pid>/environ`` shows the process's first environment block, so the
    key would stay readable there. Best effort, Linux only; the key was readable until now anyway."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    except (OSError, ValueError):
        return
    prefix = name.encode() + b"="
    i = 0
    while environ[i]:
        entry = ctypes.string_at(environ[i])
        if entry.startswith(prefix):
            ctypes.memset(environ[i] + len(prefix), ord("*"), len(entry) - len(prefix))
        i += 1
