"""A lost update, found, replayed and fixed on the simulator.

A parameter server (worker 0) holds a counter. Two trainers (workers 1 and 2) each add 1 to it
``STEPS`` times with a read-modify-write over RPC: read the value, compute, write the new value back.
Nothing orders the two trainers' messages (spec RPC-11), so when one trainer's read lands between the
other's read and write, an update is lost. Whether that happens depends only on the timing, and on the
simulator the timing depends only on the seed.

Run it: ``python docs/examples/lost_update.py``.
"""

from __future__ import annotations

import threading

from twinrpc.simulator import Simulation, sleep

import twinrpc.rpc as rpc

STEPS = 3
COMPUTE = 60e-6  # virtual seconds a trainer computes between its read and its write
#: trainer 2 starts later (trainer 1 first makes its link): they overlap only on a slow network
START_OFFSET = 1.21e-3

# -- the parameter server (its state lives on worker 0; each simulated worker has its own Server) --
_servers: dict[int, Server] = {}


class Server:
    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()


def _server() -> Server:
    return _servers.setdefault(rpc.get_worker_info().id, Server())


def read() -> int:
    return _server().value


def write(value: int) -> None:
    _server().value = value


def increment() -> int:
    """The fix: the read-modify-write happens on the owner, in one request, under a lock."""
    server = _server()
    with server.lock:
        server.value += 1
        return server.value


# -- the program ---------------------------------------------------------------------------------------
def program(rank: int, fixed: bool = False) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    if rank == 2:
        sleep(START_OFFSET)
    if rank in (1, 2):
        for _ in range(STEPS):
            if fixed:
                rpc.rpc_sync("worker0", increment)
            else:
                value = rpc.rpc_sync("worker0", read)
                sleep(COMPUTE)  # the trainer's own work, on virtual time
                rpc.rpc_sync("worker0", write, args=(value + 1,))
    rpc.shutdown()  # a barrier: returns once both trainers are done


def final_value(seed: int, fixed: bool = False) -> tuple[int, str]:
    """Run one simulation; return the server's final counter and the trace digest."""
    _servers.clear()
    result = Simulation(world_size=3, seed=seed).run(program, fixed)
    result.values()  # re-raises the first worker's error, if any
    return _servers[0].value, result.digest


def main() -> None:
    expected = 2 * STEPS
    # 1. Explore: one seed is one interleaving. Look for a seed that loses an update.
    failing = [seed for seed in range(100) if final_value(seed)[0] != expected]
    print(f"seeds 0..99: {len(failing)} lose an update, first: {failing[:5]}")
    seed = failing[0]
    # 2. Replay: the same seed gives the same run, byte for byte.
    value, digest = final_value(seed)
    again, digest_again = final_value(seed)
    assert (value, digest) == (again, digest_again)
    print(f"seed {seed}: counter {value} instead of {expected}, digest {digest[:16]} (replayed: same digest)")
    # 3. Fix, and check the fix against every seed explored.
    assert all(final_value(s, fixed=True)[0] == expected for s in range(100))
    print(f"fixed: counter {final_value(seed, fixed=True)[0]} on every seed 0..99")


if __name__ == "__main__":
    main()
