"""The lost update the explore tests plant, shared by ``test_sim_explore.py`` and
``test_sim_pytest_plugin.py``: two trainers each read a server's counter and write back value + 1,
three times; trainer 2 starts 1.1 ms after trainer 1 (whose first call also makes its link), so only a delayed message (or an unlucky seed)
makes one trainer's read land between the other's read and write. ``ATOMIC = True`` is the fix.
"""

from __future__ import annotations

COUNTER_PROGRAM = """import twinrpc.rpc as rpc
from twinrpc.simulator import sleep

ATOMIC = False  # the fix: increment on the server, in one RPC
_counters = {}


def read():
    return _counters.get(rpc.get_worker_info().name, 0)


def write(value):
    _counters[rpc.get_worker_info().name] = value


def increment():
    write(read() + 1)


def program(rank):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    if rank == 2:
        sleep(1.1e-3)
    if rank:
        for _ in range(3):
            if ATOMIC:
                rpc.rpc_sync("worker0", increment)
            else:
                value = rpc.rpc_sync("worker0", read)
                rpc.rpc_sync("worker0", write, args=(value + 1,))
    rpc.shutdown()
    if rank == 0:
"""
"""Module source up to rank 0's last step after shutdown; each user appends what rank 0 does with
the total (assert it, or return it to a test)."""
