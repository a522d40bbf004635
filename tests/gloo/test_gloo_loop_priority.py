"""twinrpc lowers the priority of the gloo event-loop thread of its own pair process groups (one device,
shared by all of them), and of no other (impl/_pair.py, LOOP_NICENESS: gloo's loop spins on epoll while
another thread holds a pair's lock, taking the core from that thread). A process group the program makes for itself, e.g. its own
default gloo group for collectives, keeps its loop thread at the process's priority."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import base_env, free_port

PROGRAM = """
import json, os, sys
import torch.distributed as dist
import twinrpc.rpc as rpc

def loops():
    found = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "gloo_tcp_loop":
                found.append(int(tid))
    return set(found)

rank, port, user_port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{user_port}", rank=rank, world_size=3)
users = loops()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
for peer in range(3):  # links are made on first use
    rpc.rpc_sync(f"worker{peer}", max, args=(rank, peer))
ours = loops() - users
nice = lambda tids: sorted(os.getpriority(os.PRIO_PROCESS, t) for t in tids)
print(json.dumps({"process": os.getpriority(os.PRIO_PROCESS, 0), "users": nice(users), "ours": nice(ours)}))
rpc.shutdown()
dist.destroy_process_group()
"""


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="thread priorities are read from /proc (Linux)"
)
def test_only_the_loop_threads_of_twinrpcs_pair_groups_run_nicer(tmp_path: Path) -> None:
    from twinrpc.impl._pair import LOOP_NICENESS

    script = tmp_path / "loop_priority.py"
    script.write_text(PROGRAM)
    port, user_port = str(free_port()), str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port, user_port],
            env=base_env(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        seen = json.loads(out.strip().splitlines()[-1])
        base = seen["process"]
        assert seen["users"] and all(n == base for n in seen["users"])  # the program's own group: untouched
        # one gloo device (and loop thread) shared by every pair group, however many peers
        assert seen["ours"] == [min(19, base + LOOP_NICENESS)]
