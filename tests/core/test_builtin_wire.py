"""The compact encoding of builtin operator calls (src/twinrpc/_builtin_wire.py): what it carries
arrives as the pickle would deliver it, everything else falls back to the pickle, a malformed payload
is refused with an error naming what is wrong, and ``unpickle_allow`` checks the operator by name."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import twinrpc._builtin_wire as wire
import twinrpc._serialize as serialize
from twinrpc._errors import SerializationError
from twinrpc._unpickle_allow import UnpickleAllowlist, UnpickleRefused

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _decode(payload: bytes, storages: list[torch.Tensor], allow: UnpickleAllowlist | None = None) -> Any:
    """What the receiver gets: the storages copied, as on any wire."""
    return serialize.loads(payload, serialize.copy_storages(storages), request=True, allow=allow)[0]


def _encoded(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> tuple[bytes, list[torch.Tensor]]:
    encoded = wire.encode_call(func, args, kwargs or {})
    assert encoded is not None, "expected the compact encoding to apply"
    return encoded


def _both(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The call as the compact encoding and as the pickle deliver it."""
    kwargs = kwargs or {}
    encoded = wire.encode_call(func, args, kwargs)
    assert encoded is not None, "expected the compact encoding to apply"
    assert encoded[0][0] == wire.MAGIC
    # pickled as the agent pickles a builtin call: its Parameters as tensors
    return _decode(*encoded), _decode(*serialize.dumps((func, args, kwargs), link_parameters=True))


def _same(a: Any, b: Any, tensors_a: list[torch.Tensor], tensors_b: list[torch.Tensor]) -> None:
    """``a`` (compact) and ``b`` (pickled) are the same values of the same types."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset()
        assert a.requires_grad == b.requires_grad and a.is_leaf and b.is_leaf
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
        assert torch.equal(a.detach(), b.detach())
        tensors_a.append(a)
        tensors_b.append(b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        if a:  # () is one object in any case
            tensors_a.append(a)  # type: ignore[arg-type]
            tensors_b.append(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):
            _same(x, y, tensors_a, tensors_b)
    elif isinstance(a, float) and a != a:
        assert b != b  # NaN
    else:
        assert a == b


def _check_same_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
    compact, pickled = _both(func, args, kwargs)
    assert compact[0] is pickled[0] is func
    ta: list[torch.Tensor] = []
    tb: list[torch.Tensor] = []
    _same(compact[1], pickled[1], ta, tb)
    _same(list(compact[2].items()), list(pickled[2].items()), ta, tb)
    _same_sharing(ta, tb)


def _same_sharing(ta: list[Any], tb: list[Any]) -> None:
    """Objects that are one object, and storages shared between tensors, are so in both."""
    assert [[x is y for y in ta] for x in ta] == [[x is y for y in tb] for x in tb]
    ta = [x for x in ta if isinstance(x, torch.Tensor)]
    tb = [x for x in tb if isinstance(x, torch.Tensor)]
    share_a = [[x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for y in ta] for x in ta]
    share_b = [[x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for y in tb] for x in tb]
    assert share_a == share_b


# -- round trips ------------------------------------------------------------------------------------
def test_a_tiny_add_round_trips_and_is_smaller_than_its_pickle() -> None:
    a, b = torch.ones(1), torch.ones(1)
    _check_same_call(torch.add, (a, b))
    encoded = wire.encode_call(torch.add, (a, b), {})
    assert encoded is not None
    assert len(encoded[0]) < len(serialize.dumps((torch.add, (a, b), {}))[0])


def test_views_keep_their_geometry_and_share_their_storage() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[1:, ::2]  # offset and strides
    _check_same_call(torch.add, (base, view.t(), base[2]))
    compact = _decode(*_encoded(torch.add, (base, base[1:])))
    x, y = compact[1]
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert y.storage_offset() == 6


def test_a_small_view_of_a_big_storage_travels_compact_as_with_the_pickle() -> None:
    big = torch.zeros(10_000)
    _, storages = _encoded(torch.neg, (big[5:10],))
    assert [s.numel() for s in storages] == [5 * 4]
    _check_same_call(torch.neg, (big[5:10],))


def test_an_object_passed_twice_arrives_as_one_object() -> None:
    t, shared = torch.ones(2), [1, 2]
    _check_same_call(torch.add, (t, t, (shared, shared)), {"out": t})
    call = _decode(*_encoded(torch.add, (t, t), {"out": t}))
    assert call[1][0] is call[1][1] is call[2]["out"]


def test_a_reference_to_an_object_not_yet_decoded_is_refused() -> None:
    payload = bytes((wire.MAGIC, 1, 3)) + b"add" + b"(\x01\x00r\x00\x00\x00"
    with pytest.raises(SerializationError, match="reference at byte 9 is to object 0, but 0 came before it"):
        _decode(payload, [])


def test_expanded_zero_stride_and_empty_tensors_round_trip() -> None:
    _check_same_call(torch.add, (torch.ones(1).expand(3, 4), torch.empty(0, 3), torch.empty(0)))
    _check_same_call(torch.add, (torch.tensor(2.5), torch.tensor(True)))  # zero-dimensional


def test_requires_grad_arrives_as_a_leaf_that_requires_grad() -> None:
    w = torch.ones(3, requires_grad=True)
    _check_same_call(torch.mul, (w * 2, w))  # a non-leaf arrives as a leaf, as pickled
    _check_same_call(torch.mul, (torch.nn.Parameter(torch.ones(2)),))


def test_numbers_bools_none_and_nested_containers_round_trip() -> None:
    t = torch.ones(2, 3)
    _check_same_call(torch.add, (_nested(wire.MAX_DEPTH - 1),))  # the deepest that travels compact
    _check_same_call(torch.sum, (t, (0, 1)), {"keepdim": True})
    _check_same_call(
        torch.add, (t, 1), {"alpha": -(1 << 63), "x": [None, True, False, (1.5, float("inf"), [])], "y": ()}
    )
    _check_same_call(torch.cat, ([t, t, t],), {"dim": 1})


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=4))
    numel = 1
    for n in shape:
        numel *= n
    base = (torch.arange(max(numel, 1) * 2) % 7).to(dtype)[: numel if shape else 1].reshape(shape)
    choice = draw(st.integers(0, 3))
    if choice == 1 and base.dim() >= 2:
        base = base.transpose(0, 1)
    elif choice == 2 and base.dim() >= 1 and base.shape[0] > 1:
        base = base[1:]
    elif choice == 3 and base.dim() >= 1:
        base = base.unsqueeze(0).expand(2, *base.shape)
    if dtype.is_floating_point and draw(st.booleans()):
        base = base.detach().requires_grad_(True)
    return base


_ATOMS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.floats(allow_nan=True),
    _tensors(),
)
_VALUES = st.recursive(
    _ATOMS, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner), max_leaves=12
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(_VALUES, max_size=5),
    st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), _VALUES, max_size=3),
)
def test_any_plain_arguments_arrive_as_the_pickle_delivers_them(
    args: list[Any], kwargs: dict[str, Any]
) -> None:
    _check_same_call(torch.add, tuple(args), kwargs)
    if args:  # the same objects again: they arrive as the same objects, as from the pickle's memo
        _check_same_call(torch.add, (*args, *args, args), {**kwargs, "again": args[0]})


@settings(max_examples=100, deadline=None)
@given(st.lists(_VALUES, max_size=4), st.data())
def test_every_truncation_of_a_payload_is_refused_with_a_clear_error(
    args: list[Any], data: st.DataObject
) -> None:
    payload, storages = _encoded(torch.add, tuple(args), {"k": 1})
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(SerializationError, match="malformed builtin call payload"):
        _decode(payload[:cut] if cut > 0 else bytes((wire.MAGIC,)), storages)


@settings(max_examples=100, deadline=None)
@given(_VALUES)
def test_a_reply_value_arrives_as_the_pickle_delivers_it(value: Any) -> None:
    encoded = wire.encode_value(value)
    assert encoded is not None and encoded[0][:2] == bytes((wire.MAGIC, 2))
    ta: list[torch.Tensor] = []
    tb: list[torch.Tensor] = []
    _same(_decode(*encoded), _decode(*serialize.dumps(value)), ta, tb)
    _same_sharing(ta, tb)


def test_a_reply_of_another_kind_falls_back_and_a_truncated_one_is_refused() -> None:
    assert wire.encode_value(torch.max(torch.ones(2, 2), dim=0)) is None  # a named tuple keeps its type
    assert wire.encode_value({"a": torch.ones(1)}) is None
    encoded = wire.encode_value([torch.ones(2), 3])
    assert encoded is not None
    payload, storages = encoded
    with pytest.raises(SerializationError, match="ends inside a value"):
        _decode(payload[:-1], storages)
    with pytest.raises(SerializationError, match="1 bytes follow the value"):
        _decode(payload + b"N", storages)


# -- fallbacks --------------------------------------------------------------------------------------
def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = (value,)
    return value


def _udf(x: Any) -> Any:
    return x


@pytest.mark.parametrize(
    ("func", "args", "kwargs"),
    [
        (_udf, (torch.ones(1),), {}),  # not a builtin operator
        (torch.nn.functional.relu, (torch.ones(1),), {}),  # a Python function of torch
        (torch.Tensor.add, (torch.ones(1), 1), {}),  # a method
        (torch.add, (torch.ones(1), "x"), {}),  # a string
        (torch.add, (torch.ones(1),), {"not-an-identifier": 1}),  # a keyword only a dict can carry
        (torch.add, (torch.ones(1),), {"é": 1}),  # a keyword outside ASCII
        (torch.add, (torch.ones(1),), {"out": {"a": 1}}),  # a dict
        (torch.sum, (torch.ones(2),), {"dtype": torch.float64}),  # a dtype
        (torch.zeros, (torch.Size([2]),), {}),  # a torch.Size
        (torch.add, (torch.ones(1), 1 << 63), {}),  # beyond int64
        (torch.add, (torch.ones(1), 1 + 2j), {}),  # a complex number
        (torch.add, (torch.ones(2).to_sparse(), 1), {}),  # a sparse tensor
        (torch.add, (torch.ones(2).to(torch.float8_e4m3fn),), {}),  # a dtype outside the table
        (torch.add, (torch.ones(2, dtype=torch.complex64).conj(),), {}),  # a lazy conjugate view
        (torch.add, (_nested(wire.MAX_DEPTH),), {}),  # tuples nested too deep
    ],
)
def test_anything_else_falls_back_to_the_pickle(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    assert wire.encode_call(func, args, kwargs) is None


def test_an_unhashable_callable_falls_back() -> None:
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self) -> None:
            pass

    assert wire.encode_call(Unhashable(), (), {}) is None


def test_a_tensor_subclass_falls_back() -> None:
    class Sub(torch.Tensor):
        pass

    assert wire.encode_call(torch.add, (torch.ones(1).as_subclass(Sub),), {}) is None


# -- malformed input --------------------------------------------------------------------------------
def _good() -> tuple[bytes, list[torch.Tensor]]:
    return _encoded(torch.add, (torch.ones(4), 2), {"alpha": 3})


def _patched(payload: bytes, at: int, new: bytes) -> bytes:
    return payload[:at] + new + payload[at + len(new) :]


ARGS_AT = 2 + 1 + len("add")  # the tuple of positional arguments
TENSOR_AT = ARGS_AT + 3  # its first item


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda p: _patched(p, 1, b"\x09"),
            r"kind 9 is neither a call \(1\), a value \(2\), an envelope \(3\), gradients \(4\) nor a remote call \(5\)",
        ),
        (lambda p: p + b"\x00", "1 bytes follow the call"),
        (lambda p: _patched(p, 2, b"\x03ad!"), "operator name b'ad!' is not an identifier"),
        (lambda p: _patched(p, 2, b"\x03abc"), "torch.abc is not one of torch's builtin operators"),
        (lambda p: _patched(p, ARGS_AT, b"["), "arguments are not a tuple"),
        (lambda p: _patched(p, TENSOR_AT, b"?"), r"byte \d+ is not a value tag: 0x3f"),
        (
            lambda p: _patched(p, TENSOR_AT + 1, struct.pack("<H", 5)),
            "names storage 5, but the message has 1",
        ),
        (lambda p: _patched(p, TENSOR_AT + 3, b"\x63"), "unknown dtype code 99"),
        (lambda p: _patched(p, TENSOR_AT + 4, b"\x63"), "99 dimensions"),
        (lambda p: _patched(p, TENSOR_AT + 5, b"\x02"), "requires_grad 2"),
        (lambda p: _patched(p, TENSOR_AT + 6, struct.pack("<q", -1)), "negative offset, size or stride"),
        (lambda p: _patched(p, TENSOR_AT + 6, struct.pack("<q", 1)), "reaches past its storage of 16 bytes"),
        (lambda p: _patched(p, TENSOR_AT + 14, struct.pack("<q", 5)), "reaches past its storage"),
        (lambda p: _patched(p, TENSOR_AT + 22, struct.pack("<q", 2)), "reaches past its storage"),
        (
            lambda p: p[:-16] + b"\x02\x05alpha" + p[-9:] + b"\x05alpha" + p[-9:],
            "keyword 'alpha' appears twice",
        ),
    ],
)
def test_a_malformed_payload_is_refused_naming_what_is_wrong(mutate: Any, match: str) -> None:
    payload, storages = _good()
    assert _decode(payload, storages)[2] == {"alpha": 3}  # the unmutated one decodes
    with pytest.raises(SerializationError, match=match):
        _decode(mutate(payload), storages)


def test_an_integer_tensor_cannot_arrive_requiring_grad() -> None:
    payload, storages = _encoded(torch.neg, (torch.ones(2, dtype=torch.int64),))
    with pytest.raises(SerializationError, match=r"torch\.int64 tensor that requires grad"):
        _decode(_patched(payload, TENSOR_AT - len("add") + len("neg") + 5, b"\x01"), storages)


def test_nesting_deeper_than_the_limit_is_refused() -> None:
    deep = bytes((wire.MAGIC, 1, 3)) + b"add" + b"(\x01\x00" * (wire.MAX_DEPTH + 2) + b"N"
    with pytest.raises(SerializationError, match="nest deeper than 16"):
        _decode(deep, [])


# -- the allowlist ----------------------------------------------------------------------------------
def _refusal(allow: UnpickleAllowlist, payload: bytes, storages: list[torch.Tensor]) -> str:
    with pytest.raises(UnpickleRefused) as info:
        _decode(payload, storages, allow)
    return str(info.value)


def test_an_allowlist_refuses_an_operator_it_does_not_name_as_it_refuses_the_pickle() -> None:
    args = (torch.ones(2), 1)
    allow = UnpickleAllowlist(["torch.add", "mypkg.*"])
    compact = wire.encode_call(torch.sub, args, {})
    assert compact is not None
    pickled = serialize.dumps((torch.sub, args, {}))
    assert _refusal(allow, *compact) == _refusal(allow, *pickled)
    assert "torch.sub" in _refusal(allow, *compact)


@pytest.mark.parametrize("patterns", [["torch.add"], ["torch.*"], ["torch.a*"]])
def test_an_allowlist_that_names_the_operator_lets_it_through(patterns: list[str]) -> None:
    payload, storages = _encoded(torch.add, (torch.ones(2), 1))
    call = _decode(payload, storages, UnpickleAllowlist(patterns))
    assert call[0] is torch.add


def test_a_bare_torch_module_pattern_does_not_allow_operators_in_either_encoding() -> None:
    allow = UnpickleAllowlist(["torch"])
    args = (torch.ones(2), 1)
    compact = wire.encode_call(torch.add, args, {})
    assert compact is not None
    assert _refusal(allow, *compact) == _refusal(allow, *serialize.dumps((torch.add, args, {})))


# -- brief calls ------------------------------------------------------------------------------------
def test_a_small_call_of_a_brief_operator_is_brief() -> None:
    assert wire.is_brief((torch.add, (torch.ones(1), torch.ones(1)), {}))
    assert wire.is_brief((torch.matmul, (torch.ones(32, 32), torch.ones(32, 64)), {}))


def test_a_big_call_another_operator_or_a_huge_expanded_view_is_not_brief() -> None:
    assert not wire.is_brief((torch.add, (torch.ones(4097), 1), {}))
    assert not wire.is_brief((torch.ones, ((2, 2),), {}))  # allocates what a number says
    assert not wire.is_brief((torch.add, ([torch.ones(3000), torch.ones(3000)],), {}))
    huge = torch.ones(1).expand(1 << 20, 1 << 20)  # one element of storage, 2**40 of tensor
    call = _decode(*_encoded(torch.neg, (huge,)))
    assert call[1][0].shape == huge.shape
    assert not wire.is_brief(call)


def test_every_brief_operator_is_a_builtin_operator() -> None:
    assert set(wire.OPERATORS) >= wire.BRIEF_OPERATORS


@pytest.mark.parametrize("name", ["mm", "spmm", "dsmm"])
def test_operators_equal_to_one_another_each_travel_under_their_own_name(name: str) -> None:
    op = getattr(torch, name)
    call = _decode(*_encoded(op, (torch.ones(1, 1), torch.ones(1, 1))))
    assert call[0] is op
    assert wire.operator_name(op) == name == op.__reduce_ex__(5)[1][1]


# -- the simulator runs the same encoder ------------------------------------------------------------
def _sim_add(rank: int) -> Any:
    import twinrpc.rpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    value = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), torch.ones(2))) if rank == 0 else None
    rpc.shutdown()
    return value


def test_the_simulator_sends_a_builtin_call_in_the_compact_encoding_as_the_gloo_world_does() -> None:
    from twinrpc.simulator import Simulation

    result = Simulation(world_size=2, seed=0).run(_sim_add)
    assert torch.equal(result.values()[0], torch.full((2,), 2.0))
    sent = [ev.message for ev in result.trace.events() if ev.event == "send" and ev.message is not None]
    calls = [m for m in sent if m.kind == "CALL"]
    encoded = wire.encode_call(torch.add, (torch.ones(2), torch.ones(2)), {})
    assert encoded is not None
    payload, storages = encoded
    assert [m.nbytes for m in calls] == [len(payload) + sum(s.numel() * s.element_size() for s in storages)]
    pickled, _ = serialize.dumps((torch.add, (torch.ones(2), torch.ones(2)), {}))
    assert len(payload) < len(pickled)


# -- distributed autograd: gradients and envelopes ---------------------------------------------------
def _sim_matmul_in_a_context(rank: int) -> Any:
    import twinrpc.autograd as dist_autograd
    import twinrpc.rpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    got = None
    if rank == 0:
        a = torch.arange(4.0).reshape(2, 2).requires_grad_()
        b = torch.full((2, 2), 0.5, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpc.rpc_sync("worker1", torch.matmul, args=(a, b))
            dist_autograd.backward(context_id, [y.sum()])
            grads = dist_autograd.get_gradients(context_id)
            got = (y.detach(), grads[a], grads[b])
    rpc.shutdown()
    return got


def test_a_builtin_call_in_a_context_and_its_gradients_travel_compact_and_give_local_autograds_grads() -> (
    None
):
    from twinrpc.simulator import Simulation

    result = Simulation(world_size=2, seed=0).run(_sim_matmul_in_a_context)
    y, grad_a, grad_b = result.values()[0]
    a = torch.arange(4.0).reshape(2, 2).requires_grad_()
    b = torch.full((2, 2), 0.5, requires_grad=True)
    local = a @ b
    local.sum().backward()
    assert torch.equal(y, local.detach()) and torch.equal(grad_a, a.grad) and torch.equal(grad_b, b.grad)
    sent = [ev.message for ev in result.trace.events() if ev.event == "send" and ev.message is not None]
    call = next(m for m in sent if m.kind == "CALL")
    envelope = wire.encode_call(
        torch.matmul, (a, b), {}, envelope=(0, 0, 0, False), grads=[]
    )  # the ids are fixed-width: the size is the size of any envelope of this call
    assert envelope is not None
    assert call.nbytes == len(envelope[0]) + sum(s.numel() for s in envelope[1])
    gradients = [m for m in sent if m.kind == "GRADIENT"]
    assert len(gradients) == 2  # worker0 -> worker1 (y's), worker1 -> worker0 (a's and b's)
    encoded = wire.encode_gradients(0, 0, 0, [torch.ones(2, 2), torch.ones(2, 2)], False)
    assert encoded is not None
    assert gradients[1].nbytes == len(encoded[0]) + sum(s.numel() for s in encoded[1])


def test_an_envelope_records_the_undetached_tensors_that_require_grad() -> None:
    a = torch.ones(3, requires_grad=True)
    view = a[:2]
    grads: list[torch.Tensor] = []
    assert wire.encode_call(torch.add, (view, torch.ones(2)), {}, envelope=(5, 6, 1, False), grads=grads)
    assert len(grads) == 1 and grads[0] is view  # its graph edge, not a detached copy


def test_gradients_arrive_as_the_pickled_body_does() -> None:
    grads = [torch.arange(6.0).reshape(2, 3).t(), torch.ones(4)]
    body = ((3 << 48) + 1, 9, (1 << 48) + 4, grads, True)
    encoded = wire.encode_gradients(*body)
    assert encoded is not None
    got = _decode(*encoded)
    expected = _decode(*serialize.dumps(body))
    assert got[:3] == expected[:3] == body[:3] and got[4] is expected[4] is True
    assert type(got[3]) is list and len(got[3]) == 2
    for g, e in zip(got[3], expected[3], strict=True):
        assert torch.equal(g, e) and g.stride() == e.stride()


def test_a_sparse_gradient_falls_back_to_the_pickle() -> None:
    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (3,), check_invariants=True)
    assert wire.encode_gradients(1, 2, 3, [sparse], False) is None


def _gradients() -> tuple[bytes, list[torch.Tensor]]:
    encoded = wire.encode_gradients(1, 2, 3, [torch.ones(2)], False)
    assert encoded is not None
    return encoded


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda p: p[:20], r"ends inside its gradients' header \(20 bytes\)"),
        (lambda p: _patched(p, 2 + 24, b"\x02"), "retain_graph 2"),
        (lambda p: _patched(p, 2 + 25, b"("), "gradients' header is damaged"),
        (lambda p: p[:-3], "ends inside a value"),
    ],
)
def test_malformed_gradients_are_refused_naming_what_is_wrong(mutate: Any, match: str) -> None:
    payload, storages = _gradients()
    assert _decode(payload, storages)[:3] == (1, 2, 3)
    with pytest.raises(SerializationError, match=match):
        _decode(mutate(payload), storages)


def test_a_malformed_envelope_is_refused_before_it_joins_a_context() -> None:
    payload, storages = wire.encode_call(torch.neg, (torch.ones(1),), {}, envelope=(1, 2, 0, False)) or (
        b"",
        [],
    )
    header = 2 + 19  # the header, then what the envelope holds
    with pytest.raises(SerializationError, match="ends inside its autograd envelope's header"):
        _decode(payload[:header], storages)
    with pytest.raises(SerializationError, match=r"response 1\) holds kind 1"):
        _decode(_patched(payload, header - 1, b"\x01"), storages)
    with pytest.raises(SerializationError, match="names context -1"):
        _decode(_patched(payload, 2, struct.pack("<q", -1)), storages)


@pytest.mark.parametrize(
    ("kind", "payload", "match"),
    [
        ("CALL", lambda: wire.encode_value(torch.ones(1)), "a CALL message cannot hold a value"),
        ("GRADIENT", lambda: _good(), "a GRADIENT message cannot hold a call"),
        ("RESPONSE", lambda: _gradients(), "a RESPONSE message cannot hold gradients"),
        (
            "REMOTE_CALL",
            lambda: _good(),
            r"a REMOTE_CALL message cannot hold a call in this encoding \(it holds a remote call\)",
        ),
        ("RREF_FETCH", lambda: _good(), "a RREF_FETCH message cannot hold a call in this encoding$"),
    ],
)
def test_a_compact_payload_of_the_wrong_kind_for_its_message_is_refused(
    kind: str, payload: Any, match: str
) -> None:
    from twinrpc._message import Kind

    data, storages = payload()
    with pytest.raises(SerializationError, match=match):
        serialize.loads(data, storages, request=True, kind=Kind[kind])


# -- rpc.remote of a builtin --------------------------------------------------------------------------
def test_a_remote_call_arrives_as_the_pickled_one_does() -> None:
    from twinrpc._rref import GloballyUniqueId

    t = torch.arange(6.0).reshape(2, 3)
    body = (GloballyUniqueId(0, 4), GloballyUniqueId(0, 5), torch.add, (t, t[:, :1]), {"alpha": 2})
    encoded = wire.encode_remote_call(*body)
    assert encoded is not None and wire.is_call(encoded[0])
    got = _decode(*encoded)
    expected = _decode(*serialize.dumps(body, link_parameters=True))
    assert got[:3] == expected[:3] == body[:3] and got[4] == expected[4] == {"alpha": 2}
    _same(got[3], expected[3], [], [])


def test_a_remote_call_of_anything_else_falls_back() -> None:
    from twinrpc._rref import GloballyUniqueId

    ids = (GloballyUniqueId(0, 1), GloballyUniqueId(0, 2))
    assert wire.encode_remote_call(*ids, _udf, (1,), {}) is None
    assert wire.encode_remote_call(*ids, torch.add, (object(),), {}) is None
    assert (
        wire.encode_remote_call(GloballyUniqueId(70000, 1), ids[1], torch.neg, (torch.ones(1),), {}) is None
    )


def _sim_remote_add(rank: int) -> Any:
    import twinrpc.rpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    value = None
    if rank == 0:
        value = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1)).to_here()
    rpc.shutdown()
    return value


def test_the_simulator_sends_remote_of_a_builtin_in_the_compact_encoding() -> None:
    from twinrpc.simulator import Simulation

    result = Simulation(world_size=2, seed=0).run(_sim_remote_add)
    assert torch.equal(result.values()[0], torch.full((2,), 2.0))
    sent = [ev.message for ev in result.trace.events() if ev.event == "send" and ev.message is not None]
    remote = next(m for m in sent if m.kind == "REMOTE_CALL")
    from twinrpc._rref import GloballyUniqueId

    encoded = wire.encode_remote_call(
        GloballyUniqueId(0, 0), GloballyUniqueId(0, 1), torch.add, (torch.ones(2), 1), {}
    )
    assert encoded is not None
    assert remote.nbytes == len(encoded[0]) + sum(s.numel() for s in encoded[1])


def test_a_remote_call_cut_inside_its_header_is_refused() -> None:
    from twinrpc._rref import GloballyUniqueId

    payload, storages = wire.encode_remote_call(
        GloballyUniqueId(0, 1), GloballyUniqueId(0, 2), torch.neg, (torch.ones(1),), {}
    ) or (b"", [])
    with pytest.raises(SerializationError, match="ends inside its remote call's header"):
        _decode(payload[:12], storages)
    with pytest.raises(SerializationError, match="ends inside a value"):
        _decode(payload[:-3], storages)
