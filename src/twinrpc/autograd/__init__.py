"""``twinrpc.autograd``: PyTorch's ``torch.distributed.autograd`` API, served by twinrpc.

Contexts are per thread (per simulated task). ``backward``, ``get_gradients`` and
``DistributedOptimizer.step`` take the context id explicitly and may be called from any thread; the
PyTorch 1.4 forms ``backward(roots)`` and ``step()`` use the calling thread's current context instead.
Semantics: spec/autograd.md (DAG-1..DAG-13).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from types import TracebackType
from typing import Any, overload

import torch

from .._current import current_agent
from .._dist_autograd import DistAutogradContext

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


@overload
def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None: ...


@overload
def backward(
    context_id: torch.Tensor | Sequence[torch.Tensor], roots: None = None, retain_graph: bool = False
) -> None: ...


def backward(context_id: Any, roots: Any = None, retain_graph: Any = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars) in context ``context_id``; blocks
    until every worker's part has finished. Gradients accumulate in the context on each worker (see
    :func:`get_gradients`), never in ``.grad``.

    Two forms (DAG-5, DAG-13): PyTorch 2.x's ``backward(context_id, roots, retain_graph=False)``, and
    PyTorch 1.4's ``backward(roots)``, where ``roots`` is a list of tensors or one tensor and the
    context is the calling thread's current one (``with context():``).

    Raises:
        TypeError: "backward(): incompatible function arguments" for arguments that fit neither form,
            before any context is looked up (as PyTorch's binding does).
        RuntimeError: unknown context, no current context for the 1.4 form ("Current thread doesn't
            have a valid autograd context"), bad roots, an error on any worker ("Error on Node ..."), or,
            where PyTorch would hang, a send function the roots do not use (DAG-7).
    """
    from .._fast_engine import run_backward

    context_id, roots, retain_graph = _backward_arguments(context_id, roots, retain_graph)
    if context_id is None:  # the 1.4 form
        context_id = _current_context()._context_id()
    run_backward(_container(), context_id, roots, retain_graph)


_BACKWARD_FORMS = (
    "    1. (context_id: int, roots: List[torch.Tensor], retain_graph: bool = False) -> None\n"
    "    2. (roots: torch.Tensor | List[torch.Tensor], retain_graph: bool = False) -> None"
    "  (PyTorch 1.4's form: the current context)"
)


def _backward_arguments(context_id: Any, roots: Any, retain_graph: Any) -> tuple[int | None, list[Any], bool]:
    """``(context_id or None for the current context, roots, retain_graph)``, checked as PyTorch's
    pybind11 binding checks them; a mismatch is its TypeError, with the arguments it was given."""
    keep = _as_bool(retain_graph)
    if keep is not None:
        if roots is None:
            single = _tensor_list(context_id) if not isinstance(context_id, torch.Tensor) else [context_id]
            if single is not None:
                return None, single, keep
        elif not isinstance(context_id, torch.Tensor) and hasattr(type(context_id), "__index__"):
            listed = _tensor_list(roots)
            if listed is not None:
                return operator.index(context_id), listed, keep
    given = ", ".join(repr(a) for a in (context_id, roots, retain_graph)[: 1 if roots is None else 2])
    if retain_graph is not False:
        given += f", retain_graph={retain_graph!r}"
    raise TypeError(
        "backward(): incompatible function arguments. The following argument types are supported:\n"
        f"{_BACKWARD_FORMS}\n\nInvoked with: {given}"
    )


def _tensor_list(value: Any) -> list[torch.Tensor] | None:
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
        return None
    items = list(value)
    return items if all(isinstance(t, torch.Tensor) for t in items) else None


def _as_bool(value: Any) -> bool | None:
    """pybind11's bool conversion: None is False; objects with ``__bool__`` convert; others do not."""
    if value is None:
        return False
    if isinstance(value, bool) or hasattr(type(value), "__bool__"):
        return bool(value)
    return None


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
