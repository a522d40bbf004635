"""The distributed backward pass in FAST mode (spec/autograd.md DAG-5..DAG-8, DAG-11; docs/explanation/fast-autograd.md).

One :class:`GraphPass` per (context, pass, worker). At its start a worker discovers its part of the
graph from its seeds: the roots (on the root worker) and every send function of the context it holds.
Each edge counts as one dependency of its target; a node runs once, when every dependency delivered
(a gradient or nothing). Leaves' AccumulateGrad nodes run, hooks included, but add into the context,
never into ``.grad`` (``_leaf_grads``); the tensors of one recv function are collected and sent back to
the sender in ONE gradient message.

Nodes run through PyTorch's own engine, so hooks, saved-tensor checks and custom Functions behave as
in local autograd:

* **bulk mode** (the common case): when no node is reachable from two seeds, each seed's region runs
  as one engine call whose inputs are the region's leaves and recv nodes;
* **per-node mode** otherwise (a node waits for a gradient that only another worker can produce,
  e.g. a value used locally and also sent away): each node runs alone, as ``torch.autograd.grad`` from
  its inputs; a post-hook on the node takes its outputs and stops the engine before it goes further.
  The leaves made ready by one step run together in one engine call.

Termination follows PyTorch: the first gradient request that makes a worker busy is answered only when
the worker is quiescent (no runnable node, no unanswered gradient RPC of its own); requests arriving
while busy are answered at once. So the root is quiescent only when every worker is. Unlike PyTorch,
twinrpc then checks that every send function of the pass got its gradient: each busy period's answer
carries the worker's still-unused sends, and the root raises an error naming them instead of hanging
(DAG-7, deviation DEV-2).
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import GradientEdge

from ._ddp_unused import DDP_SINK_TYPE, unreached_parameters_error
from ._dist_autograd import (
    RECV_NODE_TYPE,
    TAKING,
    DistAutogradContainer,
    DistAutogradContext,
    RecvRpcBackward,
    SendRpcBackward,
    context_not_found,
    handoff,
    recv_entry,
)
from ._fork import on_fork_survivor
from ._future import Future, add_internal_callback
from ._leaf_grads import context_grads_in_leaves
from ._message import Kind, Message

if TYPE_CHECKING:
    from collections.abc import Sequence

_ACC_TYPE: Any = type(torch.autograd.graph.get_gradient_edge(torch.zeros(1, requires_grad=True)).node)
_ROOT = "root"
_SECOND_PASS = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they "
    "have already been freed). Saved intermediate values of the graph are freed when you call "
    ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
    "graph a second time or if you need to access saved tensors after calling backward."
)


#: PyTorch's own entry into its engine, under torch.autograd.grad (private; torch.autograd.grad where
#: a version lacks it)
_ENGINE_RUN_BACKWARD: Any = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _run_engine(
    outputs: list[Any], grads: list[torch.Tensor], retain_graph: bool, inputs: list[Any] | None = None
) -> None:
    """PyTorch's engine from ``outputs`` with ``grads``, accumulating: AccumulateGrad nodes run (their
    hooks with them), and with ``inputs`` only the nodes on a path to them run. The private entry
    under ``torch.autograd.backward`` skips its argument normalisation and Python-side shape checks:
    the edges and gradients here come from the graph itself, the engine still checks each gradient's
    shape against its edge, and the checks cost about 100 us per call, on the critical path of every
    distributed backward."""
    if _ENGINE_RUN_BACKWARD is None:
        torch.autograd.backward(outputs, grads, retain_graph=retain_graph, inputs=inputs)
        return
    _ENGINE_RUN_BACKWARD(tuple(outputs), tuple(grads), retain_graph, False, tuple(inputs or ()), True, True)


class _StopAfterNode(Exception):
    """Raised by a post-hook to stop PyTorch's engine right after the one node we asked it to run."""


def _is_terminal(node: Any) -> bool:
    return type(node) is _ACC_TYPE or type(node) is RECV_NODE_TYPE


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    if a.layout != torch.strided:  # as PyTorch's input buffer: add(sparse, dense) does not exist
        return b + a
    return a + b


class GraphPass:
    """One worker's part of one distributed backward pass of one context."""

    def __init__(
        self,
        container: DistAutogradContainer,
        ctx: DistAutogradContext,
        pass_id: int,
        retain_graph: bool,
        roots: Sequence[torch.Tensor] | None,
    ) -> None:
        self.container = container
        self.agent = container.agent
        self.ctx = ctx
        self.pass_id = pass_id
        self.retain_graph = retain_graph
        self.is_root = roots is not None
        self.lock = threading.Lock()
        #: busy: the root for its whole pass; elsewhere, from a held request until quiescence
        self.active = self.is_root
        self.held: Message | None = None
        #: copies of the held request (a duplicating fault plan): answered with it, never before it
        self.held_copies: list[Message] = []
        self.inbox: collections.deque[tuple[Any, list[torch.Tensor | None]]] = collections.deque()
        self.running = False
        self.outstanding = 0
        self.error: BaseException | None = None
        self.done: Future[None] = Future()
        self.done.label = f"distributed backward of context {ctx.context_id} on {self.agent.info.name}"
        #: rank -> (version, unused send descriptions) learned from answers (DAG-7 detection)
        self.statuses: dict[int, tuple[int, list[str]]] = {}
        self.version = 0
        with ctx.lock:
            self.sends: dict[int, SendRpcBackward] = dict(ctx.sends)
        self.graded: set[int] = set()
        #: per-node mode: leaves whose gradient is complete, accumulated together after each step
        self.leaves_ready: list[tuple[Any, torch.Tensor]] = []
        self.root_edges: list[tuple[Any, int]] = [(r.grad_fn, r.output_nr) for r in roots or ()]
        self._discover(list(roots) if roots is not None else [])

    # -- graph ---------------------------------------------------------------------------------
    def _discover(self, roots: list[torch.Tensor]) -> None:
        sources: list[tuple[Any, list[tuple[Any, int]]]] = []
        if roots:
            sources.append((_ROOT, [(r.grad_fn, r.output_nr) for r in roots]))
        for mid, send in self.sends.items():
            sources.append((mid, [e for e in send.next_functions if e[0] is not None]))
        deps: dict[Any, int] = {}
        owner: dict[Any, Any] = {}
        region: dict[Any, list[Any]] = {}
        shared = False
        sinks: list[Any] = []
        for key, edges in sources:
            nodes: list[Any] = []
            stack = []
            for node, _ in edges:
                deps[node] = deps.get(node, 0) + 1
                stack.append(node)
            while stack:
                node = stack.pop()
                seen_by = owner.get(node)
                if seen_by is not None:
                    if seen_by != key:
                        if type(node) is not _ACC_TYPE or node.variable._backward_hooks:
                            shared = True
                        elif node not in nodes:  # a hook-free leaf may take gradients from each region
                            nodes.append(node)
                    continue
                owner[node] = key
                nodes.append(node)
                if _is_terminal(node):
                    continue
                if type(node) is DDP_SINK_TYPE:
                    sinks.append(node)
                for nxt, _ in node.next_functions:
                    if nxt is not None:
                        deps[nxt] = deps.get(nxt, 0) + 1
                        stack.append(nxt)
            region[key] = nodes
        self.deps = deps
        self.bulk = not shared
        self.region = region
        #: every leaf this worker's part of the pass reaches: each engine call shows all of them their
        #: context gradient, since a hook in one call may write another's (DDP's copy-back, DAG-19)
        self.leaves = [node.variable for node in owner if type(node) is _ACC_TYPE]
        #: raised by the pass's first step: what it cannot compute as PyTorch does
        self.unsupported: RuntimeError | None = None
        for sink in sinks:
            self.unsupported = self.unsupported or unreached_parameters_error(
                sink, _ACC_TYPE, RECV_NODE_TYPE, self.ctx.context_id
            )
        self.buffers: dict[Any, list[torch.Tensor | None]] = {}
        #: recv entry -> slots still expected this pass; gradients collected per slot
        self.recv_expected: dict[RecvRpcBackward, int] = {}
        self.recv_grads: dict[RecvRpcBackward, list[torch.Tensor | None]] = {}
        for node in owner:
            if type(node) is RECV_NODE_TYPE:
                entry = recv_entry(node)
                self.recv_expected[entry] = self.recv_expected.get(entry, 0) + 1

    # -- feeding ---------------------------------------------------------------------------------
    def feed(self, key: Any, grads: list[torch.Tensor | None]) -> None:
        """Seed gradients arrived (the roots, or a send function's): run what they make runnable."""
        with self.lock:
            self.inbox.append((key, grads))
            if self.running:
                return
            self.running = True
        self._drain()

    def _drain(self) -> None:
        while True:
            with self.lock:
                if self.error is not None or not self.inbox:
                    self.running = False
                    quiescent = self.error is None and self.outstanding == 0
                    break
                key, grads = self.inbox.popleft()
            try:
                self._process(key, grads)
            except BaseException as exc:
                self._fail(exc)
        if quiescent:
            self._quiescent()

    def _process(self, key: Any, grads: list[torch.Tensor | None]) -> None:
        """Run what the gradients of one seed make runnable. ``grads`` is emptied: a gradient that
        nothing but the pass holds may be adopted by a leaf (DAG-20)."""
        if self.unsupported is not None:
            raise self.unsupported
        if key == _ROOT:
            edges = self.root_edges
        else:
            if key in self.graded:
                return
            self.graded.add(key)
            edges = list(self.sends[key].next_functions)
        if self.bulk:
            self._run_region(key, edges, grads)
            return
        ready: list[Any] = []
        for i, (node, nr) in enumerate(edges):
            if node is not None:
                self._contribute(node, nr, grads[i], ready)
        grads.clear()
        try:
            while ready:
                self._execute(ready.pop(), ready)
        finally:
            leaves, self.leaves_ready = self.leaves_ready, []
        if leaves:
            self._accumulate(leaves)

    def _accumulate(self, leaves: list[tuple[Any, torch.Tensor]]) -> None:
        """Run the ready leaves' AccumulateGrad nodes in one engine call, into the context: their
        hooks see every leaf's gradient in the context, as in bulk mode. Each gradient is handed
        over through a :class:`Handoff` and ``leaves`` is emptied, so a leaf may adopt it."""
        nodes = [node for node, _ in leaves]
        handoffs = [handoff(node.variable) for node in nodes]
        for i, h in enumerate(handoffs):
            h.grad_fn.pending = leaves[i][1]
        leaves.clear()
        roots = [GradientEdge(h.grad_fn, 0) for h in handoffs]
        try:
            with context_grads_in_leaves(self.ctx, self.leaves, nodes):
                _run_engine(roots, handoffs, False)
        finally:
            for root in roots:
                root.node.pending = None

    def _contribute(self, node: Any, nr: int, g: torch.Tensor | None, ready: list[Any]) -> None:
        buf = self.buffers.get(node)
        if buf is None:
            buf = self.buffers[node] = []
        while len(buf) <= nr:
            buf.append(None)
        buf[nr] = _add(buf[nr], g)
        left = self.deps[node] - 1
        self.deps[node] = left
        if left == 0:
            ready.append(node)

    # -- bulk mode -------------------------------------------------------------------------------
    def _run_region(self, key: Any, edges: list[tuple[Any, int]], grads: list[torch.Tensor | None]) -> None:
        """One engine call for the region: its leaves' AccumulateGrad nodes run (hooks included) into
        the context, and each recv node keeps the gradient it is handed (its ``taken``). A send
        function's gradients go in through its :class:`Handoff` nodes, one per edge (summed when a
        message carried one tensor twice), and ``grads`` is emptied (DAG-20); the roots' gradients
        are the engine's root gradients, as in PyTorch's engine."""
        outputs: dict[tuple[Any, int], list[Any]] = {}  # edge -> [its first slot, summed gradient]
        for i, edge in enumerate(edges):
            if edge[0] is not None and grads[i] is not None:
                entry = outputs.get(edge)
                if entry is None:
                    outputs[edge] = [i, grads[i]]
                else:
                    entry[1] = _add(entry[1], grads[i])
        grads.clear()
        terminals = [n for n in self.region.get(key, ()) if _is_terminal(n)]
        if not outputs or not terminals:
            return
        if key == _ROOT:
            roots = [GradientEdge(n, nr) for n, nr in outputs]
            root_grads = [entry[1] for entry in outputs.values()]
        else:
            handoffs = self.sends[key].handoffs
            roots, root_grads = [], []
            for entry in outputs.values():
                h = handoffs[entry[0]]
                h.grad_fn.pending = entry.pop()
                roots.append(GradientEdge(h.grad_fn, 0))
                root_grads.append(h)
        outputs.clear()
        recvs = [n for n in terminals if type(n) is RECV_NODE_TYPE]
        for node in recvs:
            node.taken = TAKING
        inputs = [GradientEdge(n, 0) for n in terminals]
        try:
            if self.leaves:
                with context_grads_in_leaves(
                    self.ctx, self.leaves, [n for n in terminals if type(n) is _ACC_TYPE]
                ):
                    _run_engine(roots, root_grads, self.retain_graph, inputs)
            else:  # no leaf on this worker's part of the pass: no gradient to swap in
                _run_engine(roots, root_grads, self.retain_graph, inputs)
        finally:
            taken = []
            for node in recvs:
                g, node.taken = node.taken, None
                taken.append(None if g is TAKING else g)
            if key != _ROOT:  # a handoff the engine did not reach must not keep its gradient
                for root in roots:
                    root.node.pending = None
        for node, g in zip(recvs, taken, strict=True):
            self._recv_slot_done(node, g)

    # -- per-node mode ---------------------------------------------------------------------------
    def _execute(self, node: Any, ready: list[Any]) -> None:
        buf = self.buffers.pop(node, [])
        if type(node) is _ACC_TYPE:
            g = buf[0] if buf else None
            if g is not None:
                self.leaves_ready.append((node, g))
            return
        outs = self._run_node(node, buf)
        if type(node) is RECV_NODE_TYPE:
            self._recv_slot_done(node, outs)
            return
        for (nxt, nr), g in zip(node.next_functions, outs, strict=False):
            if nxt is not None:
                self._contribute(nxt, nr, g, ready)

    def _run_node(self, node: Any, buf: list[torch.Tensor | None]) -> Any:
        """Run one node through PyTorch's engine (its hooks included) and return its outputs; for a
        recv node, the gradient it received (after tensor hooks)."""
        if node in self.ctx.released:
            raise RuntimeError(_SECOND_PASS)
        is_recv = type(node) is RECV_NODE_TYPE
        outs = [GradientEdge(node, i) for i, g in enumerate(buf) if g is not None]
        grads = [g for g in buf if g is not None]
        if not outs:
            return None if is_recv else (None,) * len(node.next_functions)
        inputs = list({(n, nr): None for n, nr in node.next_functions if n is not None})
        got: list[Any] = []

        def take(grad_inputs: Any, grad_outputs: Any) -> None:
            got.append(grad_outputs[0] if is_recv else grad_inputs)
            raise _StopAfterNode

        handle = node.register_hook(take)
        try:
            torch.autograd.grad(outs, [GradientEdge(n, nr) for n, nr in inputs], grads, retain_graph=True)
        except _StopAfterNode:
            pass
        finally:
            handle.remove()
        if not self.retain_graph:
            self.ctx.released.add(node)
        if not got:  # the node produced nothing (no input needed a gradient)
            return None if is_recv else (None,) * len(node.next_functions)
        return got[0]

    # -- recv: one gradient message per recv function --------------------------------------------
    def _recv_slot_done(self, node: Any, g: torch.Tensor | None) -> None:
        entry = recv_entry(node)
        slots = self.recv_grads.get(entry)
        if slots is None:
            slots = self.recv_grads[entry] = [None] * len(entry.nodes)
        slots[node.slot] = _add(slots[node.slot], g)
        left = self.recv_expected[entry] - 1
        self.recv_expected[entry] = left
        if left == 0:
            grads = [s if s is not None else entry.zero_gradient(i) for i, s in enumerate(slots)]
            self._send_gradients(entry, grads)

    def _send_gradients(self, entry: RecvRpcBackward, grads: list[torch.Tensor]) -> None:
        with self.lock:
            self.outstanding += 1
        body = (self.ctx.context_id, self.pass_id, entry.autograd_message_id, grads, self.retain_graph)
        observer = self.container.observer
        if observer is not None:
            observer.autograd_event(
                self.container.rank,
                "gradient-sent",
                self.ctx.context_id,
                f"pass {self.pass_id}: gradients for autograd message {entry.autograd_message_id} to "
                f"rank {entry.peer}",
            )
        try:
            fut = self.agent.request(entry.peer, Kind.GRADIENT, body, -1.0)
        except BaseException as exc:
            with self.lock:
                self.outstanding -= 1
            raise exc
        add_internal_callback(fut, self._gradient_answered)

    def _gradient_answered(self, fut: Future[Any]) -> None:
        try:
            status = fut.wait()
        except BaseException as exc:
            with self.lock:
                self.outstanding -= 1
            self._fail(exc, remote=True)
            return
        with self.lock:
            self.outstanding -= 1
            if status:
                for rank, (version, unused) in status.items():
                    if rank not in self.statuses or self.statuses[rank][0] < version:
                        self.statuses[rank] = (version, unused)
            quiescent = not self.running and not self.inbox and self.outstanding == 0 and self.error is None
        if quiescent:
            self._quiescent()

    # -- endings ---------------------------------------------------------------------------------
    def _unused(self) -> list[str]:
        me = self.agent.info
        return [
            f"autograd message {mid} ({send.what}, on {me.name})"
            for mid, send in self.sends.items()
            if mid not in self.graded
        ]

    def _quiescent(self) -> None:
        with self.lock:
            if not self.active or self.error is not None:
                return
            if self.running or self.inbox or self.outstanding:
                return
            self.version += 1
            statuses = dict(self.statuses)
            statuses[self.agent.info.id] = (self.version, self._unused())
            held, self.held = self.held, None
            copies, self.held_copies = self.held_copies, []
            if not self.is_root:
                self.active = False
        if self.is_root:
            unused = [d for _, (_, lst) in sorted(statuses.items()) for d in lst]
            if unused:
                self.done.try_set_exception(
                    RuntimeError(
                        f"twinrpc: the distributed backward pass of autograd context {self.ctx.context_id} "
                        f"cannot finish: {len(unused)} send function(s) received no gradient, because the "
                        "roots do not depend on what these RPCs carried: " + "; ".join(unused) + ". "
                        "PyTorch's FAST mode would wait forever here (spec DAG-7). Use every RPC result "
                        "that requires grad in the loss, or detach it / make the call outside the context. "
                        "An RPC made from a Future callback that ran when a reply arrived (then, "
                        "add_done_callback) is not attached to the context, as in PyTorch: a gradient "
                        "cannot flow back through it to the RPCs above."
                    )
                )
            else:
                self.done.try_set_result(None)
        elif held is not None:
            for request in (held, *copies):
                self.agent.reply(request, statuses)

    def _fail(self, exc: BaseException, remote: bool = False) -> None:
        me = self.agent.info
        if not (remote or "Error on Node" in str(exc)):
            err: BaseException = RuntimeError(
                f"Error on Node {me.id}: {exc} [{type(exc).__name__} on {me.name}]"
            )
            err.__cause__ = exc
        elif "Error on Node" in str(exc):
            # another worker's failed node, passed on: prefixed with this node, as PyTorch does
            err = RuntimeError(f"Error on Node {me.id}: {_node_error(str(exc))}")
            err.__cause__ = exc
        elif isinstance(exc, RuntimeError):  # the RPC itself failed (timeout, dead peer): as it is
            err = exc
        else:
            err = RuntimeError(str(exc))
            err.__cause__ = exc
        with self.lock:
            if self.error is not None:
                return
            self.error = err
            held, self.held = self.held, None
            copies, self.held_copies = self.held_copies, []
        if self.is_root:
            self.done.try_set_exception(err)
        elif held is not None:
            for request in (held, *copies):
                self.agent.reply_error(request, err)


def _node_error(remote: str) -> str:
    """The "Error on Node <n>: ..." text inside a remote error's (``On WorkerInfo(...):\n
    RuntimeError('Error on Node ...')\nTraceback ...``), first, with the rest after it."""
    start = remote.index("Error on Node")
    first, _, rest = remote[start:].partition("\n")
    if first.endswith(("')", '")')):
        first = first[:-2]
    return f"{first}\n{rest}" if rest else first


def run_backward(container: DistAutogradContainer, context_id: int, roots: Any, retain_graph: bool) -> None:
    """``dist_autograd.backward`` on the calling worker (DAG-5): blocks until the pass finished."""
    ctx = container.retrieve(context_id)
    if not isinstance(roots, (list, tuple)):
        raise TypeError(f"backward(): argument 'roots' must be a list of Tensors, not {type(roots).__name__}")
    if len(roots) == 0:
        raise RuntimeError("No tensors provided for gradient computation.")
    for i, root in enumerate(roots):
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"backward(): roots[{i}] must be a Tensor, not {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if root.numel() != 1:
            raise RuntimeError(
                f"Found a tensor with shape {tuple(root.shape)} among the roots: it is not a scalar, "
                "all roots need to be scalar"
            )
        if root.grad_fn is None:
            raise RuntimeError("The root tensor does not have a valid gradient function")
    with ctx.lock:
        current = ctx.current_pass
        if current is not None and current.is_root and current.active and not current.done.done():
            raise RuntimeError(
                f"a distributed backward pass of autograd context {context_id} is already running on "
                f"this worker; wait for it to finish before starting another one"
            )
    gp = GraphPass(container, ctx, container.new_message_id(), bool(retain_graph), roots)
    with ctx.lock:
        ctx.current_pass = gp
    observer = container.observer
    if observer is not None:
        observer.autograd_event(container.rank, "backward-started", context_id, f"pass {gp.pass_id}")
    outcome = "failed"
    seeds: list[torch.Tensor | None] = [torch.ones_like(r) for r in roots]
    if on_fork_survivor() and container.agent.world.threaded:
        # This thread forked from a parent that may have used OpenMP: its kernels could wait forever
        # for helper threads the fork did not copy (twinrpc._fork). Upstream runs every backward on its
        # engine's threads; run this one on a world task. (A simulated task is no thread: whether the
        # simulating process forked must not change the schedule.)
        container.agent.world.spawn(gp.feed, _ROOT, seeds)
    else:
        gp.feed(_ROOT, seeds)
    try:
        gp.done.wait()
        outcome = "done"
    finally:
        with ctx.lock:
            if ctx.current_pass is gp:
                ctx.current_pass = None
        if observer is not None:
            observer.autograd_event(
                container.rank, "backward-finished", context_id, f"pass {gp.pass_id} {outcome}"
            )


def _answer_copy(agent: Any, gp: GraphPass, msg: Message) -> None:
    """A second copy of a GRADIENT request already taken by pass ``gp`` (only a simulator fault plan
    duplicates messages): its gradients are not applied again. While the original is held, the copy
    is answered with it, never before: an early answer would complete the sender's gradient RPC
    before the work it stands for. Otherwise the original was answered already; so is the copy."""
    with gp.lock:
        if not _hold_copy(gp, msg):
            agent.reply(msg, None)


def _hold_copy(gp: GraphPass, msg: Message) -> bool:
    """Under ``gp.lock``: keep ``msg`` to answer with the held request it copies, if it is held."""
    held = gp.held
    if held is not None and (held.src, held.id) == (msg.src, msg.id):
        gp.held_copies.append(msg)
        return True
    return False


def on_gradient_request(container: DistAutogradContainer, msg: Message, obj: Any) -> None:
    """Serve a GRADIENT request (DAG-6); runs on the worker's request pool."""
    agent = container.agent
    try:
        context_id, pass_id, message_id, grads, retain_graph = obj
        ctx = container.get(context_id)
        if ctx is None:
            raise context_not_found(context_id)
        with ctx.lock:
            owner = ctx.gradient_requests.get((msg.src, msg.id))
            send = ctx.sends.get(message_id)
            gp = ctx.current_pass
            if send is not None and (gp is None or gp.pass_id != pass_id):
                gp = None
        if owner is not None:
            _answer_copy(agent, owner, msg)
            return
        if send is None:
            raise RuntimeError(f"Could not find send function for autograd message id: {message_id}")
        if gp is None:
            gp = GraphPass(container, ctx, pass_id, bool(retain_graph), None)
            with ctx.lock:
                if ctx.current_pass is None or ctx.current_pass.pass_id != pass_id:
                    ctx.current_pass = gp
                gp = ctx.current_pass
    except BaseException as exc:
        agent.reply_error(msg, exc)
        return
    # Holding the request and queueing its gradients is one step: a runner finishing in between
    # would otherwise answer the held request before these gradients were processed.
    # Registering the request is part of that step too: a copy that raced past the check above meets
    # the registration here, under the same lock, and waits with the held original (_hold_copy).
    key = (msg.src, msg.id)
    with gp.lock:
        copy = key in ctx.gradient_requests
        copy_held = copy and _hold_copy(gp, msg)
        error = gp.error
        hold = start = False
        if not copy:
            ctx.gradient_requests[key] = gp
        if error is None and not copy:
            hold = not gp.active
            if hold:
                gp.active = True
                gp.held = msg
            # the message's own list, which the pass empties: nothing else holds the gradients
            gp.inbox.append((message_id, grads if isinstance(grads, list) else list(grads)))
            start = not gp.running
            gp.running = gp.running or start
    if copy:
        if not copy_held:
            agent.reply(msg, None)
        return
    if error is not None:
        agent.reply_error(msg, error)
        return
    if not hold:  # the worker is busy already: its held request stands for this work (DAG-6)
        agent.reply(msg, None)
    if start:
        gp._drain()
