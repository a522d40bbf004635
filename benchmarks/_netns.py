"""Two hosts on one machine for the benchmarks: two Linux network namespaces joined by a veth pair.

The setup ``tests/gloo/test_two_hosts.py`` uses too: each namespace has only its own private address (10.214.N.1 or
.2) and a loopback, so every byte between the two workers crosses the veth pair, as between two
machines; the workers find each other by that address, and ``GLOO_SOCKET_IFNAME`` names each side's
interface. The gloo world's same-host path (shared memory) stays off between namespaces: its discovery
compares the network namespace too (impl/_same_host.py).

A benchmark worker enters its namespace first thing in its (spawned, still single-threaded) process with
:func:`enter`, so it can keep the pipe to its parent. Needs root and iproute2's ``ip``; :func:`why_not`
says what is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its end of the veth pair, its address."""

    netns: str
    ifname: str
    address: str


def why_not() -> str | None:
    """Why two namespaces cannot be made here (None: they can, as far as can be told without trying)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is missing: apt-get install iproute2"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()})"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class NoNamespaces(RuntimeError):
    """The kernel (or the container) refuses to make a network namespace here."""


@contextlib.contextmanager
def two_hosts(name: str = "twinrpc-bench", net: int = 214) -> Iterator[tuple[Host, Host]]:
    """Namespaces ``<name>-<pid>-a`` and ``-b`` with a veth pair between them, at 10.<net>.N.1 and
    .2; removed on exit. (The tests use another name and ``net``, so both can run at once.)

    Raises:
        NoNamespaces: ``why_not()`` has a reason, or making the first namespace failed.
        RuntimeError: another step failed (naming the command and what it said).
    """
    reason = why_not()
    if reason is not None:
        raise NoNamespaces(f"two hosts: {reason}")
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.{net}.{os.getpid() % 250}"
    short = "".join(word[0] for word in name.split("-"))  # interface names are 15 characters at most
    a = Host(f"{name}-{tag}-a", f"{short}{tag}a", f"{subnet}.1")
    b = Host(f"{name}-{tag}-b", f"{short}{tag}b", f"{subnet}.2")
    created: list[str] = []
    try:
        for host in (a, b):
            try:
                _ip("netns", "add", host.netns)
            except subprocess.CalledProcessError as exc:
                msg = f"two hosts: cannot create a network namespace: {exc.stderr.strip() or exc}"
                raise NoNamespaces(msg) from None
            created.append(host.netns)
        # the veth pair is created here and both ends moved into the namespaces
        _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        for host in (a, b):
            _ip("link", "set", host.ifname, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield a, b
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"two hosts: {' '.join(exc.cmd)} failed: {exc.stderr.strip() or exc}") from None
    finally:
        for netns in created:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


def enter(host: Host) -> None:
    """Move the calling process (its only thread) into ``host``'s namespace and make gloo and
    TensorPipe use its interface (both otherwise pick one from the hostname, which names the machine's
    own address). Call it before anything opens a socket or starts a thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{host.netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {host.netns}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = host.ifname
    os.environ["TP_SOCKET_IFNAME"] = host.ifname
