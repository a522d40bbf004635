"""The ``gloo`` backend: twinrpc's real multiprocess world (``twinrpc.impl``) in real processes.

The same process machinery as the torch backend (warm spares, pools reused across tests, hang and crash
handling) serving twinrpc's modules instead of PyTorch's, so both real-process backends behave alike.
twinrpc accepts PyTorch's ``TensorPipeRpcBackendOptions``, so the rendezvous are built the same way.
"""

from __future__ import annotations

from .child import ProcessContext
from .processes import ProcessBackend

__all__ = ["GlooBackend", "GlooContext"]


class GlooContext(ProcessContext):
    """``ctx`` on twinrpc's gloo world: twinrpc's modules, same options and rendezvous as torch."""

    MODULES = {
        "rpc": "twinrpc.rpc",
        "dist_autograd": "twinrpc.autograd",
        "optim": "twinrpc.optim",
        "futures": "twinrpc.futures",
        "nn": "twinrpc.nn",
    }

    @classmethod
    def agent_alive(cls) -> bool:
        from twinrpc._current import maybe_current_agent

        return maybe_current_agent() is not None


class GlooBackend(ProcessBackend):
    """Runs programs on twinrpc's gloo world in real processes."""

    name = "gloo"
    context = GlooContext
