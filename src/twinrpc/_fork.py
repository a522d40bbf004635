"""Which thread of this process came through a ``fork`` (and so must not run PyTorch's kernels).

PyTorch's Linux builds run intra-op parallel kernels on GNU OpenMP (libgomp), which keeps a team of
helper threads per thread that ran a parallel region. ``fork`` copies only the forking thread: in the
child that thread, the *survivor*, still points at its team, whose threads did not come along, and its
next parallel region waits for them forever. A parent that used OpenMP before forking is ordinary: the
parameter-server tutorial builds its dataset with torch ops in each rank's main process, then starts the
trainer with ``mp.Process``. Threads started in the child have no team yet and are safe.

Upstream's ``dist_autograd.backward`` never runs the backward pass on the caller's thread (its engine
runs it on its own threads), so such a trainer works there. twinrpc runs the pass on the caller's thread
(no thread hop) except on the survivor, where it runs it on a task of its world instead
(:func:`twinrpc._fast_engine.run_backward`). The survivor is recorded by an ``os.register_at_fork``
hook installed when ``twinrpc`` is imported, so a program must import twinrpc before it forks, as
programs import ``torch.distributed.rpc`` (at the top of the file).
"""

from __future__ import annotations

import os
import threading

#: (pid, thread ident) of the thread that came through the last fork into this process, if any
_survivor: tuple[int, int] | None = None


def _after_fork_in_child() -> None:
    global _survivor
    _survivor = (os.getpid(), threading.get_ident())


def on_fork_survivor() -> bool:
    """Whether the calling thread is the one that forked this process (its OpenMP team is gone)."""
    return _survivor == (os.getpid(), threading.get_ident())


os.register_at_fork(after_in_child=_after_fork_in_child)
