"""DistributedDataParallel's unused parameters cannot be all-reduced in a distributed autograd context
(spec DAG-19).

With ``find_unused_parameters=True``, DDP's reducer marks every parameter that its own search from the
module's outputs does not reach as ready at the start of the backward pass, and reads its gradient.
Under a distributed autograd context PyTorch reads it from the context, where such a parameter has
none: the pass fails ("The grad for the variable should exist in dist_autograd context"). The search
stops at a recv function, so a parameter used only before an RPC counts as unused too. twinrpc's
reducer would instead read and write the parameter's ``.grad`` and leave the context without it (or
with a gradient that was never averaged), so the engine finds such parameters first and fails the
pass, naming them.

DDP puts a ``_DDPSink`` autograd Function on its outputs exactly when it searches for unused
parameters; its node leads back to the DDP module.
"""

from __future__ import annotations

from typing import Any

try:
    from torch.nn.parallel.distributed import _DDPSink

    DDP_SINK_TYPE: Any = _DDPSink._backward_cls
except (ImportError, AttributeError):  # a torch without it: nothing to look for
    DDP_SINK_TYPE = None


def unreached_parameters_error(
    sink: Any, acc_type: Any, recv_type: Any, context_id: int
) -> RuntimeError | None:
    """The error for the DDP module behind ``sink`` (a ``_DDPSink`` node of the pass) when it searches
    for unused parameters and some it would all-reduce are not reached from its outputs in this
    worker's local graph (``acc_type`` and ``recv_type``: the node types where the search stops);
    None otherwise."""
    ddp = sink.ddp_weakref()
    if (
        ddp is None
        or not ddp.find_unused_parameters
        or ddp.static_graph
        or not ddp.require_backward_grad_sync
    ):
        return None
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [sink]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node) is acc_type:
            reached.add(id(node.variable))
            continue
        if type(node) is recv_type:
            continue
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    ignored = ddp.parameters_to_ignore
    names = [
        n
        for n, p in ddp.module.named_parameters()
        if p.requires_grad and n not in ignored and id(p) not in reached
    ]
    if not names:
        return None
    return RuntimeError(
        f"twinrpc: DistributedDataParallel(find_unused_parameters=True) in distributed autograd context "
        f"{context_id}: parameter(s) {', '.join(names)} of its {type(ddp.module).__name__} are not reached "
        "from its output through local autograd (unused in the forward pass, or used only before an RPC), "
        "so the context holds no gradient of theirs to all-reduce. PyTorch fails here too (The grad for "
        "the variable should exist in dist_autograd context). Use find_unused_parameters=False and every "
        "parameter in each forward pass."
    )
