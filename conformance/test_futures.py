"""``Future`` semantics (``ctx.futures``): wait/value/done, then/add_done_callback, set_result/set_exception,
wait_all and collect_all, on futures returned by rpc_async and on futures a program creates itself; the
futures RPC returns are ``torch.futures.Future``s that upstream ``torch.futures.collect_all``/``wait_all``
take; callbacks that make RPCs themselves, back to the peer whose reply ran them.

Futures are created and completed inside worker programs; the test bodies assert on plain data.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ._support import slow_echo

# ---------------------------------------------------------------- UDFs


def _add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _raise_value_error(tag: str) -> None:
    raise ValueError(f"remote failure {tag}")


def _echo(x: Any) -> Any:
    return x


def _outcome(call: Any) -> tuple[str, str]:
    try:
        value = call()
    except Exception as e:
        return type(e).__name__, str(e)
    return "ok", repr(value)


def _outcome_mro(call: Any) -> tuple[list[str], str]:
    """Like _outcome, with every class name of the error, so tests check what ``except X`` would catch."""
    try:
        value = call()
    except Exception as e:
        return [c.__name__ for c in type(e).__mro__], str(e)
    return ["ok"], repr(value)


# ---------------------------------------------------------------- programs


def _prog_wait_value_done(ctx: Any) -> tuple[list[float], list[float], list[float], bool]:
    fut = ctx.rpc.rpc_async("worker1", _add_one, args=(torch.zeros(2),))
    first = fut.wait().tolist()
    return first, fut.wait().tolist(), fut.value().tolist(), fut.done()


def _prog_wait_reraises(ctx: Any) -> tuple[list[tuple[str, bool]], bool, bool]:
    fut = ctx.rpc.rpc_async("worker1", _raise_value_error, args=("x1",))
    attempts = [_outcome(fut.wait), _outcome(fut.wait), _outcome(fut.value)]
    summary = [(kind, "remote failure x1" in msg) for kind, msg in attempts]
    same_message = attempts[0][1] == attempts[1][1]
    return summary, same_message, fut.done()


def _prog_then_chain(ctx: Any) -> tuple[list[float], list[tuple[bool, bool]]]:
    fut = ctx.rpc.rpc_async("worker1", _add_one, args=(torch.ones(1),))
    seen: list[tuple[bool, bool]] = []

    def cb(f: Any) -> Any:
        seen.append((f is fut, f.done()))
        return f.wait() + 1

    chained = fut.then(cb).then(lambda f: f.wait() * 10)
    return chained.wait().tolist(), seen


def _prog_then_on_local_future(ctx: Any) -> tuple[list[Any], list[Any], int, bool]:
    fut = ctx.futures.Future()
    calls: list[Any] = []
    chained = fut.then(lambda f: (calls.append(f is fut), f.wait() * 2)[1])
    before = [fut.done(), chained.done(), list(calls)]
    fut.set_result(21)
    after = [fut.done(), chained.done(), list(calls)]
    return before, after, chained.wait(), fut.wait() == 21


def _prog_add_done_callback(ctx: Any) -> tuple[list[Any], list[Any]]:
    fut = ctx.futures.Future()
    events: list[Any] = []
    fut.add_done_callback(lambda f: events.append(("first", f is fut, f.value())))
    fut.add_done_callback(lambda f: events.append(("second", f.wait())))
    before = list(events)
    fut.set_result("v")
    fut.add_done_callback(lambda f: events.append(("late", f.value())))
    return before, events


def _prog_add_done_callback_on_rpc(ctx: Any) -> list[Any]:
    fut = ctx.rpc.rpc_async("worker1", _echo, args=("payload",))
    # wait() may return before callbacks ran (they run on the completing thread), so the callback
    # reports through a second future instead of a list read after fut.wait().
    seen = ctx.futures.Future()
    fut.add_done_callback(lambda f: seen.set_result([f is fut, f.done(), f.value()]))
    return seen.wait()


def _prog_set_exception(ctx: Any) -> tuple[bool, list[tuple[str, str]]]:
    fut = ctx.futures.Future()
    fut.set_exception(KeyError("missing"))
    return fut.done(), [_outcome(fut.wait), _outcome(fut.wait), _outcome(fut.value)]


def _prog_complete_twice(ctx: Any) -> list[tuple[str, str]]:
    a = ctx.futures.Future()
    a.set_result(1)
    b = ctx.futures.Future()
    b.set_exception(ValueError("first"))
    # (torch corrupts ``a`` when set_exception fails on it, so ``a.wait()`` is read before that)
    return [
        _outcome(lambda: a.set_result(2)),
        _outcome(lambda: b.set_result(3)),
        _outcome(a.wait),
        _outcome(lambda: a.set_exception(ValueError("late"))),
    ]


def _prog_then_callback_raises(ctx: Any) -> tuple[tuple[list[str], str], tuple[list[str], str]]:
    local = ctx.futures.Future()
    chained_local = local.then(lambda f: 1 / 0)
    local.set_result(1)
    remote = ctx.rpc.rpc_async("worker1", _echo, args=(1,))
    chained_remote = remote.then(lambda f: {}["no such key"])
    return _outcome_mro(chained_local.wait), _outcome_mro(chained_remote.wait)


def _prog_then_sees_error(ctx: Any) -> tuple[str, tuple[list[str], str]]:
    failed = ctx.rpc.rpc_async("worker1", _raise_value_error, args=("x2",))

    def recover(f: Any) -> str:
        try:
            f.wait()
        except ValueError as e:
            return f"recovered: {'remote failure x2' in str(e)}"
        return "no error"

    recovered = failed.then(recover).wait()
    propagated = _outcome_mro(failed.then(lambda f: f.wait()).wait)
    return recovered, propagated


def _prog_wait_all(ctx: Any) -> list[Any]:
    futs = [ctx.rpc.rpc_async(ctx.name(i % 2), _echo, args=(i,)) for i in range(6)]
    local = ctx.futures.Future()
    local.set_result("local")
    return ctx.futures.wait_all([*futs, local])


def _prog_wait_all_fails_early(ctx: Any, combinator: str) -> tuple[tuple[str, str], bool]:
    never = ctx.futures.Future()  # completed only after wait_all returned
    failing = ctx.rpc.rpc_async("worker1", _raise_value_error, args=("x3",))
    if combinator == "wait_all":
        outcome = _outcome(lambda: ctx.futures.wait_all([never, failing]))
    else:
        outcome = _outcome(lambda: ctx.futures.collect_all([never, failing]).wait())
    still_pending = not never.done()
    never.set_result(None)
    return outcome, still_pending


def _prog_collect_all(ctx: Any) -> tuple[bool, list[bool], list[Any]]:
    futs = [ctx.rpc.rpc_async("worker1", _echo, args=(i,)) for i in range(4)]
    local = ctx.futures.Future()
    combined = ctx.futures.collect_all([*futs, local])
    pending_while_local_open = not combined.done()
    local.set_result("last")
    results = combined.wait()
    return (
        pending_while_local_open,
        [f.done() for f in results],
        [f.wait() for f in results],
    )


def _prog_torch_futures_take_rpc_futures(ctx: Any) -> tuple[list[bool], bool, list[Any], list[Any]]:
    # torch.futures itself, not ctx.futures: programs written against PyTorch call it directly
    rref = ctx.rpc.remote("worker1", _add_one, args=(torch.zeros(2),))
    futs = [
        ctx.rpc.rpc_async("worker1", _echo, args=("a",)),
        ctx.rpc.rpc_async("worker0", _echo, args=("self",)),
        ctx.rpc.rpc_async("worker1", _echo, args=(3,)).then(lambda f: f.wait() * 2),
        rref.rpc_async().size(),
        rref._get_future().then(lambda f: "created"),
    ]
    # torch.Future (torch._C.Future) is what torch.futures' functions take; PyTorch's RPC futures are
    # instances of it but not of its Python subclass torch.futures.Future (twinrpc's are of both)
    kinds = [isinstance(f, torch.Future) for f in [*futs, rref._get_future()]]
    collected = torch.futures.collect_all(futs)
    values = [f.wait() for f in collected.wait()]
    waited = torch.futures.wait_all(futs)
    values[3], waited[3] = list(values[3]), list(waited[3])
    return kinds, isinstance(collected, torch.Future), values, waited


def _prog_torch_wait_all_fails_early(ctx: Any, combinator: str) -> tuple[list[str], str, bool]:
    slow = ctx.rpc.rpc_async("worker1", slow_echo, args=(ctx.backend, 3.0, "late"))
    failing = ctx.rpc.rpc_async("worker1", _raise_value_error, args=("x4",))
    try:
        if combinator == "wait_all":
            torch.futures.wait_all([slow, failing])
        else:
            torch.futures.collect_all([slow, failing]).wait()
    except Exception as e:
        kinds, message = [c.__name__ for c in type(e).__mro__], str(e)
    else:
        kinds, message = ["no error"], ""
    still_pending = not slow.done()
    slow.wait()
    return kinds, message, still_pending


def _prog_then_callback_rpc_syncs_back(ctx: Any) -> tuple[list[Any], list[Any]]:
    def callback(f: Any) -> list[Any]:
        # blocking calls to the peer whose reply is running this callback
        first = ctx.rpc.rpc_sync("worker1", _echo, args=(f.wait() + 1,))
        second = ctx.rpc.rpc_async("worker1", _echo, args=(first + 1,)).wait()
        return [f.wait(), first, second]

    chained = ctx.rpc.rpc_async("worker1", _echo, args=(1,)).then(callback)
    # a chain of them, on a remote future and on a local one
    local = ctx.futures.Future()
    nested = local.then(callback).then(lambda f: ctx.rpc.rpc_sync("worker1", _echo, args=(f.wait(),)))
    local.set_result(10)
    return chained.wait(), nested.wait()


def _prog_add_done_callback_rpc_syncs_back(ctx: Any) -> list[Any]:
    out = ctx.futures.Future()

    def callback(f: Any) -> None:
        try:
            out.set_result([f.value(), ctx.rpc.rpc_sync("worker1", _echo, args=(f.value() * 2,))])
        except Exception as e:
            out.set_exception(e)

    ctx.rpc.rpc_async("worker1", _echo, args=(21,)).add_done_callback(callback)
    return out.wait()


def _prog_callback_blocked_does_not_hold_later_replies(ctx: Any) -> list[Any]:
    gate = ctx.futures.Future()  # opened only after another call to the same peer returned
    out = ctx.futures.Future()

    def callback(f: Any) -> None:
        gate.wait()
        out.set_result(f.value())

    fut = ctx.rpc.rpc_async("worker1", slow_echo, args=(ctx.backend, 0.2, "first"))
    fut.add_done_callback(callback)
    fut.wait()
    second = ctx.rpc.rpc_sync("worker1", _echo, args=("second",))  # its reply: same peer, after
    gate.set_result(None)
    return [second, out.wait()]


def _prog_callback_not_callable(ctx: Any) -> list[tuple[str, bool]]:
    local = ctx.futures.Future()
    remote = ctx.rpc.rpc_async("worker1", _echo, args=(1,))
    remote.wait()
    results = []
    for fut in (local, remote):
        for method, arg in (("then", None), ("add_done_callback", None), ("then", 3)):
            kind, message = _outcome(lambda: getattr(fut, method)(arg))  # noqa: B023 (called at once)
            results.append((kind, "incompatible function arguments" in message))
    local.set_result(None)  # nothing was registered: completing runs nothing
    return results


# ---------------------------------------------------------------- tests


@pytest.mark.spec("RPC-17")
def test_wait_and_value_return_result_and_done_is_true_after(world: Any) -> None:
    assert world.run_on(0, _prog_wait_value_done) == ([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], True)


@pytest.mark.spec("RPC-13", "RPC-17")
def test_wait_reraises_remote_error_with_same_type_on_every_call(world: Any) -> None:
    summary, same_message, done = world.run_on(0, _prog_wait_reraises)
    assert summary == [("ValueError", True)] * 3
    assert same_message is True
    assert done is True


@pytest.mark.spec("RPC-17")
def test_then_callback_receives_the_completed_future_and_chains(world: Any) -> None:
    value, seen = world.run_on(0, _prog_then_chain)
    assert value == [30.0]
    assert seen == [(True, True)]


@pytest.mark.spec("RPC-17")
def test_then_on_local_future_runs_only_when_result_is_set(world: Any) -> None:
    before, after, chained_value, ok = world.run_on(0, _prog_then_on_local_future)
    assert before == [False, False, []]
    assert after == [True, True, [True]]
    assert (chained_value, ok) == (42, True)


@pytest.mark.spec("RPC-17")
def test_add_done_callback_runs_on_completion_and_immediately_when_already_done(world: Any) -> None:
    before, events = world.run_on(0, _prog_add_done_callback)
    assert before == []
    assert events == [("first", True, "v"), ("second", "v"), ("late", "v")]


@pytest.mark.spec("RPC-17")
def test_add_done_callback_on_rpc_future_sees_the_result(world: Any) -> None:
    assert world.run_on(0, _prog_add_done_callback_on_rpc) == [True, True, "payload"]


@pytest.mark.spec("RPC-13", "RPC-17")
def test_set_exception_makes_wait_and_value_raise_it_every_time(world: Any) -> None:
    done, outcomes = world.run_on(0, _prog_set_exception)
    assert done is True
    assert outcomes == [("KeyError", "'missing'")] * 3


@pytest.mark.spec("RPC-17")
def test_completing_a_future_twice_raises_runtime_error_and_keeps_first_result(world: Any) -> None:
    again, exc_after_exc, kept, exc_after_result = world.run_on(0, _prog_complete_twice)
    errors = [again, exc_after_exc, exc_after_result]
    assert [kind for kind, _ in errors] == ["RuntimeError"] * 3
    assert all("completed" in msg for _, msg in errors), errors
    assert kept == ("ok", "1")


@pytest.mark.spec("RPC-17")
def test_exception_in_then_callback_fails_chained_future_with_runtime_error(world: Any) -> None:
    local, remote = world.run_on(0, _prog_then_callback_raises)
    assert "RuntimeError" in local[0] and "division by zero" in local[1], local
    assert "RuntimeError" in remote[0] and "no such key" in remote[1], remote


@pytest.mark.spec("RPC-13", "RPC-17")
def test_then_callback_sees_remote_error_and_can_recover_or_propagate(world: Any) -> None:
    recovered, propagated = world.run_on(0, _prog_then_sees_error)
    assert recovered == "recovered: True"
    assert "RuntimeError" in propagated[0] and "remote failure x2" in propagated[1], propagated


@pytest.mark.spec("RPC-17")
def test_wait_all_returns_values_in_argument_order(world: Any) -> None:
    assert world.run_on(0, _prog_wait_all) == [0, 1, 2, 3, 4, 5, "local"]


@pytest.mark.spec("RPC-13", "RPC-17")
@pytest.mark.parametrize("combinator", ["wait_all", "collect_all"])
def test_combinator_raises_first_error_without_waiting_for_pending_futures(
    world: Any, combinator: str
) -> None:
    (kind, msg), still_pending = world.run_on(0, _prog_wait_all_fails_early, combinator)
    assert kind == "ValueError"
    assert "remote failure x3" in msg
    assert still_pending is True


@pytest.mark.spec("RPC-17")
def test_collect_all_completes_after_all_with_list_of_completed_futures(world: Any) -> None:
    pending, done, values = world.run_on(0, _prog_collect_all)
    assert pending is True
    assert done == [True] * 5
    assert values == [0, 1, 2, 3, "last"]


def _prog_wait_all_context(ctx: Any) -> tuple[bool, list[Any]]:
    with ctx.rpc.api._wait_all():
        futs = [ctx.rpc.rpc_async("worker1", _echo, args=(i,)) for i in range(3)]
    return all(f.done() for f in futs), [f.wait() for f in futs]


@pytest.mark.spec("RPC-13", "RPC-17")
def test_private_wait_all_context_waits_for_every_rpc_async_issued_inside(world: Any) -> None:
    done, values = world.run_on(0, _prog_wait_all_context)
    assert done is True
    assert values == [0, 1, 2]


@pytest.mark.spec("RPC-17")
def test_rpc_futures_are_torch_futures_that_torch_collect_all_and_wait_all_take_in_order(world: Any) -> None:
    kinds, combined_is_future, values, waited = world.run_on(0, _prog_torch_futures_take_rpc_futures)
    assert kinds == [True] * 6
    assert combined_is_future is True
    assert values == waited == ["a", "self", 6, [2], "created"]


@pytest.mark.spec("RPC-13", "RPC-17")
@pytest.mark.parametrize("combinator", ["wait_all", "collect_all"])
def test_torch_combinators_raise_the_remote_error_type_without_waiting_for_the_rest(
    world: Any, combinator: str
) -> None:
    kinds, message, still_pending = world.run_on(0, _prog_torch_wait_all_fails_early, combinator)
    assert kinds[0] == "ValueError", kinds
    assert "remote failure x4" in message
    assert still_pending is True


@pytest.mark.spec("RPC-17")
def test_then_callback_can_rpc_sync_to_the_peer_whose_reply_ran_it(world: Any) -> None:
    chained, nested = world.run_on(0, _prog_then_callback_rpc_syncs_back)
    assert chained == [1, 2, 3]
    assert nested == [10, 11, 12]


@pytest.mark.spec("RPC-17")
def test_add_done_callback_can_rpc_sync_to_the_peer_whose_reply_ran_it(world: Any) -> None:
    assert world.run_on(0, _prog_add_done_callback_rpc_syncs_back) == [21, 42]


@pytest.mark.spec("RPC-17")
def test_a_blocked_callback_does_not_hold_up_later_replies_from_the_same_peer(world: Any) -> None:
    assert world.run_on(0, _prog_callback_blocked_does_not_hold_later_replies) == ["second", "first"]


@pytest.mark.spec("RPC-17")
def test_then_and_add_done_callback_reject_a_non_callable_at_once_with_type_error(world: Any) -> None:
    assert world.run_on(0, _prog_callback_not_callable) == [("TypeError", True)] * 6
