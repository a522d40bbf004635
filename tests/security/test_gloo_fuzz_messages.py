"""Fuzzing the message decoders of a live gloo world: valid frames whose payloads are mutated.

Three worker processes: worker0 (the bad peer) runs hypothesis, worker1 (the receiver, started with an
``unpickle_allow`` allowlist) takes the calls, worker2 is a healthy peer. Each example takes a real
request payload (a builtin operator call in twinrpc._builtin_wire's compact encoding, plain or in a
distributed autograd envelope, a pickle of ``(func, args, kwargs)`` as twinrpc._serialize makes it,
with tensors, views and keyword arguments, or a GRADIENT request's body in its compact encoding),
mutates it (bytes overwritten, inserted or deleted, the payload cut short, a storage dropped, cut or
added) and sends it as a request of its kind through worker0's ordinary link, so the frames are valid
and only the message decoders see the damage. Then:

* the call ends within its timeout, never by it: the receiver answers every request, with the result
  of whatever the damaged payload still decodes to, or with an error; an error that says the request
  could not be decoded names worker0;
* worker1 is alive and still calls worker2, and has no thread more than before but the outbox each
  link starts on first use (its request pool keeps the threads it started, within its bound).

Then the other way: worker1 calls worker0, which damages its replies the same way (a builtin call's
result in the compact encoding, pickled values, an exception), and the same holds; an error saying the
reply could not be decoded names worker0.

Out of scope: a damaged pickle that stores into its memo at an index far beyond its own length. CPython's
C unpickler (3.11) then grows its memo array to twice that index and zeroes it, holding the GIL: 9 bytes
storing at 2**30 take 16 GiB and most of a minute, the receiver's heartbeats stop and its peers declare
it dead. Such payloads are not sent here (``_memo_bomb``); PyTorch's RPC unpickles the same way.

tests/security/test_gloo_fuzz.py fuzzes the frames themselves. ``TWINRPC_FUZZ_EXAMPLES`` raises the number of
examples (the default keeps the world to seconds, once started).
"""

from __future__ import annotations

import multiprocessing
import operator
import os
import threading
import traceback
from pathlib import Path
from typing import Any

from _spawn_world import report, run_world
from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("TWINRPC_FUZZ_EXAMPLES", "300"))
#: how every property here is explored: EXAMPLES derandomized examples, no example database
_EXAMPLES = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
#: every wait's bound (a reply that takes longer is a hang: the receiver never answered)
WAIT = 10.0
#: the world's bound, start and shutdown included (an example takes ~20 ms each way on 2 cores)
WORLD_TIMEOUT = 120.0 + 0.2 * EXAMPLES
#: what worker1 may unpickle: the operators the payloads call, and this module (its probe)
ALLOW = ["operator.add", "operator.mul", "torch.add", "torch.mul", "torch.cat", f"{__name__}.*"]
#: worker1's request pool: num_worker_threads (16) plus the receive loops of its two links
POOL_BOUND = 16 + 2 * 2


def probe() -> tuple[int, int, int]:
    """On worker1: its threads outside the request pool, the pool's, and a call to worker2."""
    import twinrpc.rpc as rpc

    pool = sum(1 for t in threading.enumerate() if t.name.startswith("twinrpc-pool"))
    answer = rpc.rpc_sync("worker2", operator.add, args=(40, 2), timeout=WAIT)
    return threading.active_count() - pool, pool, answer


def _replies() -> list[tuple[str, Any]]:
    """Calls worker1 makes to worker0: their replies are what worker0 damages."""
    import torch

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return [
        ("a builtin call's tensor, in the compact encoding", (torch.add, (t, t[:, :1]), {})),
        ("a builtin call's tuple of tensors", (torch.split, (torch.arange(5), 2), {})),
        # made in a distributed autograd context (an argument requires grad): its reply is an envelope
        ("a builtin call's result in an autograd envelope", (torch.mul, (t.requires_grad_(), 2.0), {})),
        ("a pickled int", (operator.add, (1, 2), {})),
        ("a pickled dict of tensors and strings", (named, (t,), {"name": "x"})),
        ("an exception", (operator.truediv, (1, 0), {})),
    ]


def named(t: Any, name: str) -> dict[str, Any]:
    """On worker0: a value that is pickled (a dict: no compact encoding for it)."""
    return {name: t, "rows": t.shape[0]}


def call_back(which: int) -> str:
    """On worker1: make reply case ``which``'s call to worker0; what it ended as."""
    import twinrpc.autograd as dist_autograd
    import twinrpc.rpc as rpc

    func, args, kwargs = _replies()[which][1]
    try:
        if any(getattr(a, "requires_grad", False) for a in args):
            with dist_autograd.context():
                rpc.rpc_sync("worker0", func, args=args, kwargs=kwargs, timeout=WAIT)
        else:
            rpc.rpc_sync("worker0", func, args=args, kwargs=kwargs, timeout=WAIT)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "value"


def _damage(
    payload: bytes, tensors: list[Any], edits: list[tuple[str, int, Any]], storages: str
) -> tuple[bytes, list[Any]]:
    """``payload`` and ``tensors`` with ``edits`` applied and the storages changed as ``storages`` says."""
    import torch

    data = bytearray(payload)
    for what, at, arg in edits:
        at = at % (len(data) + 1)
        if what == "set" and at < len(data):
            data[at] = arg
        elif what == "insert":
            data[at:at] = arg
        elif what == "delete":
            del data[at : at + arg]
        elif what == "cut":
            del data[at:]
    tensors = list(tensors)
    if storages == "drop last" and tensors:
        tensors.pop()
    elif storages == "cut first" and tensors and tensors[0].numel():
        tensors[0] = tensors[0][: tensors[0].numel() - 1]
    elif storages == "add one":
        tensors.append(torch.zeros(8, dtype=torch.uint8))
    return bytes(data), tensors


def _memo_bomb(payload: bytes) -> bool:
    """Whether this pickle stores into its memo at an index beyond its own length (then CPython's C
    unpickler grows its memo array to twice that index and zeroes it: 9 bytes storing at 2**30 take
    16 GiB and most of a minute, holding the GIL). No damage may make one here (see the module
    docstring); the other opcodes are fair game."""
    import pickletools

    if payload[:1] != b"\x80":
        return False  # the compact encoding, not a pickle
    try:
        for op, arg, _ in pickletools.genops(payload):
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int) and arg > len(payload):
                return True
    except Exception:
        pass  # malformed further on: the unpickler stops there too
    return False


def _classify(text: str, what: str) -> str:
    """What a call that raised ``text`` ended as; it must not have timed out, and an error saying
    that ``what`` could not be decoded must name worker0."""
    assert "ran for more than" not in text, f"{what} was never answered: {text}"
    if ("could not" in text and ("unpickle" in text or "decode" in text)) or "malformed" in text:
        assert "worker0" in text, text
        return "refused"
    return "raised"


def _requests() -> list[tuple[str, Any]]:
    """Real request objects: what worker0 would send for these calls (CALLs)."""
    import torch

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    i = torch.arange(6, dtype=torch.int64)
    return [
        ("builtin add of a tensor and its view", (torch.add, (t, t[:, 1:2]), {})),
        ("builtin add with alpha", (torch.add, (i, i.flip(0)), {"alpha": 3})),
        ("builtin mul by a number", (torch.mul, (t.t(), 2.5), {})),
        ("builtin cat of a list", (torch.cat, ([i, i[2:], i[:1]],), {"dim": 0})),
        ("builtin add of shapes that do not broadcast", (torch.add, (t, i), {})),
        ("pickled operator.add of ints", (operator.add, (1, 2), {})),
        ("pickled operator.mul of a tensor", (operator.mul, (t[1], 3), {})),
        ("pickled torch.add of bools and floats", (torch.add, (torch.tensor([True, False]), 0.5), {})),
    ]


def _autograd_requests() -> list[tuple[str, Any, bytes, list[Any]]]:
    """Real distributed autograd requests in the compact encoding: (what, kind, payload, storages). The
    context they name does not exist on worker1: the envelope's call creates it there, as a first
    call in a context does; a gradient for it finds no send function and is answered with the error."""
    import torch

    from twinrpc import _builtin_wire
    from twinrpc._message import Kind

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).requires_grad_()
    envelope = (7, 3, 0, False)  # context 7 of worker0, its autograd message 3
    call = _builtin_wire.encode_call(torch.add, (t, t[:, 1:2]), {}, envelope=envelope, grads=[])
    gradients = _builtin_wire.encode_gradients(7, 9, (1 << 48) + 1, [torch.ones(3, 4), torch.ones(2)], False)
    assert call is not None and gradients is not None
    return [
        ("builtin add in an autograd envelope", Kind.CALL, *call),
        ("a gradient request", Kind.GRADIENT, *gradients),
    ]


def _encode(obj: Any) -> tuple[bytes, list[Any]]:
    """The payload and storages worker0's agent sends for a CALL of ``obj`` (the compact encoding when
    it applies, as RpcAgent.call does in the gloo world, else the pickle)."""
    from twinrpc import _builtin_wire, _serialize

    func, args, kwargs = obj
    encoded = _builtin_wire.encode_call(func, args, kwargs)
    return encoded if encoded is not None else _serialize.dumps(obj)


def _fuzz(shared: dict[str, Any]) -> dict[str, Any]:
    """On worker0: the hypothesis run; returns what the examples ended as, or the failure."""
    from unittest import mock

    from hypothesis import assume, given, note
    from hypothesis import strategies as st

    import twinrpc.rpc as rpc
    from twinrpc import _serialize
    from twinrpc._current import current_agent
    from twinrpc._message import Kind, Message

    agent = current_agent()
    requests = [(what, Kind.CALL, *_encode(obj)) for what, obj in _requests()] + _autograd_requests()
    threads0, _, answer = rpc.rpc_sync("worker1", probe, timeout=WAIT)
    assert answer == 42
    outcomes: dict[str, int] = {}

    edit = st.one_of(
        st.tuples(st.just("set"), st.integers(0, 400), st.integers(0, 255)),
        st.tuples(st.just("insert"), st.integers(0, 400), st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("delete"), st.integers(0, 400), st.integers(1, 8)),
        st.tuples(st.just("cut"), st.integers(0, 400), st.just(0)),
    )
    storage_edit = st.sampled_from(["none", "none", "none", "drop last", "cut first", "add one"])

    @_EXAMPLES
    @given(which=st.integers(0, len(requests) - 1), edits=st.lists(edit, max_size=4), storages=storage_edit)
    def one_request(which: int, edits: list[tuple[str, int, Any]], storages: str) -> None:
        what, kind, payload, tensors = requests[which]
        sent = _damage(payload, tensors, edits, storages)
        assume(not _memo_bomb(sent[0]))
        note(f"{what}: {len(payload)} -> {len(sent[0])} B {sent[0]!r}, storages {storages}")
        with mock.patch.object(_serialize, "dumps", lambda obj, fork=None, grads=None, **_: sent):
            # dumps is patched: any body the compact encoding refuses (a gradient that is not a list)
            body = (None, (), {}) if kind is Kind.CALL else (0, 0, 0, None, False)
            fut = agent.request(1, kind, body, WAIT)
        try:
            fut.wait()
            outcome = "ran"
        except Exception as exc:
            note(f"{type(exc).__name__}: {exc}")
            outcome = _classify(f"{type(exc).__name__}: {exc}", "the damaged request")
        check_worker1()
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    replies = _replies()
    damage: dict[str, Any] = {}
    world = agent.world
    send = world.send

    def send_damaging(msg: Message) -> None:
        """worker0's world.send, test-only: the next reply to worker1 goes out damaged."""
        how = (
            damage.pop("how", None) if msg.kind in (Kind.RESPONSE, Kind.EXCEPTION) and msg.dst == 1 else None
        )
        if how is not None:  # on a pool thread: what it did is noted by the example
            payload, tensors = _damage(msg.payload, msg.tensors, *how)
            if _memo_bomb(payload):
                payload, tensors = msg.payload, msg.tensors  # out of scope (see _memo_bomb)
                damage["bomb"] = True
            damage["did"] = f"reply {msg.kind.name}: {len(msg.payload)} -> {len(payload)} B {payload!r}"
            msg = Message(msg.kind, msg.id, msg.src, msg.dst, payload, tensors)
        send(msg)

    @_EXAMPLES
    @given(which=st.integers(0, len(replies) - 1), edits=st.lists(edit, max_size=4), storages=storage_edit)
    def one_reply(which: int, edits: list[tuple[str, int, Any]], storages: str) -> None:
        damage["how"] = (edits, storages)
        note(replies[which][0])
        text = rpc.rpc_sync("worker1", call_back, args=(which,), timeout=2 * WAIT)
        note(f"{damage.pop('did', 'no reply damaged')}; worker1's call ended with {text}")
        assert "how" not in damage, "worker0 sent no reply to damage"
        assume(not damage.pop("bomb", False))
        outcome = "ran" if text == "value" else _classify(text, "the damaged reply")
        check_worker1()
        reply_outcomes[outcome] = reply_outcomes.get(outcome, 0) + 1

    def check_worker1() -> None:
        threads, pool, answer = rpc.rpc_sync("worker1", probe, timeout=WAIT)
        assert answer == 42
        # each of its two links may start its outbox thread on first use (impl/_sender.py), and only that
        assert threads <= threads0 + 2, f"worker1 has {threads} threads outside its pool, {threads0} at first"
        assert pool <= POOL_BOUND, f"worker1's pool has {pool} threads"

    reply_outcomes: dict[str, int] = {}
    try:
        one_request()
        world.send = send_damaging  # type: ignore[method-assign]
        one_reply()
    except BaseException as exc:
        return {
            "failure": "".join(traceback.format_exception(exc)),
            "outcomes": outcomes,
            "replies": reply_outcomes,
        }
    finally:
        world.send = send  # type: ignore[method-assign]
    return {"failure": None, "outcomes": outcomes, "replies": reply_outcomes}


def _program(rank: int, init_file: str, shared: dict[str, Any]) -> Any:
    import twinrpc.rpc as rpc

    options = rpc.RpcBackendOptions(
        init_method=f"file://{init_file}", unpickle_allow=ALLOW if rank == 1 else None
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    result = _fuzz(shared) if rank == 0 else "served"
    rpc.shutdown(timeout=WORLD_TIMEOUT)  # worker1 and worker2 wait here while worker0 fuzzes
    return result


def _child(rank: int, init_file: str, shared: dict[str, Any]) -> None:
    report(shared, rank, _program, rank, init_file, shared)


def test_damaged_requests_and_replies_in_valid_frames_end_and_the_receiver_keeps_serving(
    tmp_path: Path,
) -> None:
    mp = multiprocessing.get_context("spawn")
    shared: dict[str, Any] = {"results": mp.Queue()}
    init_file = str(tmp_path / "rendezvous")
    got = run_world(mp, _child, [(r, init_file, shared) for r in range(3)], shared, WORLD_TIMEOUT)
    result = got[0]
    assert isinstance(result, dict), result
    print(f"damaged requests by outcome: {result['outcomes']}; damaged replies: {result['replies']}")
    assert result["failure"] is None, result["failure"]
    assert got[1] == got[2] == "served", (got[1], got[2])
    assert set(result["outcomes"]) == {"ran", "refused", "raised"}, result["outcomes"]
    assert set(result["replies"]) == {"ran", "refused", "raised"}, result["replies"]
