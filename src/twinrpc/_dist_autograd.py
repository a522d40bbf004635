"""Distributed autograd: contexts, send/recv recording, cleanup (spec/autograd.md, DAG-1..4, DAG-10).

Each worker's agent owns one :class:`DistAutogradContainer`. A context is current per thread (per
simulated task) through :data:`CURRENT_CONTEXT`. While one is current, the agent's request path wraps
CALL/REMOTE_CALL/RREF_FETCH payloads in an :class:`AutogradEnvelope`; tensors that require grad in it are
recorded as a :class:`SendRpcBackward` on the sender, and each arriving copy gets a recv node
(:class:`_RecvRpc`, one per tensor, grouped per message in a :class:`RecvRpcBackward`) as ``grad_fn``.
Replies to wrapped requests are wrapped the same way in the other direction. The backward pass itself
is :mod:`twinrpc._fast_engine`.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import _builtin_wire, _serialize
from ._control_channel import RetryPolicy
from ._errors import NotInitializedError, ShutdownError, WorkerUnavailableError
from ._future import Future, add_internal_callback
from ._message import Kind, Message
from ._rref import agent_of, owner_allowlist
from ._torch_builtins import is_builtin

if TYPE_CHECKING:
    from ._agent import RpcAgent
    from ._fast_engine import GraphPass
    from ._world import AutogradObserver

_log = logging.getLogger("twinrpc")

#: the current thread's (simulated task's) autograd context id, or None (DAG-2)
CURRENT_CONTEXT: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "twinrpc_dist_autograd_context", default=None
)
#: request kinds that join the caller's context (DAG-3)
AUTOGRAD_KINDS = frozenset({Kind.CALL, Kind.REMOTE_CALL, Kind.RREF_FETCH})
_ID_BITS = 48
_COMPACT = bytes((_builtin_wire.MAGIC,))
_MAX_WORKER_ID = 65535
#: how a context cleanup is resent when no ack comes (DAG-10), as PyTorch's
#: ``DistAutogradContainer::sendReleaseContextRpc``: ``sendWithRetries`` with ``maxRetries =
#: kNumCleanupContextRetries = 20`` and the default ``RpcRetryOptions`` (``rpcRetryDuration`` 1000 ms,
#: ``retryBackoff`` 1.5), each attempt an RPC with the agent's default timeout
CLEANUP_RETRY = RetryPolicy(ack_wait=None, spacing=1.0, backoff=1.5, max_retries=20)


def context_not_found(context_id: int) -> RuntimeError:
    return RuntimeError(f"Could not find autograd context with id: {context_id}")


class Handoff(torch.autograd.Function):
    """A node whose only edge is the gradient edge of its input, for any layout (``get_gradient_edge``
    cannot find a sparse tensor's: it goes through ``view_as``, which sparse layouts lack).

    Its output keeps that edge's node alive: a Python node (a custom Function's, a received tensor's
    recv node) is owned by the C++ graph only, and would die with the last tensor referring to it, e.g.
    a received tensor that is only passed on to another worker. A pass hands the node the gradient for
    the edge in ``pending`` instead of as the engine's root gradient, which the engine holds for the
    whole call: that way the nodes behind it may adopt the gradient when nothing else holds it, as
    behind PyTorch's send function, which gives its gradients away (DAG-20). The output, a scalar
    that keeps none of the input's data, is also the root gradient the engine is started with.
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        ctx.pending = None
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        pending, ctx.pending = ctx.pending, None
        return grad if pending is None else pending


def handoff(t: torch.Tensor) -> torch.Tensor:
    """A :class:`Handoff` output for ``t`` (also inside ``torch.no_grad``)."""
    with torch.enable_grad():
        return Handoff.apply(t)  # type: ignore[no-any-return,no-untyped-call]


class SendRpcBackward:
    """A send function: the gradients of ``tensors`` come back from ``peer`` (DAG-4).

    Its ``next_functions`` are the tensors' gradient edges, as PyTorch's SendRpcBackward node; a
    :class:`Handoff` per tensor keeps each edge's node alive and takes the gradient that comes back.
    """

    __slots__ = ("autograd_message_id", "handoffs", "next_functions", "peer", "what")

    def __init__(self, message_id: int, peer: int, tensors: list[torch.Tensor], what: str) -> None:
        self.autograd_message_id = message_id
        self.peer = peer
        self.what = what
        self.handoffs = tuple(handoff(t) for t in tensors)
        self.next_functions: tuple[tuple[Any, int], ...] = tuple(
            h.grad_fn.next_functions[0] for h in self.handoffs
        )

    @staticmethod
    def name() -> str:
        return "torch::distributed::autograd::SendRpcBackward"

    def __repr__(self) -> str:
        return f"<SendRpcBackward id={self.autograd_message_id} {self.what}>"


#: a recv node's ``taken`` while a pass waits for the gradient it is handed (twinrpc._fast_engine)
TAKING: Any = object()


class _RecvRpc(torch.autograd.Function):
    """The grad_fn of one received tensor. Its edge to a dummy leaf only makes the output require grad;
    the FAST engine never lets gradients flow past it: it collects them per message instead.

    The node refers to its :class:`RecvRpcBackward` weakly (``entry`` is a ``weakref.ref``), as
    PyTorch's recv function refers to its context: the context owns the entry, and the entry its
    nodes. A strong reference back made each received tensor's graph a cycle that only the cyclic
    garbage collector frees; once the context is released, :func:`recv_entry` raises as PyTorch does.

    A pass that sets the node's ``taken`` to :data:`TAKING` gets there the gradient the node is handed
    (after tensor hooks and pre-hooks, undefined as None): a hook of its own would cost a registration
    and a removal per node and pass, on the critical path of every distributed backward."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, box: list[torch.Tensor], entry: Any, slot: int) -> Any:
        ctx.entry = weakref.ref(entry)
        ctx.slot = slot
        ctx.taken = None
        ctx.set_materialize_grads(False)  # an undefined gradient stays None: zeros of the slot's layout go
        return box[0]

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if ctx.taken is TAKING:
            ctx.taken = grad
        return None, None, None, None


RECV_NODE_TYPE: Any = _RecvRpc._backward_cls
_ANCHOR = torch.zeros((), requires_grad=True)


def recv_entry(node: Any) -> RecvRpcBackward:
    """The recv function a recv node belongs to.

    Raises:
        RuntimeError: its autograd context was released (PyTorch's message).
    """
    entry: RecvRpcBackward | None = node.entry()
    if entry is None:
        raise RuntimeError(
            "Autograd context no longer valid! This usually means the autograd context was cleaned up "
            "by a different thread due to an error before RecvRcpBackward had a chance to run"
        )
    return entry


class RecvRpcBackward:
    """A recv function: the tensors of one message from ``peer`` that require grad (DAG-4).

    A backward pass sends exactly one gradient message for it, with one gradient per tensor.
    """

    __slots__ = ("__weakref__", "autograd_message_id", "meta", "nodes", "peer", "what")

    next_functions: tuple[tuple[Any, int], ...] = ()

    def __init__(self, message_id: int, peer: int, what: str) -> None:
        self.autograd_message_id = message_id
        self.peer = peer
        self.what = what
        self.nodes: list[Any] = []
        #: shape, dtype and layout of each slot's tensor
        self.meta: list[tuple[torch.Size, torch.dtype, torch.layout]] = []

    def attach(self, t: torch.Tensor) -> torch.Tensor:
        slot = len(self.nodes)
        with torch.enable_grad():
            out = _RecvRpc.apply(_ANCHOR, [t], self, slot)  # type: ignore[no-untyped-call]
        self.nodes.append(out.grad_fn)
        self.meta.append((t.shape, t.dtype, t.layout))
        return out  # type: ignore[no-any-return]

    def zero_gradient(self, slot: int) -> torch.Tensor:
        """The gradient sent back for the tensor in ``slot`` when the pass gave it none, as PyTorch's
        recv function sends: zeros of its shape, dtype and layout (for a sparse layout no stored
        entry, every dimension sparse; none exists for BSR and BSC, whose zeros raise naming the
        layout; DAG-6, DAG-14)."""
        shape, dtype, layout = self.meta[slot]
        return torch.zeros(shape, dtype=dtype, layout=layout)

    @staticmethod
    def name() -> str:
        return "torch::distributed::autograd::RecvRpcBackward"

    def __repr__(self) -> str:
        return f"<RecvRpcBackward id={self.autograd_message_id} {self.what}>"


class DistAutogradContext:
    """One distributed autograd context on one worker (PyTorch's ``DistAutogradContext``)."""

    def __init__(self, container: DistAutogradContainer, context_id: int) -> None:
        self.container = container
        self.context_id = context_id
        self.lock = threading.Lock()
        self.sends: dict[int, SendRpcBackward] = {}
        self.recvs: dict[int, RecvRpcBackward] = {}
        self.known_workers: set[int] = set()
        #: leaf tensor -> accumulated gradient (dict keys compare by identity first)
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.current_pass: GraphPass | None = None
        #: autograd nodes whose buffers a pass without retain_graph consumed (per-node mode)
        self.released: set[Any] = set()
        # Every GRADIENT request served in this context, keyed by its sender's rank and message id,
        # with the pass that took it: a copy (only a simulator fault plan duplicates messages) must
        # not be applied again.
        self.gradient_requests: dict[tuple[int, int], GraphPass] = {}

    # PyTorch's private accessors
    def _context_id(self) -> int:
        return self.context_id

    def _send_functions(self) -> dict[int, SendRpcBackward]:
        with self.lock:
            return dict(self.sends)

    def _recv_functions(self) -> dict[int, RecvRpcBackward]:
        with self.lock:
            return dict(self.recvs)

    def _known_worker_ids(self) -> set[int]:
        with self.lock:
            return set(self.known_workers)

    def forget_passes(self) -> None:
        """Drop this context's references to its backward passes once it is released (no request
        finds it any more). Each pass refers to its context, so without this a released context
        and its graph are a reference cycle that only a full garbage collection frees; a pass still
        running keeps what it needs through its own reference."""
        with self.lock:
            self.current_pass = None
            self.gradient_requests.clear()

    def __repr__(self) -> str:
        return f"<DistAutogradContext {self.context_id} on rank {self.container.rank}>"


class AutogradEnvelope:
    """A request or reply payload that joins a context. Unpickling it opens the recv hook before its
    body's tensors are rebuilt (pickle builds the object before setting its state)."""

    __slots__ = ("body", "context_id", "message_id", "response", "src")

    def __init__(self, context_id: int, message_id: int, src: int, response: bool, body: Any) -> None:
        self.context_id = context_id
        self.message_id = message_id
        self.src = src
        self.response = response
        self.body = body

    def __reduce__(self) -> Any:
        return (_open_envelope, (self.context_id, self.message_id, self.src, self.response), self.body)

    def __setstate__(self, body: Any) -> None:
        self.body = body


def _open_envelope(context_id: int, message_id: int, src: int, response: bool) -> AutogradEnvelope:
    from ._current import current_agent

    agent = current_agent()
    if agent.unpickle_allow is not None:  # a peer chose the arguments: only what twinrpc sends
        for value in (context_id, message_id, src, response):
            agent.unpickle_allow.check_type(value, int, "the distributed autograd envelope")
    return open_envelope(
        agent.autograd, context_id, message_id, src, response, _serialize.current_load_state()
    )


def open_envelope(
    container: DistAutogradContainer,
    context_id: int,
    message_id: int,
    src: int,
    response: bool,
    state: _serialize.LoadState | None,
) -> AutogradEnvelope:
    """An arriving envelope's header: the context joins (a request may create it here), and the
    tensors of the body that require grad get recv nodes as ``state`` rebuilds them (its hook). The
    body is set by the caller (the unpickler, or twinrpc._builtin_wire's decoder)."""
    env = AutogradEnvelope(context_id, message_id, src, response, None)
    ctx = container.get(context_id)
    if ctx is None:
        if response:  # the caller left the context before the reply came: nothing to link
            return env
        ctx = container.create(context_id)
    with ctx.lock:
        ctx.known_workers.add(src)
    if state is not None:
        peer_name = container.agent.worker_by_id(src).name
        what = f"{'reply' if response else 'request'} from {peer_name}"
        state.autograd = _RecvHook(ctx, RecvRpcBackward(message_id, src, what))
    return env


_builtin_wire.open_envelope = open_envelope  # a compact envelope joins its context as a pickled one


class _RecvHook:
    """Gives every received tensor that requires grad a recv node (called by the unpickler)."""

    __slots__ = ("ctx", "entry")

    def __init__(self, ctx: DistAutogradContext, entry: RecvRpcBackward) -> None:
        self.ctx = ctx
        self.entry = entry

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        entry = self.entry
        if not entry.nodes:
            with self.ctx.lock:
                self.ctx.recvs[entry.autograd_message_id] = entry
            observer = self.ctx.container.observer
            if observer is not None:
                observer.autograd_event(
                    self.ctx.container.rank,
                    "recv-recorded",
                    self.ctx.context_id,
                    f"autograd message {entry.autograd_message_id}: {entry.what}",
                )
        return entry.attach(t)


def _pickled_unless(
    compact: tuple[bytes, list[torch.Tensor]] | None,
    envelope: AutogradEnvelope,
    fork: Callable[[Any], Any],
    grads: list[torch.Tensor],
    link_parameters: bool,
) -> tuple[bytes, list[torch.Tensor]]:
    """``compact`` if the envelope could travel without pickle, else the pickled ``envelope`` (its
    tensors that require grad in ``grads``, anything the compact attempt put there dropped)."""
    if compact is not None:
        return compact
    grads.clear()
    return _serialize.dumps(envelope, fork, grads, link_parameters=link_parameters)


def _any_requires_grad(obj: Any, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.requires_grad
    if depth > 3:
        return False
    if isinstance(obj, (list, tuple)):
        return any(_any_requires_grad(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return any(_any_requires_grad(x, depth + 1) for x in obj.values())
    return False


def _func_name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None)
    if module is None or str(name).startswith("_VariableFunctionsClass."):  # torch builtins
        return f"torch.{getattr(func, '__name__', name)}"
    return f"{module}.{name}"


class DistAutogradContainer:
    """All distributed autograd state of one worker (PyTorch's ``DistAutogradContainer``)."""

    def __init__(self, agent: RpcAgent) -> None:
        rank = agent.info.id
        if not 0 <= rank <= _MAX_WORKER_ID:
            raise RuntimeError(f"worker id {rank} is out of range [0, {_MAX_WORKER_ID}]")
        self.agent = agent
        self.rank = rank
        self._lock = threading.Lock()
        self._next_context = itertools.count(rank << _ID_BITS)
        self._next_message = itertools.count(rank << _ID_BITS)
        self._contexts: dict[int, DistAutogradContext] = {}
        #: (src, request id) -> (context id, what) for requests served inside a context; the agent's
        #: reply path checks this dict's truthiness only, so it costs nothing outside autograd
        self.replies: dict[tuple[int, int], tuple[int, str]] = {}
        agent.control.register(Kind.CONTEXT_CLEANUP, self.on_cleanup)  # releases travel reliably
        self.observer: AutogradObserver | None = None

    # -- ids and contexts ----------------------------------------------------------------------
    def max_id(self) -> int:
        return (self.rank << _ID_BITS) | ((1 << _ID_BITS) - 1)

    def new_message_id(self) -> int:
        return next(self._next_message)

    def new_context(self) -> DistAutogradContext:
        if CURRENT_CONTEXT.get() is not None:
            raise RuntimeError("Already have an autograd context id for this thread.")
        ctx = self.create(next(self._next_context))
        CURRENT_CONTEXT.set(ctx.context_id)
        return ctx

    def create(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is not None:
                return ctx
            ctx = self._contexts[context_id] = DistAutogradContext(self, context_id)
        if self.observer is not None:
            self.observer.autograd_event(self.rank, "context-created", context_id, "")
        return ctx

    def get(self, context_id: int) -> DistAutogradContext | None:
        return self._contexts.get(context_id)

    def retrieve(self, context_id: int) -> DistAutogradContext:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise context_not_found(context_id)
        return ctx

    def current(self) -> DistAutogradContext:
        context_id = CURRENT_CONTEXT.get()
        if context_id is None:
            raise RuntimeError(
                "Current thread doesn't have a valid autograd context. Please wrap your "
                "code using: `with torch.distributed.autograd.context() as context_id` "
                "to generate a valid context"
            )
        return self.retrieve(context_id)

    def release(self, context_id: int) -> None:
        """Release a context here (it must exist) and ask every known worker to release it (DAG-10)."""
        if CURRENT_CONTEXT.get() == context_id:
            CURRENT_CONTEXT.set(None)
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
        if ctx is None:
            raise context_not_found(context_id)
        ctx.forget_passes()
        if self.observer is not None:
            self.observer.autograd_event(self.rank, "context-released", context_id, "released here")
        self._propagate_cleanup(ctx, exclude=-1)

    def _propagate_cleanup(self, ctx: DistAutogradContext, exclude: int, departed: int = -1) -> None:
        """Ask every known worker but ``exclude`` to release ``ctx``; for a release caused by the
        death of rank ``departed`` (DAG-18), not its creator either, whose block is still running."""
        with ctx.lock:
            known = sorted(ctx.known_workers)
        if departed < 0:
            for dst in known:
                if dst != exclude and dst != self.rank:
                    self._send_cleanup(dst, ctx.context_id)
            return
        creator = ctx.context_id >> _ID_BITS
        for dst in known:
            if dst != exclude and dst != self.rank and dst != creator and dst != departed:
                self._send_cleanup(dst, (ctx.context_id, departed))

    def _send_cleanup(self, dst: int, body: int | tuple[int, int]) -> None:
        # Best effort, as PyTorch: resent per CLEANUP_RETRY on the RRef control channel (so the receiver
        # handles it once however often it arrives); a final failure is only logged.
        try:
            # Deferrable: nothing waits on a release, and in a training loop the next iteration's
            # first call to ``dst`` carries it (the gloo world), instead of a frame and a wake-up of
            # its own on the critical path of both workers.
            fut = self.agent.control.send(dst, Kind.CONTEXT_CLEANUP, body, CLEANUP_RETRY, deferrable=True)
        except Exception as exc:  # the agent is shutting down
            _log.debug("twinrpc: could not send the release of context %s to rank %d: %s", body, dst, exc)
            return
        add_internal_callback(fut, lambda f: self._cleanup_done(f, dst))

    def _cleanup_done(self, fut: Future[None], dst: int) -> None:
        try:
            fut.wait()
        except (ShutdownError, NotInitializedError, WorkerUnavailableError) as exc:  # nothing to release
            _log.debug("twinrpc: context release to rank %d abandoned: %s", dst, exc)
        except Exception as exc:
            _log.error("Could not release Dist Autograd Context on node %d: %s", dst, exc)

    def on_cleanup(self, src: int, body: int | tuple[int, int]) -> None:
        """A CONTEXT_CLEANUP request: release the context if present and forward it (transitive).

        ``body`` is the context id, or ``(context id, dead rank)`` for a release caused by a death
        (DAG-18), which never releases a context created here: its ``context()`` block is still
        running and releases it on exit.

        Idempotent: a context already released (a resend, or a cleanup that reached this worker by two
        paths) is not found and nothing happens, as PyTorch's ``releaseContextIfPresent``.
        """
        if isinstance(body, tuple):
            context_id, departed = body
            if context_id >> _ID_BITS == self.rank:
                return
            why = f"cleanup from rank {src} (rank {departed} died)"
        else:
            context_id, departed = body, -1
            why = f"cleanup from rank {src}"
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
        if ctx is not None:
            ctx.forget_passes()
            if self.observer is not None:
                self.observer.autograd_event(self.rank, "context-released", context_id, why)
            self._propagate_cleanup(ctx, exclude=src, departed=departed)

    def peer_departed(self, peer: int, died: bool) -> None:
        """``peer`` departed; if it ``died`` (crashed, or declared dead), release every context here
        that it created or took part in (it sent or received a message of it), except those created
        here, whose ``context()`` block releases them (DAG-18). Each release is forwarded to the
        context's other known workers (never back to its creator), which release it too: a context
        whose cleanup would have come through ``peer`` is not left behind. Requests it was served for
        and not answered yet are forgotten. (A worker that shut down RPC sent its releases when its
        blocks ended, as in PyTorch: nothing to do.)"""
        if not died:
            return
        with self._lock:
            doomed = sorted(
                (
                    ctx
                    for context_id, ctx in self._contexts.items()
                    if context_id >> _ID_BITS != self.rank
                    and (context_id >> _ID_BITS == peer or peer in ctx.known_workers)
                ),
                key=lambda c: c.context_id,
            )
            for ctx in doomed:
                del self._contexts[ctx.context_id]
            if self.replies:
                for key in [k for k in self.replies if k[0] == peer]:
                    del self.replies[key]
        for ctx in doomed:
            ctx.forget_passes()
            if self.observer is not None:
                self.observer.autograd_event(
                    self.rank, "context-released", ctx.context_id, f"rank {peer} died"
                )
            self._propagate_cleanup(ctx, exclude=peer, departed=peer)

    def clear(self) -> None:
        with self._lock:
            released = list(self._contexts.values())
            self._contexts.clear()
            self.replies.clear()
        for ctx in released:
            ctx.forget_passes()

    # -- recording (agent hooks) ---------------------------------------------------------------
    def dumps_request(
        self, context_id: int, dst: int, kind: Kind, obj: Any, fork: Callable[[Any], Any]
    ) -> tuple[bytes, list[torch.Tensor]]:
        """Pickle a request made inside context ``context_id``, recording a send function (DAG-3/4)."""
        ctx = self.get(context_id)
        if ctx is None:
            return _serialize.dumps(obj, fork)
        if kind is Kind.RREF_FETCH:
            what = "to_here()"
        else:
            func = obj[0] if kind is Kind.CALL else obj[2]
            args, kwargs = (obj[1], obj[2]) if kind is Kind.CALL else (obj[3], obj[4])
            builtin = is_builtin(func)
            if builtin and not (_any_requires_grad(args) or _any_requires_grad(kwargs)):
                # builtins join only with tensors requiring grad: this one travels as outside a context
                plain = _builtin_wire.encode_call(func, args, kwargs) if kind is Kind.CALL else None
                return plain if plain is not None else _serialize.dumps(obj, fork)
            what = f"{'remote' if kind is Kind.REMOTE_CALL else 'rpc'} call of {_func_name(func)}"
        peer = self.agent.worker_by_id(dst).name
        message_id = self.new_message_id()
        grads: list[torch.Tensor] = []
        # A builtin's call in its envelope without pickle (twinrpc._builtin_wire), else pickled
        compact = (
            _builtin_wire.encode_call(
                func, args, kwargs, envelope=(context_id, message_id, self.rank, False), grads=grads
            )
            if kind is Kind.CALL and builtin
            else None
        )
        envelope = AutogradEnvelope(context_id, message_id, self.rank, False, obj)
        # a builtin's Parameters join
        payload = _pickled_unless(compact, envelope, fork, grads, kind is not Kind.RREF_FETCH and builtin)
        with ctx.lock:
            ctx.known_workers.add(dst)
            if grads:
                ctx.sends[message_id] = SendRpcBackward(
                    message_id, dst, grads, f"arguments of the {what} to {peer}"
                )
        if grads and self.observer is not None:
            self.observer.autograd_event(
                self.rank,
                "send-recorded",
                context_id,
                f"autograd message {message_id}: arguments of the {what} to {peer}",
            )
        return payload

    def enter_request(self, msg: Message, env: AutogradEnvelope) -> tuple[Any, contextvars.Token[int | None]]:
        """Unwrap a served request: its reply joins the context, and the handler runs inside it."""
        body = env.body
        if msg.kind is Kind.RREF_FETCH:
            what = "to_here()"
        else:
            func = body[0] if msg.kind is Kind.CALL else body[2]
            what = f"{'remote' if msg.kind is Kind.REMOTE_CALL else 'rpc'} call of {_func_name(func)}"
        self.replies[(msg.src, msg.id)] = (env.context_id, what)
        return body, CURRENT_CONTEXT.set(env.context_id)

    def dumps_reply(
        self, msg: Message, value: Any, fork: Callable[[Any], Any], *, link_parameters: bool = False
    ) -> tuple[bytes, list[torch.Tensor]] | None:
        """Pickle the reply to a request served inside a context (None: not such a request)."""
        entry = self.replies.pop((msg.src, msg.id), None)
        if entry is None:
            return None
        context_id, what = entry
        ctx = self.get(context_id)
        if ctx is None:
            return None
        message_id = self.new_message_id()
        grads: list[torch.Tensor] = []
        # the reply to a call that came without pickle goes so too when it can (twinrpc._builtin_wire)
        compact = (
            _builtin_wire.encode_value(value, envelope=(context_id, message_id, self.rank, True), grads=grads)
            if msg.payload[:1] == _COMPACT
            else None
        )
        envelope = AutogradEnvelope(context_id, message_id, self.rank, True, value)
        payload = _pickled_unless(compact, envelope, fork, grads, link_parameters)
        if grads:
            peer = self.agent.worker_by_id(msg.src).name
            with ctx.lock:
                ctx.sends[message_id] = SendRpcBackward(
                    message_id, msg.src, grads, f"result of the {what} from {peer}"
                )
            if self.observer is not None:
                self.observer.autograd_event(
                    self.rank,
                    "send-recorded",
                    context_id,
                    f"autograd message {message_id}: result of the {what} from {peer}",
                )
        return payload

    def forget_reply(self, msg: Message) -> None:
        self.replies.pop((msg.src, msg.id), None)

    # -- backward (engine entry points) --------------------------------------------------------
    def on_gradient(self, msg: Message, obj: Any) -> None:
        """A GRADIENT request: gradients for one of this worker's send functions (DAG-6)."""
        from ._fast_engine import on_gradient_request

        self.agent.world.submit(on_gradient_request, self, msg, obj)

    def debug_info(self) -> dict[str, str]:
        with self._lock:
            n = len(self._contexts)
            passes = sum(
                1 for c in self._contexts.values() if c.current_pass is not None and c.current_pass.active
            )
        return {
            "num_current_backward_passes": str(passes),
            "num_autograd_contexts": str(n),
            "local_autograd_engine_cpu_queue_size": "0",
            "num_outstanding_rpcs": "0",
        }


# -- RRef.backward (RREF-10) ------------------------------------------------------------------------
def backward_owner_value(agent: RpcAgent, value: Any, context_id: int, retain_graph: bool) -> None:
    """Backward from an RRef's value on its owner: local autograd for id -1, else distributed."""
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    if context_id == -1:
        torch.autograd.backward([value])  # as PyTorch: a local pass ignores retain_graph
        return
    from ._fast_engine import run_backward

    run_backward(agent.autograd, context_id, [value], retain_graph)


def rref_backward_on_owner(rref: Any, context_id: int, retain_graph: bool) -> None:
    """Runs on the owner (an RPC from a user RRef's ``backward``). With ``unpickle_allow``, ``rref``
    must be an RRef, whose value backward_owner_value accepts only if it is a tensor."""
    owner_allowlist(rref, "RRef.backward")
    backward_owner_value(agent_of(rref), rref.local_value(), context_id, retain_graph)
