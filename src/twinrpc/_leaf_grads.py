"""Leaf gradients of a distributed backward pass go into the context through PyTorch's own
AccumulateGrad nodes (spec DAG-15..DAG-17).

PyTorch's distributed engine never writes ``.grad``: it accumulates each leaf's gradient into the
autograd context, and it still runs the leaf's AccumulateGrad hooks (tensor hooks, Python post-hooks,
and C++ hooks such as ``DistributedDataParallel``'s reducer, which all-reduces the gradient and writes
the average back). twinrpc gets the same by letting the real AccumulateGrad node run with the leaf's
``.grad`` swapped for the context's gradient for the duration of one engine call:

* every hook sees and edits the context's gradient, so a DDP module inside a context all-reduces it;
  the engine swaps every leaf its pass reaches on this worker, not only those one call accumulates,
  since a hook may write another leaf's gradient (DDP copies the averaged bucket back into all its
  parameters at the end of the call in which the last of them got its gradient);
* PyTorch's own accumulation rules decide when a gradient is copied: an incoming gradient that is
  shared, non-contiguous or expanded (stride 0) is cloned, one exclusively owned is adopted, and a
  later pass adds in place, so no two gradients of a context share memory. PyTorch's distributed
  engine captures every leaf's gradient and holds the captures until the engine call ends, so a
  tensor handed to two leaves is shared for both (both are cloned) where local autograd lets the
  last one adopt it: a post-hook on each leaf's node keeps what it was handed until the call ends
  (:func:`_hold_until_the_call_ends`), which makes the real AccumulateGrad see the same references;
* the leaf's own ``.grad`` is put back afterwards: a distributed backward leaves it untouched.

The swap holds one lock per worker, so two passes that reach the same leaf (two trainers' backward
passes on a parameter server) accumulate one after the other, as PyTorch's single CPU engine thread
serialises them. Code on another thread reading ``.grad`` of such a leaf during the engine call sees
the context's gradient.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from ._dist_autograd import DistAutogradContext

#: One per process: a leaf tensor belongs to one worker. Reentrant because the simulator's workers are
#: tasks on one thread: a hook that blocks inside an engine call (a simulated DDP all-reduce) lets the
#: other workers run, and their passes, over leaves of their own, take the lock again.
_SWAP_LOCK = threading.RLock()


@contextmanager
def context_grads_in_leaves(
    ctx: DistAutogradContext, leaves: Sequence[torch.Tensor], nodes: Sequence[Any]
) -> Iterator[None]:
    """For the block, the ``.grad`` of each of ``leaves`` (every leaf the pass reaches on this worker)
    is its gradient in ``ctx``; after it, whatever the block left there is the context's gradient and
    ``.grad`` is what it was before. ``nodes``: the AccumulateGrad nodes this engine call runs, whose
    handed gradients are held until it ends."""
    with _SWAP_LOCK:
        saved: list[torch.Tensor | None] = []
        with ctx.lock:
            for leaf in leaves:
                saved.append(leaf.grad)
                leaf.grad = ctx.grads.get(leaf)
        handed: list[torch.Tensor | None] = []
        # one leaf shares its gradient with no other: nothing to hold
        holds = _hold_until_the_call_ends(nodes, handed) if len(nodes) > 1 else []
        try:
            yield
        finally:
            for hold in holds:
                hold.remove()
            handed.clear()
            with ctx.lock:
                for leaf, old in zip(leaves, saved, strict=True):
                    grad = leaf.grad
                    if grad is not None:
                        ctx.grads[leaf] = grad
                    leaf.grad = old


def _hold_until_the_call_ends(
    nodes: Sequence[Any], handed: list[torch.Tensor | None]
) -> list[RemovableHandle]:
    """Post-hooks that append to ``handed`` the gradient each node was handed. AccumulateGrad adopts
    a gradient only if nothing else refers to it (a post-hook is one expected reference), so the one
    node handed a tensor that another node of the call was handed too clones it, as in PyTorch's
    ``DistAccumulateGradCaptureHook``, whose engine still holds the other node's capture."""

    def hold(grad_inputs: Any, grad_outputs: Any) -> None:
        handed.append(grad_outputs[0])

    return [node.register_hook(hold) for node in nodes]
