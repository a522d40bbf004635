"""Pickling for RPC, shared by both worlds (docs/explanation/architecture.md).

Tensors leave the byte stream: each distinct storage in a message becomes one flat ``uint8`` tensor in
the message's tensor list, and each tensor becomes a small record (storage index, dtype, size, stride,
storage offset, requires_grad), so views, strides and storage sharing within one message survive as in
PyTorch (RPC-9). A sparse tensor (COO, CSR, CSC, BSR, BSC) travels as its layout, shape and
requires_grad with its index and value tensors, which go out of band like any other (RPC-19). RRefs go
through the fork protocol (RREF-F1) via a hook the agent installs. Functions and classes travel by
reference, as with PyTorch's pickler.
"""

from __future__ import annotations

import io
import pickle
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from ._errors import SerializationError, serialization_error
from ._message import Kind
from ._rref import RRef
from ._unpickle_allow import UnpickleAllowlist

# A view whose storage is at least this big and at least twice the view's bytes is cloned compact
# before sending, as PyTorch's cloneSparseTensors does (RPC-9).
COMPACT_MIN_STORAGE_BYTES = _COMPACT_MIN_STORAGE_BYTES = 8192
#: the first byte of a payload in twinrpc._builtin_wire's encoding; a pickle starts with PROTO (0x80)
BUILTIN_MAGIC = 0xB7
_COMPACT = bytes((BUILTIN_MAGIC,))


class LoadState:
    """What unpickling one message needs: its storages, and the RRef hook with the message's source.

    A plain slotted class (not a dataclass with list factories): one is made for every message
    received, on the simulator's hottest path."""

    __slots__ = (
        "after_handling",
        "autograd",
        "rebuild_rref",
        "request",
        "src",
        "storages",
        "unconfirmed_rrefs",
    )

    def __init__(
        self,
        storages: list[torch.Tensor],
        src: int,
        rebuild_rref: Callable[[Any, int, LoadState], Any] | None,
        request: bool = False,
    ) -> None:
        self.storages = storages
        self.src = src
        self.rebuild_rref = rebuild_rref
        self.unconfirmed_rrefs: list[Any] = []
        #: control messages to send once the message has been handled (the caller's reply goes first)
        self.after_handling: list[Callable[[], None]] = []
        #: the message is a request, which this worker answers: the reply tells its sender that every
        #: RRef fork in it has reached this worker (twinrpc._rref_context, RREF-F1)
        self.request = request
        #: distributed autograd hook: turns each received tensor that requires grad into one with a
        #: recv function as grad_fn (set while unpickling an AutogradEnvelope; twinrpc._dist_autograd)
        self.autograd: Callable[[torch.Tensor], torch.Tensor] | None = None

    def handled(self) -> None:
        """The message has been handled (or cannot be): run what was deferred until then."""
        todo = self.after_handling
        if todo:
            self.after_handling = []
            for fn in todo:
                fn()


#: every future torch makes (what then() and collect_all() return too), twinrpc's included
_FUTURE_TYPES = torch._C.Future
#: what pickle sends by reference and the pickler has no hook for: checked first, as each isinstance
#: below costs about half a microsecond (torch's metaclasses)
_BY_REFERENCE = frozenset({types.FunctionType, types.BuiltinFunctionType, type})
_PROTOCOL = pickle.HIGHEST_PROTOCOL
#: exact types the pickler hook passes on at once (reducer_override): what every call carries besides
#: tensors, so the isinstance checks below it are skipped
_PLAIN = _BY_REFERENCE | {tuple, list, dict, torch.dtype, torch.Size}
_STRIDED = torch.strided
#: ``_BYTES.new(storage)``: a uint8 tensor over a whole untyped storage, a third of the cost of
#: ``torch.empty(0, dtype=torch.uint8).set_(storage)`` (one of these per storage sent)
_BYTES = torch.empty(0, dtype=torch.uint8)
_EMPTY: dict[torch.dtype, torch.Tensor] = {}


def _empty_of(dtype: torch.dtype) -> torch.Tensor:
    """A new empty tensor of ``dtype`` (``Tensor.new()`` on a cached one: cheaper than torch.empty)."""
    proto = _EMPTY.get(dtype)
    if proto is None:
        proto = _EMPTY[dtype] = torch.empty(0, dtype=dtype)
    return proto.new()


empty_of = _empty_of


def storage_bytes(storage: torch.Tensor) -> int:
    """The bytes of an out-of-band storage as it arrived (the flat ``uint8`` tensor over it)."""
    return storage.untyped_storage().nbytes()


class _LoadSlot(threading.local):
    state: LoadState | None = None


# Unpickling never blocks (no task switch can happen inside it), so a thread-local is enough in both
# worlds, and it is much cheaper than a context variable on this hot path.
_LOAD = _LoadSlot()


def _rebuild_tensor(
    index: int,
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    requires_grad: bool,
) -> torch.Tensor:
    state = _LOAD.state
    if state is None:
        raise SerializationError("a twinrpc tensor record was unpickled outside an RPC message")
    storage = state.storages[index].untyped_storage()
    t = _empty_of(dtype).set_(storage, offset, size, stride)
    if requires_grad:
        if state.autograd is not None:  # distributed autograd hook (DAG-4)
            return state.autograd(t)
        t.requires_grad_(True)
    return t


#: the compressed sparse layouts and their (compressed, plain) index accessors
_COMPRESSED_INDICES: dict[torch.layout, tuple[Callable[[torch.Tensor], torch.Tensor], ...]] = {
    torch.sparse_csr: (torch.Tensor.crow_indices, torch.Tensor.col_indices),
    torch.sparse_csc: (torch.Tensor.ccol_indices, torch.Tensor.row_indices),
    torch.sparse_bsr: (torch.Tensor.crow_indices, torch.Tensor.col_indices),
    torch.sparse_bsc: (torch.Tensor.ccol_indices, torch.Tensor.row_indices),
}


def _rebuild_sparse(
    layout: torch.layout, parts: tuple[torch.Tensor, ...], size: tuple[int, ...], requires_grad: bool
) -> torch.Tensor:
    state = _LOAD.state
    if state is None:
        raise SerializationError("a twinrpc sparse tensor record was unpickled outside an RPC message")
    if layout == torch.sparse_coo:
        indices, values = parts
        # Coalesced only with fewer than two entries, whatever the sender's was: as PyTorch (RPC-19).
        t = torch.sparse_coo_tensor(indices, values, size, check_invariants=False)
    else:
        compressed, plain, values = parts
        t = torch.sparse_compressed_tensor(
            compressed, plain, values, size, layout=layout, check_invariants=False
        )
    if requires_grad:
        if state.autograd is not None:  # distributed autograd hook (DAG-4)
            return state.autograd(t)
        t.requires_grad_(True)
    return t


def current_load_state() -> LoadState | None:
    """The state of the message being unpickled on this thread (for reduce hooks), or None."""
    return _LOAD.state


def _rebuild_rref(fork_data: Any) -> Any:
    state = _LOAD.state
    if state is None or state.rebuild_rref is None:
        raise SerializationError("an RRef was unpickled outside an RPC message")
    return state.rebuild_rref(fork_data, state.src, state)


#: how the RPC pickler sends objects of these exact types (``twinrpc.nn``'s RemoteModule, say), instead of
#: their own ``__reduce__``, which may refuse the Python pickler (PyTorch's ``_register_reducer``)
_REDUCERS: dict[type, Callable[[Any], Any]] = {}


def register_reducer(cls: type, reducer: Callable[[Any], Any]) -> None:
    """Pickle every RPC-sent instance of exactly ``cls`` as ``reducer(obj)`` (a ``__reduce__`` value)."""
    _REDUCERS[cls] = reducer


class _RpcPickler(pickle.Pickler):
    # No __init__ override: a Python-level __init__ costs more than the pickling of a small call.
    # State is created on first use by _reduce_tensor.
    storages: list[torch.Tensor] | None = None
    _storage_index: dict[tuple[int, int], int]
    _keepalive: list[torch.Tensor]
    _fork_rref: Callable[[Any], Any] | None = None
    #: distributed autograd hook: collects the (undetached) tensors that require grad
    _grad_tensors: list[torch.Tensor] | None = None
    #: send an ``nn.Parameter`` as the tensor it is (recorded for autograd like any tensor) rather
    #: than as torch pickles it; see :func:`dumps`
    _link_parameters = False

    def reducer_override(self, obj: Any) -> Any:
        tp = type(obj)
        if tp is torch.Tensor:  # first: most of what an RPC carries, and no isinstance needed
            return self._reduce_tensor(obj)
        if tp in _PLAIN:  # functions, containers, dtypes: none of the types below
            return NotImplemented
        if isinstance(obj, torch.Tensor):
            return self._reduce_tensor(obj)
        if isinstance(obj, _FUTURE_TYPES):
            raise SerializationError(
                "Can not pickle torch.futures.Future: a Future cannot be an RPC argument or result; "
                "wait for it first and send its value"
            )
        if isinstance(obj, RRef):
            if self._fork_rref is None:
                raise SerializationError("an RRef can only be sent inside an RPC to a known worker")
            return (_rebuild_rref, (self._fork_rref(obj),))
        reducer = _REDUCERS.get(tp)
        if reducer is not None:
            return reducer(obj)
        return NotImplemented

    def _reduce_tensor(self, t: torch.Tensor) -> Any:
        tp = type(t)
        if tp is not torch.Tensor and (tp is not torch.nn.Parameter or not self._link_parameters):
            # subclasses, and Parameters as PyTorch's RPC pickler sends them: torch's own reduce,
            # whose parts come back here (a Parameter's is its detached ``data``, RPC-9)
            return NotImplemented
        if t.layout is not _STRIDED:
            return self._reduce_sparse(t)
        if not t.is_cpu:
            raise _not_cpu(t)
        if self.storages is None:
            self.storages, self._storage_index, self._keepalive = [], {}, []
        requires_grad = t.requires_grad
        if requires_grad and self._grad_tensors is not None:
            self._grad_tensors.append(t)
        # The tensor itself, not a detached alias: reading its storage and geometry records nothing
        # in autograd; only the clone below would, so it clones a detached alias.
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes >= _COMPACT_MIN_STORAGE_BYTES and nbytes >= 2 * t.numel() * t.element_size():
            t = t.detach().clone()
            self._keepalive.append(t)
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
        key = (storage.data_ptr(), nbytes)
        index = self._storage_index.get(key) if nbytes else None
        if index is None:
            index = len(self.storages)
            self.storages.append(_BYTES.new(storage))  # a uint8 tensor over the whole storage
            if nbytes:
                self._storage_index[key] = index
        return (
            _rebuild_tensor,
            (index, t.dtype, tuple(t.size()), t.stride(), t.storage_offset(), requires_grad),
        )

    def _reduce_sparse(self, t: torch.Tensor) -> Any:
        """A sparse tensor as its layout, shape and requires_grad, and its index and value tensors
        (pickled by :meth:`_reduce_tensor` in turn). Distributed autograd records the sparse tensor
        itself: its gradient comes back for it, not for its values (RPC-19, DAG-4)."""
        layout = t.layout
        if layout != torch.sparse_coo and layout not in _COMPRESSED_INDICES:
            raise SerializationError(
                f"twinrpc cannot send a tensor with layout {layout} (shape {tuple(t.shape)}, {t.dtype}): "
                "only strided and sparse (COO, CSR, CSC, BSR, BSC) tensors travel. Convert it with "
                ".to_dense() before the RPC"
            )
        if t.device.type != "cpu":
            raise _not_cpu(t)
        requires_grad = t.requires_grad
        if requires_grad and self._grad_tensors is not None:
            self._grad_tensors.append(t)
        t = t.detach()
        if layout == torch.sparse_coo:
            parts: tuple[torch.Tensor, ...] = (t._indices(), t._values())
        else:
            compressed, plain = _COMPRESSED_INDICES[layout]
            parts = (compressed(t), plain(t), t.values())
        return (_rebuild_sparse, (layout, parts, tuple(t.size()), requires_grad))


def _not_cpu(t: torch.Tensor) -> SerializationError:
    return SerializationError(
        f"twinrpc only supports CPU tensors; got a tensor on {t.device} "
        f"(shape {tuple(t.shape)}, {t.dtype}). Move it to the CPU with .cpu() before the RPC"
    )


class _PicklerSlot(threading.local):
    #: this thread's idle pickler and its buffer: making a pickler costs more than pickling a small
    #: call, so one is reused (taken out while in use: a nested dumps, say from a fork hook that
    #: sends a control message, makes its own; one that failed is dropped)
    idle: tuple[io.BytesIO, _RpcPickler] | None = None


_PICKLERS = _PicklerSlot()


def dumps(
    obj: Any,
    fork_rref: Callable[[Any], Any] | None = None,
    grad_tensors: list[torch.Tensor] | None = None,
    *,
    link_parameters: bool = False,
) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj`` for an RPC: returns the payload bytes and the out-of-band storages.

    ``grad_tensors``, when given, receives every tensor that requires grad (distributed autograd).
    An ``nn.Parameter`` arrives as an ``nn.Parameter`` with its ``requires_grad``, rebuilt from its
    detached data as PyTorch's pickler sends it, so it is never recorded for autograd (RPC-9);
    ``link_parameters`` sends it as the tensor it is instead, as PyTorch sends a builtin operator's
    arguments (DAG-4).

    Raises:
        SerializationError: ``obj`` cannot travel (unpicklable, a lambda, a CUDA tensor, a Future).
    """
    slot = _PICKLERS
    idle = slot.idle
    if idle is None:
        buf = io.BytesIO()
        pickler = _RpcPickler(buf, _PROTOCOL)
    else:
        slot.idle = None
        buf, pickler = idle
    pickler._fork_rref = fork_rref
    pickler._grad_tensors = grad_tensors
    pickler._link_parameters = link_parameters
    try:
        pickler.dump(obj)
    except SerializationError:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise serialization_error(f"{exc}{_hint(exc)}", type(exc)) from exc
    payload = buf.getvalue()
    storages = pickler.storages
    # Ready for the next message: nothing of this one stays referenced.
    if storages is not None:
        pickler.storages = None
        del pickler._storage_index, pickler._keepalive
    pickler._fork_rref = pickler._grad_tensors = None
    pickler._link_parameters = False
    pickler.clear_memo()
    buf.seek(0)
    buf.truncate()
    slot.idle = buf, pickler
    return payload, storages or []


def _hint(exc: BaseException) -> str:
    text = str(exc)
    if "<lambda>" in text or "local object" in text or "attribute lookup" in text:
        return (
            ". RPC sends functions and classes by reference (module and name), so they must be "
            "importable module-level objects on the callee; lambdas and local functions cannot be sent"
        )
    return ". Every RPC argument and result must be picklable"


def loads(
    payload: bytes,
    storages: list[torch.Tensor],
    src: int = -1,
    rebuild_rref: Callable[[Any, int, LoadState], Any] | None = None,
    request: bool = False,
    allow: UnpickleAllowlist | None = None,
    kind: Kind | None = None,
) -> tuple[Any, LoadState]:
    """Unpickle a payload made by :func:`dumps` (or decode a builtin call or its reply made by
    ``twinrpc._builtin_wire``); returns the object and the load state. ``request``:
    the payload is a request that this worker will answer (see LoadState.request). ``allow``: load
    only the globals it allows (twinrpc._unpickle_allow); None: any, as PyTorch does. ``kind``: the
    message's kind, which a payload in the compact encoding must fit (``_builtin_wire.check_kind``).

    Raises:
        UnpickleRefused: the payload names a global that ``allow`` does not allow.
        SerializationError: a builtin call's (or its reply's) payload is malformed.
    """
    state = LoadState(storages, src, rebuild_rref, request)
    if payload[:1] == _COMPACT:  # a builtin operator call without pickle (twinrpc._builtin_wire)
        try:
            if kind is not None:
                _builtin_wire.check_kind(payload, kind)
            return _builtin_wire.decode(payload, state, allow), state
        except BaseException:
            state.handled()
            raise
    slot = _LOAD
    outer = slot.state
    slot.state = state
    try:
        return (pickle.loads(payload) if allow is None else allow.loads(payload)), state
    except BaseException:
        state.handled()  # nothing will handle the message: what was deferred must happen now
        raise
    finally:
        slot.state = outer


def copy_storages(storages: list[torch.Tensor]) -> list[torch.Tensor]:
    """The simulator's wire: the receiver gets its own copy of every storage."""
    return [s.clone() for s in storages]


# Last: twinrpc._builtin_wire builds on this module's tensor records.
from . import _builtin_wire  # noqa: E402
