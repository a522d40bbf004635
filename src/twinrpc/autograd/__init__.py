"""``twinrpc.autograd``: PyTorch's ``torch.distributed.autograd`` API, served by twinrpc.

Contexts are per thread (per simulated task). ``backward``, ``get_gradients`` and
``DistributedOptimizer.step`` take the context id explicitly and may be called from any thread.
Semantics: spec/autograd.md (DAG-1..DAG-12).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from .._current import current_agent
from .._dist_autograd import CURRENT_CONTEXT, DistAutogradContext

__all__ = ["DistAutogradContext", "backward", "context", "get_gradients", "is_available"]


def is_available() -> bool:
    return True


def _container() -> Any:
    return current_agent().autograd


class context:
    """Context manager: ``with context() as context_id:`` creates a distributed autograd context,
    makes it this thread's current context and releases it (here and, asynchronously, on every worker
    it reached) on exit.

    Raises:
        RuntimeError: "Already have an autograd context id for this thread." when nested.
    """

    def __enter__(self) -> int:
        self.autograd_context = _new_context()
        return self.autograd_context._context_id()

    def __exit__(
        self,
        type: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _release_context(self.autograd_context._context_id())


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars) in context ``context_id``; blocks
    until every worker's part has finished. Gradients accumulate in the context on each worker (see
    :func:`get_gradients`), never in ``.grad``.

    Raises:
        RuntimeError: unknown context, bad roots, an error on any worker ("Error on Node ..."), or,
            where PyTorch would hang, a send function the roots do not use (DAG-7).
    """
    from .._fast_engine import run_backward

    run_backward(_container(), context_id, roots, retain_graph)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's accumulated gradients in the context: ``{tensor: grad}``, keyed by identity."""
    ctx = _container().retrieve(context_id)
    with ctx.lock:
        return dict(ctx.grads)


# -- PyTorch's private helpers ------------------------------------------------------------------
def _init(worker_id: int) -> None:
    """Present for parity: twinrpc's container is created by ``init_rpc`` with the worker's rank."""


def _new_context() -> DistAutogradContext:
    return _container().new_context()  # type: ignore[no-any-return]


def _release_context(context_id: int) -> None:
    _container().release(context_id)


def _retrieve_context(context_id: int) -> DistAutogradContext:
    return _container().retrieve(context_id)  # type: ignore[no-any-return]


def _current_context() -> DistAutogradContext:
    return _container().current()  # type: ignore[no-any-return]


def _is_valid_context(context_id: int) -> None:
    """Raise ``RuntimeError("Could not find autograd context with id: N")`` if it does not exist here."""
    _container().retrieve(context_id)


def _get_max_id() -> int:
    return _container().max_id()  # type: ignore[no-any-return]


def _get_debug_info() -> dict[str, str]:
    return _container().debug_info()  # type: ignore[no-any-return]


def _current_context_id() -> int | None:
    """twinrpc: this thread's context id, or None."""
    return CURRENT_CONTEXT.get()
