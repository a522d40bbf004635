"""The ``gloo`` backend: twinrpc's real multiprocess world (``twinrpc.impl``) in real processes.

It is the torch backend's process machinery (warm spares, pools reused across tests, hang and crash
handling) serving twinrpc's modules instead of PyTorch's, so both real-process backends behave alike.
"""

from __future__ import annotations

from ._torch import TorchBackend

__all__ = ["GlooBackend"]


class GlooBackend(TorchBackend):
    """Runs programs on twinrpc's gloo world in real processes."""

    name = "gloo"
    flavour = "gloo"
