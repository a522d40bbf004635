"""A process forked after its parent used OpenMP runs a distributed backward pass (gloo world).

PyTorch's tutorials start each worker with ``mp.Process`` (fork) from a main process that has already
run torch ops, e.g. built its dataset: that parent used GNU OpenMP's thread team, which the fork does
not copy, so a parallel kernel on the forked thread waits forever (twinrpc._fork). Upstream's
``dist_autograd.backward`` runs the pass on its engine's threads and finishes; twinrpc's must too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _launch import base_env, free_port

#: how long the forked child may take before it prints its stacks and exits (it takes seconds)
HANG_AFTER = 90

PROGRAM = f"""
import faulthandler, multiprocessing, os, sys
import torch
import torch.nn.functional as F
import twinrpc.autograd as dist_autograd
import twinrpc.rpc as rpc

def child(port):
    faulthandler.dump_traceback_later({HANG_AFTER}, exit=True)  # a hang: stacks, exit code 1
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    rpc.init_rpc("trainer", rank=0, world_size=1)
    logits = torch.zeros(32, 10, requires_grad=True)
    target = torch.arange(32) % 10
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [F.nll_loss(logits, target)])  # its backward kernel is parallel
        grad = dist_autograd.get_gradients(cid)[logits]
    expected = torch.zeros(32, 10)
    expected[torch.arange(32), target] = -1 / 32
    assert torch.equal(grad, expected), grad
    rpc.shutdown()
    print("child done", flush=True)

if __name__ == "__main__":
    assert torch.get_num_threads() > 1, "the parent must have an OpenMP team to lose"
    torch.randn(2_000_000).mul(2.0).sum()  # the parent's own torch op, run on its OpenMP team
    p = multiprocessing.get_context("fork").Process(target=child, args=(sys.argv[1],))
    p.start()
    p.join()
    sys.exit(p.exitcode)
"""


def test_backward_in_a_child_forked_after_the_parent_used_openmp_finishes(tmp_path: Path) -> None:
    script = tmp_path / "fork_after_openmp.py"
    script.write_text(PROGRAM)
    done = subprocess.run(
        [sys.executable, str(script), str(free_port())],
        env=base_env(OMP_NUM_THREADS="2"),  # a team of 2 even on a 1-core machine
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_AFTER + 60,
    )
    assert done.returncode == 0 and "child done" in done.stdout, (
        f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    )
