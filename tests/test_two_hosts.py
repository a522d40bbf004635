"""Two hosts: one worker in each of two Linux network namespaces joined by a veth pair (LIFE-4).

Each namespace has only its own private address (10.213.N.1 or .2, assigned inside the namespaces this
test creates) and a loopback, so every byte between the workers crosses the veth pair and nothing leaves
the namespaces. The worker in B finds the world by MASTER_ADDR = A's address, exactly as a second
machine would; GLOO_SOCKET_IFNAME names each side's interface, because gloo otherwise picks its
interface from the hostname.

Needs root and iproute2's ``ip``; where either is missing, or the kernel refuses namespaces, the test
skips and says which (``apt-get install iproute2`` provides ``ip``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from _launch import ROOT, base_env, run_all

WORKER = ROOT / "tests" / "_launch_worker.py"


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str
    address: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _why_no_namespaces() -> str | None:
    if sys.platform != "linux":
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is missing: apt-get install iproute2"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()})"
    return None


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Namespaces A and B, a veth pair between them, 10.213.N.1 in A and 10.213.N.2 in B; removed after."""
    reason = _why_no_namespaces()
    if reason is not None:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250}"
    a = Host(f"twinrpc-{tag}-a", f"tr{tag}a", f"{subnet}.1")
    b = Host(f"twinrpc-{tag}-b", f"tr{tag}b", f"{subnet}.2")
    created: list[str] = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.netns)
            created.append(host.netns)
    except subprocess.CalledProcessError as exc:
        for netns in created:
            _ip("netns", "del", netns)
        pytest.skip(f"cannot create a network namespace: {exc.stderr.strip() or exc}")
    try:
        # The veth pair is created in the test's namespace and both ends moved out at once.
        _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        for host in (a, b):
            _ip("link", "set", host.ifname, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for netns in created:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


@pytest.mark.spec("LIFE-4")
def test_workers_on_two_hosts_rendezvous_by_master_addr_and_exchange_tensors(
    two_hosts: tuple[Host, Host],
) -> None:
    a, b = two_hosts
    commands = []
    for rank, host in enumerate((a, b)):
        env = base_env(
            MASTER_ADDR=a.address,  # rank 0's host: for B, the other namespace
            MASTER_PORT="29500",  # free: nothing else lives in these namespaces
            RANK=str(rank),
            WORLD_SIZE="2",
            GLOO_SOCKET_IFNAME=host.ifname,
        )
        commands.append((["ip", "netns", "exec", host.netns, sys.executable, str(WORKER), "two-hosts"], env))
    results = run_all(commands, ROOT)
    for rank, res in enumerate(results):
        res.check_clean()
        assert res.stdout.splitlines() == [
            f"rank {rank}: peer in another network namespace ok",
            f"rank {rank}: tensors ok",
            f"rank {rank}: shutdown ok",
        ], res.describe()
