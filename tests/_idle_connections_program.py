"""Idle connections to a gloo worker's listener (tests/security/test_gloo_exposure.py): worker1 starts with a
soft open-file limit of LOW and a hard one of HIGH, as under ``ulimit -n``; worker0 opens IDLE
connections to worker1's loopback listening ports, more than LOW, then calls worker1 again. Run as
a script it is one gloo worker (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) and prints worker0's
findings as JSON."""

from __future__ import annotations

import json
import os
import resource
import socket
import time

import twinrpc.rpc as rpc

LOW, HIGH = 256, 2048
IDLE = 600
_LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def loopback_listening_ports() -> list[int]:
    """The TCP ports this process listens on at 127.0.0.1 (its sockets' inodes, found in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            address, state, inode = fields[1], fields[3], fields[9]
            ip, port = address.split(":")
            if state == _LISTEN and inode in inodes and ip == "0100007F":  # 127.0.0.1, little-endian
                ports.append(int(port, 16))
    return sorted(ports)


def main(rank: int) -> dict[str, object]:
    if rank == 1:  # the victim; the attacker keeps its own limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, HIGH))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: dict[str, object] = {}
    if rank == 0:
        out["worker1's soft limit"] = rpc.rpc_sync("worker1", soft_limit)
        ports = rpc.rpc_sync("worker1", loopback_listening_ports)
        out["listening ports"] = len(ports)
        idle = []
        for i in range(IDLE):
            conn = socket.create_connection(("127.0.0.1", ports[i % len(ports)]), timeout=5)
            idle.append(conn)
        time.sleep(1.0)  # gloo's listener accepts them
        out["worker1's open files while attacked"] = rpc.rpc_sync("worker1", open_files)
        out["answer while attacked"] = rpc.rpc_sync("worker1", pow, args=(2, 10))
        for conn in idle:
            conn.close()
        out["answer after"] = rpc.rpc_sync("worker1", pow, args=(3, 3))
    rpc.shutdown()
    return out


if __name__ == "__main__":
    # by its module name, so its functions travel under their module's name
    import _idle_connections_program as by_name

    print(json.dumps(by_name.main(int(os.environ["RANK"]))))
