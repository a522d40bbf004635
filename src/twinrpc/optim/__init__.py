"""``twinrpc.optim``: PyTorch's ``torch.distributed.optim.DistributedOptimizer``, served by twinrpc.

Semantics: spec/optim.md (OPT-1..OPT-6). One local optimizer per owner of the parameters, built on
the owner; ``step(context_id)`` (or PyTorch 1.4's ``step()``: the current context) steps all of them concurrently from the gradients each owner holds in
that distributed autograd context. On every worker, steps are serialised by one lock per worker, for
every optimizer class (twinrpc's decision in OPT-4: PyTorch locks only the plain variant).
"""

from __future__ import annotations

import collections
import logging
import threading
import warnings
import weakref
from typing import Any

import torch

from .. import autograd as dist_autograd
from .. import rpc
from .._current import current_agent
from .._future import Future
from .._rref import owner_value
from .utils import functional_optim_map, register_functional_optim

__all__ = ["DistributedOptimizer", "register_functional_optim"]

_log = logging.getLogger("twinrpc")


class _StepLock:
    """A FIFO lock that blocks through twinrpc futures, so it works for threads and simulated tasks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = False
        self._waiters: collections.deque[Future[None]] = collections.deque()

    def __enter__(self) -> None:
        with self._lock:
            if not self._held:
                self._held = True
                return
            fut: Future[None] = Future()
            fut.label = "the optimizer step lock of this worker"
            self._waiters.append(fut)
        fut.wait()  # the releasing step hands the lock over

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            if not self._waiters:
                self._held = False
                return
            nxt = self._waiters.popleft()
        nxt.set_result(None)


_STEP_LOCKS: weakref.WeakKeyDictionary[Any, _StepLock] = weakref.WeakKeyDictionary()
_STEP_LOCKS_GUARD = threading.Lock()


def _step_lock() -> _StepLock:
    """This worker's step lock (one per agent: simulated workers share a process)."""
    agent = current_agent()
    with _STEP_LOCKS_GUARD:
        lock = _STEP_LOCKS.get(agent)
        if lock is None:
            lock = _STEP_LOCKS[agent] = _StepLock()
        return lock


def _owner_params(local_params_rref: list[Any]) -> list[Any]:
    """The parameters a local optimizer is built over, on their owner. With ``unpickle_allow`` each must
    be an RRef holding a tensor: a peer may not hand another value to the optimizer class."""
    return [owner_value(rref, torch.Tensor, "DistributedOptimizer") for rref in local_params_rref]


class _LocalOptimizer:
    """The plain variant on an owner: sets ``p.grad`` from the context, then ``optimizer.step()``."""

    def __init__(self, optim_cls: Any, local_params_rref: list[Any], *args: Any, **kwargs: Any) -> None:
        self._local_params = _owner_params(local_params_rref)
        self.optim = optim_cls(self._local_params, *args, **kwargs)

    def step(self, autograd_ctx_id: int) -> None:
        all_local_grads = dist_autograd.get_gradients(autograd_ctx_id)
        with _step_lock():
            for param, grad in all_local_grads.items():
                param.grad = grad
            self.optim.step()


class _FunctionalLocalOptimizer:
    """The functional variant on an owner (PyTorch's ``_ScriptLocalOptimizer``, without TorchScript):
    a parameter without gradient in the context gets ``None`` and is left unchanged."""

    def __init__(self, optim_cls: Any, local_params_rref: list[Any], *args: Any, **kwargs: Any) -> None:
        self._local_params = _owner_params(local_params_rref)
        # twinrpc uses the functional forms eagerly, never TorchScript: their deprecation warning (which
        # torch issues with an "always" filter) does not apply, so it is recorded and dropped
        with warnings.catch_warnings(record=True):
            self.optim = optim_cls(self._local_params, *args, **kwargs)

    def step(self, autograd_ctx_id: int) -> None:
        all_local_grads = dist_autograd.get_gradients(autograd_ctx_id)
        grads: list[torch.Tensor | None] = [all_local_grads.get(p) for p in self._local_params]
        with _step_lock():
            self.optim.step(grads)


def _new_local_optimizer(optim_cls: Any, local_params_rref: list[Any], *args: Any, **kwargs: Any) -> Any:
    return rpc.RRef(_LocalOptimizer(optim_cls, local_params_rref, *args, **kwargs))


def _new_functional_local_optimizer(
    optim_cls: Any, local_params_rref: list[Any], *args: Any, **kwargs: Any
) -> Any:
    return rpc.RRef(_FunctionalLocalOptimizer(optim_cls, local_params_rref, *args, **kwargs))


def _local_optimizer_step(local_optim_rref: Any, autograd_ctx_id: int) -> None:
    """On a parameter's owner. With ``unpickle_allow``, only a local optimizer built by
    DistributedOptimizer is stepped: a peer may not call ``step`` on any other value it names."""
    optimizer = owner_value(
        local_optim_rref, (_LocalOptimizer, _FunctionalLocalOptimizer), "DistributedOptimizer's step"
    )
    optimizer.step(autograd_ctx_id)


def _wait_for_all(futures: list[Future[Any]]) -> list[Any]:
    """Wait for every future; re-raise the last error, as PyTorch's ``_wait_for_all``."""
    results: list[Any] = []
    error: BaseException | None = None
    for fut in futures:
        try:
            results.append(fut.wait())
        except BaseException as exc:
            error = exc
    if error is not None:
        raise error
    return results


class DistributedOptimizer:
    """``torch.distributed.optim.DistributedOptimizer``: one optimizer over parameters on many workers.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass, instantiated on each owner.
        params_rref: RRefs of the parameters (tensors requiring grad), on any workers.
        *args: positional arguments passed to ``optimizer_class`` on every owner.
        **kwargs: keyword arguments passed to ``optimizer_class`` on every owner.

    The constructor blocks until every owner has built its local optimizer (OPT-1); ``remote_optimizers``
    holds an RRef to each. ``is_functional_optim`` is True for the eight optimizers with a functional
    form (OPT-2), which owners use.
    """

    def __init__(self, optimizer_class: Any, params_rref: list[Any], *args: Any, **kwargs: Any) -> None:
        per_worker_params_rref: dict[Any, list[Any]] = collections.defaultdict(list)
        for param in params_rref:
            per_worker_params_rref[param.owner()].append(param)
        optim_ctor = functional_optim_map.get(optimizer_class, optimizer_class)
        self.is_functional_optim = optim_ctor is not optimizer_class
        if self.is_functional_optim:
            new_func = _new_functional_local_optimizer
        else:
            _log.warning(
                "Creating the optimizer %s without TorchScript support, this might result in slow "
                "computation time in multithreading environment(i.e. Distributed Model Parallel training "
                "on CPU) due to the Python's Global Interpreter Lock (GIL). Please file an issue if you "
                "need this optimizer in TorchScript. ",
                optimizer_class,
            )
            new_func = _new_local_optimizer
        futures = [
            rpc.rpc_async(worker, new_func, args=(optim_ctor, param_rrefs, *args), kwargs=kwargs)
            for worker, param_rrefs in per_worker_params_rref.items()
        ]
        self.remote_optimizers: list[Any] = _wait_for_all(futures)

    def step(self, context_id: int | None = None) -> None:
        """One step of every owner's optimizer from the gradients in ``context_id``; blocks.

        ``step()`` without a context id is PyTorch 1.4's form: it uses the calling thread's current
        distributed autograd context (OPT-6). PyTorch 2.x requires the id.

        Raises:
            RuntimeError: "Could not find autograd context with id: N" when the context does not exist
                on this worker (nothing is sent); "Current thread doesn't have a valid autograd context"
                for ``step()`` outside ``with dist_autograd.context():``; an owner's error otherwise.
        """
        if context_id is None:
            context_id = dist_autograd._current_context()._context_id()
        dist_autograd._is_valid_context(context_id)
        futures = [
            rpc.rpc_async(optimizer.owner(), _local_optimizer_step, args=(optimizer, context_id))
            for optimizer in self.remote_optimizers
        ]
        _wait_for_all(futures)
