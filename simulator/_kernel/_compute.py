"""The compute model: virtual time for the torch operators simulated tasks run.

Without it, everything a task computes (a user function, a forward or backward pass, an optimizer
step) takes no virtual time. With ``Simulation(compute=ComputeModel(op_cost, flop_cost))`` the
scheduler counts, while a task runs, the torch operators it calls and their floating-point operations
(as :mod:`torch.utils.flop_counter` counts them), and books ``op_cost * ops + flop_cost * flops`` on
the task's worker: on the same one-at-a-time timeline as ``NetworkModel.message_cost``, so what the
worker sends afterwards leaves later and what it receives meanwhile waits. The counts depend only on
the program and the schedule, so runs stay deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .._model._compute import ComputeModel


class OperationCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """Counts the torch operators run under it and their FLOPs (a ``TorchDispatchMode``)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0
        self.flops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        count = flop_registry.get(func.overloadpacket)
        if count is not None:
            self.flops += int(count(*args, **kwargs, out_val=out))
        return out


def count_operations(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int, int]:
    """Run ``fn(*args, **kwargs)`` and count its operators; returns ``(value, ops, flops)``."""
    counter = OperationCounter()
    with counter:
        value = fn(*args, **kwargs)
    return value, counter.ops, counter.flops


class ComputeMeter:
    """The scheduler's side: counts each task's operators while it runs, books them on its worker."""

    __slots__ = ("book", "counter", "model", "ops")

    def __init__(self, model: ComputeModel, book: Callable[[int, float], None]) -> None:
        #: books virtual seconds of work on a worker (``Links.book``)
        self.book = book
        self.model = model
        self.counter = OperationCounter()
        self.ops = 0  # operators charged so far (all workers)

    def enter(self) -> None:
        self.counter.__enter__()  # type: ignore[no-untyped-call]

    def exit(self) -> None:
        self.counter.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def charge(self, rank: int) -> None:
        """Book what the running task computed since the last charge on worker ``rank``."""
        counter = self.counter
        ops, flops = counter.ops, counter.flops
        if ops:
            counter.ops = counter.flops = 0
            self.ops += ops
            self.book(rank, self.model.cost(ops, flops))
