"""What it costs that a reply is taken by a receiver thread and handed to the thread waiting for it.

Two processes ping-pong a 4 KiB frame over gloo, each running a 256x256 matmul per round trip (so
every message is handled after other work has run on the same cores, as in the distributed-autograd
benchmark). In ``direct`` the caller's own thread waits in gloo for the reply; in ``handed`` a
receiver thread waits in gloo and wakes the caller through a lock, as twinrpc's receive loop does
(its receivers wait in gloo ahead of time, so that a worker that is sent anything reacts at once).
The difference per round trip is the price of that hand-over, which the distributed-autograd
benchmark pays once per reply (forward, backward, step).

    python benchmarks/bench_reply_hop.py [--iters 2000] [--repeat 3]
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from _thread import allocate_lock
from typing import Any

import _cli  # benchmarks/_cli.py (the script's directory is on sys.path)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("direct", "handed")


def _worker(rank: int, init: str, mode: str, iters: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    pg = dist.distributed_c10d._get_default_group()
    peer = 1 - rank
    frame, reply = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    waiters: list[Any] = []  # handed: the lock of each caller waiting for a reply, in order
    waiters_lock = threading.Lock()

    def receive_replies() -> None:
        while True:
            pg.recv([reply], peer, 0).wait()
            with waiters_lock:
                waiter = waiters.pop(0)
            if waiter is None:  # the last frame: the rounds are over
                return
            waiter.release()

    receiver = threading.Thread(target=receive_replies)
    if rank == 0 and mode == "handed":
        receiver.start()
    rates = []
    for r in range(3):  # the first round warms up
        t0 = time.perf_counter()
        for _ in range(iters):
            if rank == 1:
                pg.recv([reply], peer, 0).wait()
                a @ b
                pg.send([frame], peer, 0).wait()
                continue
            a @ b
            if mode == "direct":
                posted = pg.recv([reply], peer, 0)
                pg.send([frame], peer, 0).wait()
                posted.wait()
            else:
                waiter = allocate_lock()
                waiter.acquire()
                with waiters_lock:
                    waiters.append(waiter)
                pg.send([frame], peer, 0).wait()
                waiter.acquire()
        if r:
            rates.append(iters / (time.perf_counter() - t0))
    # One last round trip, whose reply stops the receiver: no thread is left waiting in gloo when the
    # process group goes away.
    if rank == 1:
        pg.recv([reply], peer, 0).wait()
        pg.send([frame], peer, 0).wait()
    elif mode == "handed":
        with waiters_lock:
            waiters.append(None)
        pg.send([frame], peer, 0).wait()
        receiver.join()
    else:
        posted = pg.recv([reply], peer, 0)
        pg.send([frame], peer, 0).wait()
        posted.wait()
    if rank == 0:
        out.put(rates)
    dist.destroy_process_group()


def _launch(mode: str, iters: int) -> list[float]:
    q = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(f"file://{d}/rdv", mode, iters, q), nprocs=2, start_method="spawn")
    return list(q.get())


def main() -> None:
    parser = _cli.parser(__doc__)
    parser.add_argument("--iters", type=int, default=2000, help="round trips per round")
    parser.add_argument("--repeat", type=int, default=3, help="launches of each mode, alternating")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.repeat):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            rates[mode] += _launch(mode, args.iters)
    print("gloo ping-pong with a 256x256 matmul on each side per round trip (round trips/s)")
    for mode in MODES:
        print(
            f"  {mode:<7} median {statistics.median(rates[mode]):7.1f}  (min {min(rates[mode]):.1f}, "
            f"max {max(rates[mode]):.1f})"
        )
    direct, handed = (statistics.median(rates[m]) for m in MODES)
    print(f"  a reply handed over costs {(1 / handed - 1 / direct) * 1e6:.0f} us per round trip")


if __name__ == "__main__":
    main()
