"""The compact encoding of a builtin operator call: ``rpc_sync(to, torch.add, args=(t1, t2))`` without pickle.

A call of one of torch's builtin operators (an attribute of ``torch._C._VariableFunctionsClass``, as
``torch.add`` and ``torch.matmul`` are) whose arguments are all CPU tensors, numbers (``int`` within 64
bits, ``float``), bools, None, and tuples or lists of those, travels as the operator's name and a few
tagged values. Tensors go as records (storage index, dtype, size, stride, storage offset, requires_grad)
over the storages that travel out of band, exactly as the pickler sends them (twinrpc._serialize):
views, strides and storages shared within the call survive, and an oversized view is cloned compact
first, as there (RPC-9). Anything else returns None from :func:`encode_call` and is pickled as before.

The reply to such a call travels in the same encoding when its value is of those kinds (a tensor,
usually); otherwise it is pickled. Both worlds encode and decode it alike, so the simulator runs the
encoder the real world runs (``twinrpc._serialize.loads`` tells the two encodings apart by the first
byte).

Decoding checks each part before it builds anything from it: a malformed payload raises
:class:`~twinrpc._errors.SerializationError` naming what is wrong (the call is not run; the caller
gets the error), and a worker with an ``unpickle_allow`` allowlist accepts the operator only if a
pattern allows its name (``torch.add``), refusing it with the same
:class:`~twinrpc._unpickle_allow.UnpickleRefused` a pickle naming it gets.

Distributed autograd uses the encoding too. A builtin call made inside a context whose tensors require
grad travels in an envelope (kind ``3``): a header (int64 context id, int64 autograd message id, uint16
sender's rank, a byte: 0 request, 1 reply), then ``1`` and the call, or, for its reply, ``2`` and the
value; decoding it joins the context as unpickling an ``AutogradEnvelope`` does, and each tensor that
requires grad gets its recv node as it is rebuilt (``LoadState.autograd``). A GRADIENT request's body
is kind ``4``: int64 context id, int64 pass id, int64 autograd message id, a retain_graph byte, then
the gradients as a list value. A REMOTE_CALL of a builtin is kind ``5``: the RRef's id and the
caller's fork's (uint16 creator, int64 local id each), then the call as for kind ``1``. A message's
kind decides what its compact payload may hold (:func:`check_kind`): a CALL a call, a REMOTE_CALL a
remote call, a reply a value, a GRADIENT gradients.

Layout (little-endian): ``MAGIC``, then ``1`` for a call or ``2`` for a value. A call: the operator's
name (a length byte, ASCII), the positional arguments as one tuple value, a count byte and that many
(name, value) keyword arguments. A value is a tag byte and its body: ``N`` None, ``T``/``F`` a bool,
``i`` an int64, ``f`` a float64, ``(``/``[`` a tuple/list (a uint16 count, then the items), ``t`` a
tensor record (uint16 storage index, dtype code, ndim, requires_grad, int64 storage offset, ndim int64
sizes, ndim int64 strides), ``r`` a reference (uint16) to the n-th tensor, tuple or list completed
before it: an object that occurs twice arrives as one object, as the pickle's memo makes it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import torch

from ._current import current_agent
from ._errors import SerializationError
from ._message import Kind
from ._rref import GloballyUniqueId
from ._serialize import BUILTIN_MAGIC, COMPACT_MIN_STORAGE_BYTES, LoadState, empty_of, storage_bytes
from ._unpickle_allow import UnpickleAllowlist

#: the first byte of a compact payload; a pickle starts with PROTO (0x80), so the two never meet
MAGIC = BUILTIN_MAGIC
#: the second byte: what the payload holds
_CALL = 1  # a call: (op, args, kwargs)
_VALUE = 2  # a value: the reply to a call sent in this encoding, or the body of a GRADIENT request
_ENVELOPE = 3  # a call or a value inside a distributed autograd context (an AutogradEnvelope)
_GRADIENT = 4  # a GRADIENT request's body: (context id, pass id, autograd message id, gradients, retain)
_REMOTE = 5  # a REMOTE_CALL's body: (rref id, fork id, op, args, kwargs)
#: the class torch's builtin operators are attributes of (how a pickle names ``torch.add``'s owner)
_OPERATORS = torch._C._VariableFunctionsClass  # type: ignore[attr-defined]
#: nesting of tuples and lists: deeper calls are pickled (and a deeper payload is refused)
MAX_DEPTH = 16
#: items of one tuple or list (the count is a uint16)
_MAX_ITEMS = 0xFFFF
#: storages of one call (the index is a uint16)
_MAX_STORAGES = 0xFFFF
#: dimensions of one tensor (torch allows at most 64)
_MAX_NDIM = 64
_INT64 = (-(1 << 63), (1 << 63) - 1)

#: the dtypes a tensor record may name, by code; tensors of any other dtype (quantized, float8, ...)
#: make the call fall back to the pickle
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}

_U16 = struct.Struct("<H")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_GEOMETRY_1 = struct.Struct("<qq")
#: a tensor's sizes then strides, by its number of dimensions
_GEOMETRY = tuple(struct.Struct(f"<{2 * ndim}q") for ndim in range(_MAX_NDIM + 1))
_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_RECORD = struct.Struct("<HBBBq")  # storage index, dtype code, ndim, requires_grad, storage offset
_ENVELOPE_HEADER = struct.Struct("<qqHB")  # context id, autograd message id, sender's rank, response
_GRADIENT_HEADER = struct.Struct("<qqqB")  # context id, pass id, autograd message id, retain_graph
_REMOTE_HEADER = struct.Struct("<HqHq")  # the RRef's id and the caller's fork's: (creator, local id) each
_STRIDED = torch.strided
_BYTES = torch.empty(0, dtype=torch.uint8)


def _operators() -> dict[str, Any]:
    ops: dict[str, Any] = {}
    for name in dir(_OPERATORS):
        op = getattr(_OPERATORS, name, None)
        if not name.startswith("_") and type(op) is type(torch.add) and name.isascii() and len(name) < 256:
            ops[name] = op
    return ops


#: torch's builtin operators by name
OPERATORS: dict[str, Any] = _operators()
#: their names by the operator's id: a few are equal to one another (``torch.mm`` == ``torch.spmm``,
#: the same C function) but are distinct objects, each sent under its own name as the pickle does.
#: They live as long as torch, so an id is never reused.
_NAME_OF_ID: dict[int, str] = {id(op): name for name, op in OPERATORS.items()}


def operator_name(func: Any) -> str | None:
    """The name ``func`` travels under if it is one of torch's builtin operators, else None."""
    return _NAME_OF_ID.get(id(func))


#: operators that may run on the thread that received their call (``is_brief``): each computes a
#: result no larger than a polynomial of its tensor arguments, from them alone, and never waits for
#: anything (no allocation sized by a number argument, no randomness, no in-place update of an argument)
BRIEF_OPERATORS = frozenset(
    {
        "abs", "add", "addmm", "all", "any", "argmax", "argmin", "bmm", "cat", "ceil", "clamp", "clone",
        "cos", "cumsum", "div", "dot", "eq", "exp", "flatten", "floor", "ge", "gt", "le", "log",
        "logical_and", "logical_not", "logical_or", "lt", "matmul", "max", "maximum", "mean", "min",
        "minimum", "mm", "mul", "mv", "ne", "neg", "pow", "prod", "reciprocal", "relu", "remainder",
        "reshape", "round", "rsqrt", "sigmoid", "sign", "sin", "sqrt", "square", "squeeze", "stack",
        "sub", "sum", "t", "tanh", "transpose", "true_divide", "unsqueeze", "where",
    }
)  # fmt: skip
#: at most this many tensor elements in a brief call's arguments (their broadcast is then bounded too)
BRIEF_MAX_ELEMENTS = 4096


class _Encoder:
    """One call being encoded: its bytes and its out-of-band storages (deduplicated as the pickler does)."""

    __slots__ = ("grads", "keepalive", "memo", "out", "storage_index", "storages")

    def __init__(self, what: int, envelope: Envelope | None, grads: list[torch.Tensor] | None) -> None:
        if envelope is None:
            self.out = bytearray((MAGIC, what))
        else:
            self.out = bytearray((MAGIC, _ENVELOPE))
            self.out += _ENVELOPE_HEADER.pack(*envelope)
            self.out.append(what)
        #: distributed autograd: collects the (undetached) tensors that require grad, as the pickler
        self.grads = grads
        self.storages: list[torch.Tensor] = []
        self.storage_index: dict[tuple[int, int], int] = {}
        self.keepalive: list[torch.Tensor] = []
        #: id of each tensor, tuple and list written -> its number: an object met again is sent as a
        #: reference to it, so it arrives as one object, as the pickle's memo makes it
        self.memo: dict[int, int] = {}

    def value(self, v: Any, depth: int) -> bool:
        """Append ``v``; False: it cannot be encoded (the call is pickled instead)."""
        tp = type(v)
        out = self.out
        if tp is _TENSOR or tp is _PARAMETER:
            ref = self.memo.get(id(v))
            if ref is not None:
                out += b"r"
                out += _U16.pack(ref)
                return True
            return self.tensor(v) and self.remember(v)
        if tp is int:
            if not _INT64[0] <= v <= _INT64[1]:
                return False
            out += b"i"
            out += _I64.pack(v)
            return True
        if tp is float:
            out += b"f"
            out += _F64.pack(v)
            return True
        if v is None:
            out += b"N"
            return True
        if tp is bool:
            out += b"T" if v else b"F"
            return True
        if tp is tuple or tp is list:
            ref = self.memo.get(id(v))
            if ref is not None:
                out += b"r"
                out += _U16.pack(ref)
                return True
            if depth >= MAX_DEPTH or len(v) > _MAX_ITEMS:
                return False
            out += b"(" if tp is tuple else b"["
            out += _U16.pack(len(v))
            depth += 1
            for item in v:
                if not self.value(item, depth):
                    return False
            return self.remember(v)
        return False

    def remember(self, v: Any) -> bool:
        """``v`` (a tensor, tuple or list) is written whole: later occurrences refer to it."""
        n = len(self.memo)
        if n >= _MAX_ITEMS:
            return False
        self.memo[id(v)] = n
        return True

    def tensor(self, t: torch.Tensor) -> bool:
        if t.layout is not _STRIDED or not t.is_cpu or t.is_conj() or t.is_neg():
            return False  # sparse, CUDA, lazy conjugate/negative views: the pickler's to handle
        code = _DTYPE_CODE.get(t.dtype)
        if code is None:
            return False
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes >= COMPACT_MIN_STORAGE_BYTES and nbytes >= 2 * t.numel() * t.element_size():
            # as the pickler: a small view of a big storage travels as a compact clone (RPC-9)
            requires_grad = t.requires_grad
            if requires_grad and self.grads is not None:
                self.grads.append(t)
            t = t.detach().clone()
            self.keepalive.append(t)
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
        else:
            requires_grad = t.requires_grad
        if requires_grad and self.grads is not None:
            self.grads.append(t)
        key = (storage.data_ptr(), nbytes)
        index = self.storage_index.get(key) if nbytes else None
        if index is None:
            index = len(self.storages)
            if index >= _MAX_STORAGES:
                return False
            self.storages.append(_BYTES.new(storage))
            if nbytes:
                self.storage_index[key] = index
        size = t.size()
        ndim = len(size)
        out = self.out
        out += b"t"
        out += _RECORD.pack(index, code, ndim, requires_grad, t.storage_offset())
        if ndim:
            out += _GEOMETRY[ndim].pack(*size, *t.stride())
        return True


#: an AutogradEnvelope's header: (context id, autograd message id, sender's rank, response)
Envelope = tuple[int, int, int, bool]
#: how an arriving envelope joins its context: ``twinrpc._dist_autograd.open_envelope``, set when that
#: module loads (it builds on this one)
open_envelope: Callable[..., Any] | None = None


def encode_call(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    envelope: Envelope | None = None,
    grads: list[torch.Tensor] | None = None,
) -> tuple[bytes, list[torch.Tensor]] | None:
    """``(func, args, kwargs)`` in the compact encoding (payload, storages), or None when it does not
    apply (``func`` is not one of torch's builtin operators, or an argument is of another kind).

    ``envelope``: the call joins a distributed autograd context, as an ``AutogradEnvelope`` with this
    header would; ``grads`` then receives every tensor argument that requires grad (DAG-4)."""
    name = _NAME_OF_ID.get(id(func))
    if name is None:
        return None
    enc = _Encoder(_CALL, envelope, grads)
    return (bytes(enc.out), enc.storages) if _write_call(enc, name, args, kwargs) else None


def encode_remote_call(
    rref_id: Any, fork_id: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bytes, list[torch.Tensor]] | None:
    """A REMOTE_CALL's ``(rref_id, fork_id, func, args, kwargs)`` in the compact encoding (the two ids
    are ``GloballyUniqueId``s), or None when the call does not fit (as :func:`encode_call`)."""
    name = _NAME_OF_ID.get(id(func))
    if name is None:
        return None
    ids = (rref_id.created_on, rref_id.local_id, fork_id.created_on, fork_id.local_id)
    if not (
        0 <= ids[0] <= 0xFFFF and 0 <= ids[2] <= 0xFFFF and all(_INT64[0] <= i <= _INT64[1] for i in ids)
    ):
        return None
    enc = _Encoder(_REMOTE, None, None)
    enc.out += _REMOTE_HEADER.pack(*ids)
    return (bytes(enc.out), enc.storages) if _write_call(enc, name, args, kwargs) else None


def _write_call(enc: _Encoder, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Append a call of the operator ``name``; False: an argument cannot be encoded."""
    if len(kwargs) > 255:
        return False
    out = enc.out
    out.append(len(name))
    out += name.encode("ascii")
    if not enc.value(args, 0):
        return False
    out.append(len(kwargs))
    for key, v in kwargs.items():
        if type(key) is not str or not key.isascii() or not key.isidentifier() or len(key) > 255:
            return False
        out.append(len(key))
        out += key.encode("ascii")
        if not enc.value(v, 0):
            return False
    return True


def encode_value(
    value: Any, *, envelope: Envelope | None = None, grads: list[torch.Tensor] | None = None
) -> tuple[bytes, list[torch.Tensor]] | None:
    """A value in this encoding (the reply to a call that came in it, a gradient request's body), or
    None when it holds anything else (a named tuple, say, which the pickle keeps as its type).
    ``envelope`` and ``grads``: as for :func:`encode_call`."""
    enc = _Encoder(_VALUE, envelope, grads)
    if not enc.value(value, 0):
        return None
    return bytes(enc.out), enc.storages


def encode_gradients(
    context_id: int, pass_id: int, message_id: int, grads: list[torch.Tensor], retain_graph: bool
) -> tuple[bytes, list[torch.Tensor]] | None:
    """A GRADIENT request's body in this encoding (a fixed header, then the gradients as a list), or
    None when it does not fit (a sparse gradient, an id beyond 64 bits): it is pickled then."""
    if not all(_INT64[0] <= v <= _INT64[1] for v in (context_id, pass_id, message_id)):
        return None
    enc = _Encoder(_GRADIENT, None, None)
    enc.out += _GRADIENT_HEADER.pack(context_id, pass_id, message_id, bool(retain_graph))
    if type(grads) is not list or not enc.value(grads, 0):
        return None
    return bytes(enc.out), enc.storages


def is_compact(payload: bytes) -> bool:
    """Whether ``payload`` is in this encoding (rather than a pickle)."""
    return len(payload) > 0 and payload[0] == MAGIC


#: what turns a received tensor that requires grad into one with a recv node (LoadState.autograd)
_Hook = Callable[[torch.Tensor], torch.Tensor] | None


def _value(
    data: bytes,
    pos: int,
    storages: list[torch.Tensor],
    sizes: list[int],
    memo: list[Any],
    depth: int,
    hook: _Hook = None,
) -> tuple[Any, int]:
    """The value at ``pos`` and the position after it. Reads past the end raise IndexError or
    struct.error (turned into one error by decode)."""
    tag = data[pos]
    if tag == 0x74:  # t
        t, pos = _tensor(data, pos, storages, sizes, hook)
        memo.append(t)
        return t, pos
    if tag == 0x69:  # i
        return _I64.unpack_from(data, pos + 1)[0], pos + 9
    if tag == 0x66:  # f
        return _F64.unpack_from(data, pos + 1)[0], pos + 9
    if tag == 0x4E:  # N
        return None, pos + 1
    if tag == 0x54:  # T
        return True, pos + 1
    if tag == 0x46:  # F
        return False, pos + 1
    if tag == 0x28 or tag == 0x5B:  # ( [
        if depth >= MAX_DEPTH:
            raise _malformed(f"its tuples and lists nest deeper than {MAX_DEPTH} (at byte {pos})")
        (n,) = _U16.unpack_from(data, pos + 1)
        pos += 3
        items = []
        depth += 1
        for _ in range(n):
            item, pos = _value(data, pos, storages, sizes, memo, depth, hook)
            items.append(item)
        value = tuple(items) if tag == 0x28 else items
        memo.append(value)
        return value, pos
    if tag == 0x72:  # r
        (ref,) = _U16.unpack_from(data, pos + 1)
        if ref >= len(memo):
            raise _malformed(
                f"the reference at byte {pos} is to object {ref}, but {len(memo)} came before it"
            )
        return memo[ref], pos + 3
    raise _malformed(f"byte {pos} is not a value tag: {tag:#04x}")


def _tensor(
    data: bytes, at: int, storages: list[torch.Tensor], sizes: list[int], hook: _Hook
) -> tuple[torch.Tensor, int]:
    """A tensor record at ``at``: checked whole before the tensor is made."""
    index, code, ndim, requires_grad, offset = _RECORD.unpack_from(data, at + 1)
    pos = at + 1 + _RECORD.size
    if index >= len(storages):
        raise _malformed(
            f"the tensor at byte {at} names storage {index}, but the message has {len(storages)}"
        )
    if code >= len(_DTYPES):
        raise _malformed(f"the tensor at byte {at} has an unknown dtype code {code}")
    if ndim > _MAX_NDIM or requires_grad > 1:
        raise _malformed(f"the tensor at byte {at} has {ndim} dimensions, requires_grad {requires_grad}")
    dtype = _DTYPES[code]
    nbytes = sizes[index]
    if nbytes < 0:  # not read yet: once per storage
        nbytes = sizes[index] = storage_bytes(storages[index])
    if ndim == 1:
        size, stride = _GEOMETRY_1.unpack_from(data, pos)
        pos += 16
        if size < 0 or stride < 0 or offset < 0:
            raise _malformed(f"the tensor at byte {at} has a negative offset, size or stride")
        # the last element it reaches lies inside its storage (no element: it reaches nothing)
        if size and (offset + (size - 1) * stride + 1) * dtype.itemsize > nbytes:
            raise _out_of_bounds(at, [size], [stride], offset, dtype, nbytes)
        t = empty_of(dtype).set_(storages[index].untyped_storage(), offset, (size,), (stride,))
    elif ndim == 2:  # a matrix: the other common case, without the loops below
        size0, size1, stride0, stride1 = geometry = _GEOMETRY[2].unpack_from(data, pos)
        pos += 32
        if offset < 0 or min(geometry) < 0:
            raise _malformed(f"the tensor at byte {at} has a negative offset, size or stride")
        if (
            size0
            and size1
            and (offset + (size0 - 1) * stride0 + (size1 - 1) * stride1 + 1) * dtype.itemsize > nbytes
        ):
            raise _out_of_bounds(at, [size0, size1], [stride0, stride1], offset, dtype, nbytes)
        t = empty_of(dtype).set_(
            storages[index].untyped_storage(), offset, (size0, size1), (stride0, stride1)
        )
    else:
        geometry = _GEOMETRY[ndim].unpack_from(data, pos)
        pos += 16 * ndim
        sizes_, strides = geometry[:ndim], geometry[ndim:]
        if offset < 0 or min(geometry, default=0) < 0:
            raise _malformed(f"the tensor at byte {at} has a negative offset, size or stride")
        if math.prod(sizes_) and (
            (offset + sum((n - 1) * s for n, s in zip(sizes_, strides, strict=True)) + 1) * dtype.itemsize
            > nbytes
        ):
            raise _out_of_bounds(at, list(sizes_), list(strides), offset, dtype, nbytes)
        t = empty_of(dtype).set_(storages[index].untyped_storage(), offset, sizes_, strides)
    if requires_grad:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise _malformed(f"the tensor at byte {at} is a {dtype} tensor that requires grad")
        if hook is not None:  # inside an autograd envelope: the tensor gets a recv node (DAG-4)
            return hook(t), pos
        t.requires_grad_(True)
    return t, pos


def _out_of_bounds(
    at: int, size: list[int], stride: list[int], offset: int, dtype: torch.dtype, nbytes: int
) -> SerializationError:
    return _malformed(
        f"the tensor at byte {at} (size {size}, stride {stride}, offset {offset}, {dtype}) reaches past "
        f"its storage of {nbytes} bytes"
    )


def _name(data: bytes, pos: int, what: str) -> tuple[str, int]:
    n = data[pos]
    raw = data[pos + 1 : pos + 1 + n]
    if len(raw) < n:
        raise IndexError
    text = raw.decode("ascii", "replace")
    if not text.isidentifier() or not text.isascii():
        raise _malformed(f"its {what} {raw!r} is not an identifier")
    return text, pos + 1 + n


def decode(payload: bytes, state: LoadState, allow: UnpickleAllowlist | None) -> Any:
    """``(op, args, kwargs)`` from a payload made by :func:`encode_call`, or the value from one made by
    :func:`encode_value`, its tensors over ``state.storages``.

    Raises:
        SerializationError: the payload is malformed (what is wrong is named); nothing was run.
        UnpickleRefused: ``allow`` does not allow the operator.
    """
    what = payload[1] if len(payload) > 1 else None
    if what == _ENVELOPE:
        return _decode_envelope(payload, state, allow)
    if what == _VALUE:
        return _decode_value(payload, 2, state)
    if what == _GRADIENT:
        return _decode_gradients(payload, state)
    if what == _REMOTE:
        return _decode_remote_call(payload, state, allow)
    if what != _CALL:
        raise _malformed(
            f"its kind {what} is neither a call ({_CALL}), a value ({_VALUE}), an envelope ({_ENVELOPE}), "
            f"gradients ({_GRADIENT}) nor a remote call ({_REMOTE})"
        )
    return _decode_call(payload, 2, state, allow)


def _decode_call(payload: bytes, start: int, state: LoadState, allow: UnpickleAllowlist | None) -> Any:
    hook = state.autograd
    try:
        name, pos = _name(payload, start, "operator name")
        dotted = f"torch.{name}"
        if allow is not None and not allow.allows_name(dotted):
            raise allow.refused(dotted)  # what the pickle naming it gets (twinrpc._unpickle_allow)
        op = OPERATORS.get(name)
        if op is None:
            raise _malformed(f"{dotted} is not one of torch's builtin operators")
        if payload[pos] != 0x28:
            raise _malformed("its arguments are not a tuple")
        storages = state.storages
        sizes = [-1] * len(storages)
        memo: list[Any] = []
        args, pos = _value(payload, pos, storages, sizes, memo, 0, hook)
        kwargs: dict[str, Any] = {}
        count = payload[pos]
        pos += 1
        for _ in range(count):
            key, pos = _name(payload, pos, "keyword")
            if key in kwargs:
                raise _malformed(f"keyword {key!r} appears twice")
            kwargs[key], pos = _value(payload, pos, storages, sizes, memo, 0, hook)
    except (IndexError, struct.error):
        raise _malformed(f"it ends inside a value ({len(payload)} bytes)") from None
    if pos != len(payload):
        raise _malformed(f"{len(payload) - pos} bytes follow the call")
    return op, args, kwargs


def _decode_value(payload: bytes, start: int, state: LoadState) -> Any:
    storages = state.storages
    try:
        value, pos = _value(payload, start, storages, [-1] * len(storages), [], 0, state.autograd)
    except (IndexError, struct.error):
        raise _malformed(f"it ends inside a value ({len(payload)} bytes)") from None
    if pos != len(payload):
        raise _malformed(f"{len(payload) - pos} bytes follow the value")
    return value


def _decode_remote_call(payload: bytes, state: LoadState, allow: UnpickleAllowlist | None) -> Any:
    """A REMOTE_CALL's body, as the tuple the pickle would give: (rref id, fork id, op, args, kwargs)."""
    start = 2 + _REMOTE_HEADER.size
    if len(payload) <= start:
        raise _malformed(f"it ends inside its remote call's header ({len(payload)} bytes)")
    rref_creator, rref_local, fork_creator, fork_local = _REMOTE_HEADER.unpack_from(payload, 2)
    op, args, kwargs = _decode_call(payload, start, state, allow)
    return (
        GloballyUniqueId(rref_creator, rref_local),
        GloballyUniqueId(fork_creator, fork_local),
        op,
        args,
        kwargs,
    )


def _decode_gradients(payload: bytes, state: LoadState) -> Any:
    """A GRADIENT request's body, as the tuple the pickle would give: (context id, pass id, autograd
    message id, the gradients, retain_graph)."""
    start = 2 + _GRADIENT_HEADER.size
    if len(payload) <= start:
        raise _malformed(f"it ends inside its gradients' header ({len(payload)} bytes)")
    context_id, pass_id, message_id, retain_graph = _GRADIENT_HEADER.unpack_from(payload, 2)
    if retain_graph > 1 or payload[start] != 0x5B:  # [
        raise _malformed(f"its gradients' header is damaged (retain_graph {retain_graph}, then byte {start})")
    return context_id, pass_id, message_id, _decode_value(payload, start, state), bool(retain_graph)


def _decode_envelope(payload: bytes, state: LoadState, allow: UnpickleAllowlist | None) -> Any:
    """An AutogradEnvelope: its header opens it as the unpickler would (the context joins and the
    body's tensors that require grad get recv nodes), then its call (a request) or value (a reply)."""
    header_end = 2 + _ENVELOPE_HEADER.size
    if len(payload) <= header_end:
        raise _malformed(f"it ends inside its autograd envelope's header ({len(payload)} bytes)")
    context_id, message_id, src, response = _ENVELOPE_HEADER.unpack_from(payload, 2)
    inner = payload[header_end]
    if response > 1 or inner != (_VALUE if response else _CALL):
        raise _malformed(
            f"its autograd envelope (response {response}) holds kind {inner}: a request's holds a call "
            f"({_CALL}), a reply's a value ({_VALUE})"
        )
    if context_id < 0 or message_id < 0:
        raise _malformed(f"its autograd envelope names context {context_id}, message {message_id}")
    if open_envelope is None:
        raise SerializationError("an autograd envelope arrived before distributed autograd was loaded")
    env = open_envelope(current_agent().autograd, context_id, message_id, src, bool(response), state)
    start = header_end + 1
    env.body = (
        _decode_value(payload, start, state) if response else _decode_call(payload, start, state, allow)
    )
    return env


def _holds(payload: bytes) -> int | None:
    """What a compact payload holds: a call or a value, in an envelope or not (None: neither)."""
    what = payload[1] if len(payload) > 1 else None
    if what == _ENVELOPE:
        at = 2 + _ENVELOPE_HEADER.size
        return payload[at] if len(payload) > at else None
    return what


def is_call(payload: bytes) -> bool:
    """Whether ``payload`` is a call in this encoding (plain, in an envelope, or a remote call)."""
    return len(payload) > 1 and payload[0] == MAGIC and _holds(payload) in (_CALL, _REMOTE)


#: what a compact payload may hold in a message of each kind; other kinds are always pickled
_HOLDS_BY_KIND = {
    Kind.CALL: _CALL,
    Kind.REMOTE_CALL: _REMOTE,
    Kind.RESPONSE: _VALUE,
    Kind.GRADIENT: _GRADIENT,
}


def check_kind(payload: bytes, kind: Kind) -> None:
    """Raise :class:`~twinrpc._errors.SerializationError` unless a message of ``kind`` may carry this
    compact payload (a CALL a call, a REMOTE_CALL a remote call, a reply a value, a GRADIENT
    gradients): a peer's payload of the wrong kind is refused before anything in it is built."""
    expected = _HOLDS_BY_KIND.get(kind)
    holds = _holds(payload)
    if expected is None or holds != expected:
        names = {_CALL: "a call", _VALUE: "a value", _GRADIENT: "gradients", _REMOTE: "a remote call"}
        held = names.get(holds, f"kind {holds}") if holds is not None else "nothing"
        raise _malformed(
            f"a {kind.name} message cannot hold {held} in this encoding"
            + ("" if expected is None else f" (it holds {names[expected]})")
        )


def is_brief(call: Any) -> bool:
    """Whether a decoded call may run on the thread that received it: a brief operator
    (``BRIEF_OPERATORS``) on at most ``BRIEF_MAX_ELEMENTS`` tensor elements. A call inside an
    autograd envelope never is: it joins a context and records recv nodes."""
    if type(call) is not tuple:
        return False
    if len(call) == 5:  # a remote call: (rref id, fork id, op, args, kwargs)
        call = call[2:]
    op, args, kwargs = call
    if _NAME_OF_ID.get(id(op)) not in BRIEF_OPERATORS:
        return False
    budget = [BRIEF_MAX_ELEMENTS]
    return _within(args, budget) and all(_within(v, budget) for v in kwargs.values())


def _within(v: Any, budget: list[int]) -> bool:
    tp = type(v)
    if tp is torch.Tensor:
        budget[0] -= v.numel()
        return budget[0] >= 0
    if tp is tuple or tp is list:
        return all(_within(item, budget) for item in v)
    return True


def _malformed(what: str) -> SerializationError:
    return SerializationError(f"malformed builtin call payload: {what}")
