"""twinrpc: PyTorch's distributed RPC model, built twice behind one API.

``twinrpc.rpc``, ``twinrpc.autograd`` and ``twinrpc.optim`` mirror ``torch.distributed.rpc``,
``torch.distributed.autograd`` and ``torch.distributed.optim``. Programs run in the deterministic
simulator (:mod:`twinrpc.simulator`) or, unchanged, in the real multiprocess gloo world.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Imported first thing, so that a program that imports twinrpc and then forks has the fork's
# surviving thread recorded (see _fork: it must not run the backward pass's kernels itself).
from . import _fork  # noqa: F401
