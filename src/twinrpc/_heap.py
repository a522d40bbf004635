"""The process's heap after ``init_rpc``: what is alive then moves out of the garbage collector's way.

A process with torch imported holds a few hundred thousand objects that live as long as it does
(modules, functions, torch's operator tables). Every full collection walks all of them: about 38 ms
per collection on a small machine, a few percent of a training loop's time in a two-worker job.
``gc.freeze()`` moves every object alive at that moment to a permanent generation that collections
skip; objects made later are collected as before. The cost is that a reference cycle among objects
that were alive at ``init_rpc`` and die later is not freed until the process ends.

Only a world that owns its process does this (the gloo world: one worker per process); the simulator
runs many workers, and many programs, in one process. ``TWINRPC_GC_FREEZE=0`` turns it off.
"""

from __future__ import annotations

import gc
import os

#: the environment variable that turns the freeze off ("0")
GC_FREEZE_ENV = "TWINRPC_GC_FREEZE"


def freeze_heap() -> bool:
    """Freeze what is alive now (unless ``TWINRPC_GC_FREEZE=0``); True if it did."""
    if os.environ.get(GC_FREEZE_ENV, "1").strip() == "0":
        return False
    gc.freeze()
    return True
