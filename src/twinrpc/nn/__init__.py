"""``twinrpc.nn``: PyTorch's ``torch.distributed.nn.RemoteModule``, served by twinrpc.

Semantics: spec/nn.md (RMOD-1..RMOD-9). A :class:`RemoteModule` builds a module on another worker and
runs its ``forward`` there over RPC, so distributed autograd records the call like any other RPC.
"""

from __future__ import annotations

from ._remote_module import RemoteModule

__all__ = ["RemoteModule"]
