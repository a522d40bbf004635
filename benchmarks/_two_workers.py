"""Two spawned worker processes that meet through a rendezvous file and each send back one result."""

from __future__ import annotations

import multiprocessing
import tempfile
from collections.abc import Callable
from typing import Any


def run_two(target: Callable[..., None], *args: Any, prefix: str) -> list[Any]:
    """Run ``target(rank, init_method, *args, conn)`` in two fresh ``spawn`` processes (``init_method``
    a ``file://`` rendezvous in a temporary directory named with ``prefix``); what each sent on
    ``conn``, by rank."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        init_method = f"file://{tmp}/rendezvous"
        conns, procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(rank, init_method, *args, child), daemon=True)
            p.start()
            conns.append(parent)
            procs.append(p)
        results = [c.recv() for c in conns]
        for p in procs:
            p.join(60)
    return results
