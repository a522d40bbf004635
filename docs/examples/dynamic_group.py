"""Workers that join and leave a running group: ``init_rpc`` without ``world_size`` (a dynamic group).

A server starts alone; trainers arrive one by one, each joins the group, sends its contribution and
leaves again, while the server keeps running. The same program runs in both worlds.

Run it: ``python docs/examples/dynamic_group.py --world sim`` or ``--world gloo``.
"""

from __future__ import annotations

from _two_worlds import chosen_world, run_processes, run_simulated
from twinrpc.simulator import sleep  # virtual time in a simulation, time.sleep outside one

import twinrpc.rpc as rpc

# -- program --
STEP = 2.5  # seconds between two trainers' arrivals

log = []  # on the server: what it saw at each trainer's call


def members():
    return sorted(w.name for w in rpc.get_worker_infos())


def contribute(trainer, value):
    log.append({"from": trainer, "value": value, "group": members()})
    return sum(entry["value"] for entry in log)


def run_worker(rank, world_size):
    if rank == 0:
        rpc.init_rpc("server", rank=0)  # no world_size: starts (or joins) a dynamic group
        sleep(world_size * STEP)  # trainers come and go meanwhile
        at_the_end = members()
        rpc.shutdown()  # leaves the group
        return {"calls": log, "group at the end": at_the_end}
    sleep(rank * STEP)  # trainer <rank> arrives later
    rpc.init_rpc(f"trainer{rank}", rank=rank)
    total = rpc.rpc_sync("server", contribute, args=(f"trainer{rank}", rank * 10))
    rpc.shutdown()  # leaves: the server and the other trainers keep working
    return total


# -- end program --


if __name__ == "__main__":
    run = run_simulated if chosen_world() == "sim" else run_processes
    result = run(run_worker, 3, 0)
    for call in result["calls"]:
        print(call)
    print("group at the end:", result["group at the end"])
