"""The builtin fast path in the gloo world (src/twinrpc/_builtin_wire.py, ``World.submit``'s
``brief``): a call of a torch operator on plain arguments travels without pickle and runs on the
thread that received it, and that changes nothing a program sees: results, remote errors,
distributed autograd, timeouts and the request pool's bound are those of the pickled path, and a
malformed payload fails only its call.

One small world (two ``spawn`` processes, wall-clock) serves every check; worker1 has one request
thread and records which of the calls it received were brief (so a check that passes because the fast
path was not taken shows). Every wait is bounded and the processes are killed at the end."""

from __future__ import annotations

import multiprocessing
import os
import queue
import struct
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

WORLD_TIMEOUT = 120.0


def slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def brief_flags() -> list[bool]:
    """worker1: whether each builtin call it received was brief, in order."""
    return list(_BRIEF)


_BRIEF: list[bool] = []


def _outcome(call: Any) -> Any:
    try:
        return ("ok", call())
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))


def _program(rank: int, init_file: str, results: Any) -> None:
    import twinrpc.autograd as dist_autograd
    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent
    from twinrpc._message import Kind

    options = rpc.RpcBackendOptions(init_method=f"file://{init_file}", num_worker_threads=1, rpc_timeout=20)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    agent = current_agent()
    out: dict[str, Any] = {}
    if rank == 1:
        world = agent.world
        submit = world.submit

        def recording_submit(fn: Any, *args: Any, brief: bool = False) -> None:
            if args and getattr(args[0], "kind", None) is Kind.CALL and len(args) == 3:
                _BRIEF.append(brief)  # a builtin call, decoded on arrival (RpcAgent._submit_builtin)
            submit(fn, *args, brief=brief)

        world.submit = recording_submit  # type: ignore[method-assign]
    else:
        to = "worker1"
        a, b = torch.ones(2), torch.full((2,), 2.0)

        def pickled(func: Any, *args: Any, **kwargs: Any) -> Any:
            """The same call through the pickled path (RpcAgent.request pickles whatever it gets)."""
            return agent.request(1, Kind.CALL, (func, args, kwargs), 20.0).wait()

        out["add"] = _outcome(lambda: rpc.rpc_sync(to, torch.add, args=(a, b), kwargs={"alpha": 3}).tolist())
        big = torch.ones(5000)
        out["big add"] = _outcome(lambda: rpc.rpc_sync(to, torch.add, args=(big, 1)).sum().item())
        out["not brief"] = _outcome(lambda: rpc.rpc_sync(to, torch.ones, args=((2, 2),)).tolist())
        out["error"] = _outcome(lambda: rpc.rpc_sync(to, torch.add, args=(torch.ones(2), torch.ones(3))))
        out["error pickled"] = _outcome(lambda: pickled(torch.add, torch.ones(2), torch.ones(3)))
        out["type error"] = _outcome(lambda: rpc.rpc_sync(to, torch.matmul, args=(torch.ones(2), None)))
        out["type error pickled"] = _outcome(lambda: pickled(torch.matmul, torch.ones(2), None))
        w = torch.ones(2, requires_grad=True)
        fast = rpc.rpc_sync(to, torch.mul, args=(w, 3.0))
        slow_path = pickled(torch.mul, w, 3.0)
        out["grad result"] = [(r.requires_grad, r.is_leaf, r.tolist()) for r in (fast, slow_path)]
        with dist_autograd.context() as ctx:
            r = rpc.rpc_sync(to, torch.mul, args=(w, 3.0))
            dist_autograd.backward(ctx, [r.sum()])
            out["dist grad"] = dist_autograd.get_gradients(ctx)[w].tolist()
        # worker1's only request thread is busy: a brief call waits for it like any request
        busy = rpc.rpc_async(to, slow, args=(1.5,))
        time.sleep(0.2)
        out["timeout"] = _outcome(lambda: rpc.rpc_sync(to, torch.add, args=(a, b), timeout=0.4))
        out["slow"] = _outcome(busy.wait)
        out["after timeout"] = _outcome(lambda: rpc.rpc_sync(to, torch.add, args=(a, b)).tolist())
        # a tensor record naming storage 7 of a message that carries none
        bad = bytes((0xB7, 1, 3)) + b"add" + b"(\x01\x00t" + struct.pack("<HBBBq", 7, 0, 0, 0, 0) + b"\x00"
        out["malformed"] = _outcome(lambda: agent._send_request(1, Kind.CALL, bad, [], 20.0).wait())
        out["after malformed"] = _outcome(lambda: rpc.rpc_sync(to, torch.sub, args=(b, a)).tolist())
        out["brief"] = rpc.rpc_sync(to, brief_flags)
    rpc.shutdown()
    results.put((rank, out))


def _child(rank: int, init_file: str, results: Any) -> None:
    try:
        _program(rank, init_file, results)
    except BaseException:
        results.put((rank, traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    init_file = str(Path(tmp_path_factory.mktemp("builtin")) / "rendezvous")
    procs = [mp.Process(target=_child, args=(r, init_file, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + WORLD_TIMEOUT
        while len(got) < 2:
            try:
                rank, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the world did not finish within {WORLD_TIMEOUT} s; results so far: {got!r}")
            if isinstance(value, str):
                pytest.fail(f"rank {rank} raised:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return got[0]  # type: ignore[no-any-return]


def test_a_small_builtin_call_runs_brief_and_others_do_not(outcomes: dict[str, Any]) -> None:
    assert outcomes["add"] == ("ok", [7.0, 7.0])
    assert outcomes["big add"] == ("ok", 10000.0)
    assert outcomes["not brief"] == ("ok", [[1.0, 1.0], [1.0, 1.0]])
    # add, big add, ones, the two errors, mul, the mul in an autograd context (compact, in its
    # envelope, never brief), timed-out add, add, sub (the malformed call is not decoded, the pickled
    # ones are pickled)
    assert outcomes["brief"] == [True, False, False, True, True, True, False, True, True, True]


def test_remote_errors_are_those_of_the_pickled_path(outcomes: dict[str, Any]) -> None:
    assert outcomes["error"] == outcomes["error pickled"]
    assert (
        outcomes["error"][1] == "RuntimeError"
        and "must match the size of tensor b (3)" in outcomes["error"][2]
    )
    assert outcomes["type error"] == outcomes["type error pickled"]
    assert outcomes["type error"][1] == "RuntimeError" and "TypeError" in outcomes["type error"][2]


def test_autograd_sees_the_same_tensors_and_records_inside_a_context(outcomes: dict[str, Any]) -> None:
    fast, pickled = outcomes["grad result"]
    assert fast == pickled == (True, True, [3.0, 3.0])
    assert outcomes["dist grad"] == [3.0, 3.0]


def test_a_brief_call_waits_for_a_request_slot_and_times_out_as_any_call(outcomes: dict[str, Any]) -> None:
    status, kind, message = outcomes["timeout"]
    assert (status, kind) == ("raised", "RPCTimeoutError") and "RPC ran for more than set timeout" in message
    assert outcomes["slow"] == ("ok", 1.5)
    assert outcomes["after timeout"] == ("ok", [3.0, 3.0])


def test_a_malformed_payload_fails_its_call_only(outcomes: dict[str, Any]) -> None:
    status, kind, message = outcomes["malformed"]
    assert (status, kind) == ("raised", "SerializationError")
    assert "malformed builtin call payload" in message and "names storage 7, but the message has 0" in message
    assert outcomes["after malformed"] == ("ok", [1.0, 1.0])
