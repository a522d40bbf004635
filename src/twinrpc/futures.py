"""``twinrpc.futures``: the Future type and helpers, as ``torch.futures``."""

from __future__ import annotations

from ._future import Future, collect_all, wait_all

__all__ = ["Future", "collect_all", "wait_all"]
