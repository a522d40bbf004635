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

import sys
from collections.abc import Iterator

import pytest
from _launch import ROOT, base_env, run_all

sys.path.insert(0, str(ROOT / "benchmarks"))
import _netns
from _netns import Host

WORKER = ROOT / "tests" / "_launch_worker.py"


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Namespaces A and B, a veth pair between them, 10.213.N.1 in A and 10.213.N.2 in B; removed after
    (benchmarks/_netns.py, which the two-host benchmarks use too)."""
    try:
        with _netns.two_hosts("twinrpc", net=213) as hosts:
            yield hosts
    except _netns.NoNamespaces as exc:
        pytest.skip(str(exc))


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
