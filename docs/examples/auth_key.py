"""Two gloo worlds of two workers: one whose workers share the job's key, one whose second worker
has another key. The first works as usual; in the second, init_rpc fails on both workers with an
authentication error, instead of waiting for a peer it must not trust.

Run it: ``python docs/examples/auth_key.py`` (real processes, the gloo world). A launcher would set
``TWINRPC_AUTH_KEY`` for every process instead of passing ``auth_key``.
"""

from __future__ import annotations

import multiprocessing
import tempfile

import twinrpc.rpc as rpc


def add(a: int, b: int) -> int:
    return a + b


# -- program --
def worker(rank: int, key: bytes, init_file: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    options = rpc.RpcBackendOptions(init_method=f"file://{init_file}", auth_key=key, rpc_timeout=30)
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    except rpc.AuthenticationError as exc:
        out.put(
            (
                rank,
                f"init_rpc failed: {type(exc).__name__}, mentions authentication: {'authentication' in str(exc)}",
            )
        )
        return
    if rank == 0:
        out.put((rank, f"worker1 says 1 + 2 = {rpc.rpc_sync('worker1', add, args=(1, 2))}"))
    rpc.shutdown()


# -- end program --


def run(keys: list[bytes]) -> list[str]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=worker, args=(r, key, f"{tmp}/rendezvous", out)) for r, key in enumerate(keys)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
    results = []
    while not out.empty():
        results.append(out.get())
    return [f"rank {rank}: {line}" for rank, line in sorted(results)]


if __name__ == "__main__":
    print("same key:")
    for line in run([b"the job's secret", b"the job's secret"]):
        print("  " + line)
    print("different keys:")
    for line in run([b"the job's secret", b"another secret"]):
        print("  " + line)
