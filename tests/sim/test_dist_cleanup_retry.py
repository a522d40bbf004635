"""Distributed autograd context cleanup over a lossy simulated network (DAG-10).

PyTorch sends each cleanup with ``sendWithRetries`` (20 retries, 1 s x 1.5^k apart) and releases
idempotently on the receiver; its faulty-agent test fails the first 3 sends of every cleanup. These
tests drop the first cleanup messages (or an ack) with a :class:`FaultPlan` and check that the release
still reaches every worker, when the resends go out, that a resend is handled once, and that the sender
gives up after 20 retries.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from twinrpc.simulator import Drop, FaultPlan, Simulation, now, sleep

import twinrpc.autograd as dist_autograd
import twinrpc.rpc as rpc

RPC_TIMEOUT = 0.5  # each attempt waits this long (virtual seconds) for its ack
QUIET = 10_000.0  # virtual seconds worker 0 waits after leaving the context: longer than 20 retries


def _add_on(dst: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync(dst, torch.add, args=(a, b))  # type: ignore[no-any-return]


def _has_context(context_id: int) -> bool:
    try:
        dist_autograd._retrieve_context(context_id)
    except RuntimeError:
        return False
    return True


def _program(rank: int, graceful: bool) -> Any:
    """Worker 0 reaches workers 1 and 2 (through 1) inside a context, leaves it, waits, then asks
    whether 1 and 2 still hold it."""
    options = rpc.RpcBackendOptions(rpc_timeout=RPC_TIMEOUT)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    if rank != 0:
        if not graceful:  # serve until worker 0 has asked, then leave without the join
            sleep(2 * QUIET)
        rpc.shutdown(graceful=graceful)
        return None
    a = torch.rand(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        rpc.rpc_sync("worker1", _add_on, args=("worker2", a, a))
    left_at = now()
    sleep(QUIET)
    held = [rpc.rpc_sync(f"worker{r}", _has_context, args=(context_id,)) for r in (1, 2)]
    rpc.shutdown(graceful=graceful)
    return left_at, held


def _run(plan: FaultPlan | None, graceful: bool = True) -> Any:
    return Simulation(3, seed=1, faults=plan).run(_program, graceful)


def _sends(result: Any, kind: str, link: str) -> list[Any]:
    """The messages of ``kind`` sent on ``link`` ("0->1"), in order."""
    return [
        e
        for e in result.trace
        if e.event == "send" and e.detail.startswith(f"{kind}#") and f" {link} " in e.detail
    ]


def test_a_lost_context_cleanup_is_resent_with_pytorchs_backoff_and_reaches_every_worker() -> None:
    # As PyTorch's faulty agent: the first 3 sends of the cleanup fail.
    result = _run(FaultPlan((Drop(kind="context-cleanup", src=0, dst=1, count=3),)))
    left_at, held = result.values()[0]
    assert held == [False, False]  # released on worker 1, and forwarded by it to worker 2
    dropped = [e for e in result.trace if e.event == "drop"]
    assert len(dropped) == 3 and all(e.detail.startswith("CONTEXT_CLEANUP#") for e in dropped)
    # Attempt k+1 is sent 1 s x 1.5^k after attempt k (each attempt's 0.5 s ack wait ends earlier).
    times = [e.time - left_at for e in _sends(result, "CONTEXT_CLEANUP", "0->1")]
    assert times == pytest.approx([0.0, 1.0, 2.5, 4.75])
    assert len(_sends(result, "CONTEXT_CLEANUP", "1->2")) == 1  # released once, forwarded once


def test_a_lost_cleanup_ack_makes_a_resend_that_the_receiver_handles_once() -> None:
    # Worker 1 sends no cleanup back to worker 0 (it never forwards to the sender): the first
    # context-cleanup message from 1 to 0 is the ack.
    result = _run(FaultPlan((Drop(kind="context-cleanup", src=1, dst=0),)))
    _, held = result.values()[0]
    assert held == [False, False]
    assert [e.detail.split("#")[0] for e in result.trace if e.event == "drop"] == ["RESPONSE"]
    assert len(_sends(result, "CONTEXT_CLEANUP", "0->1")) == 2  # resent because the ack was lost
    assert len(_sends(result, "CONTEXT_CLEANUP", "1->2")) == 1  # the resend was acked, not handled again


@pytest.mark.parametrize("graceful", [True, False], ids=["graceful-shutdown", "ungraceful-shutdown"])
def test_context_cleanup_gives_up_after_twenty_retries_and_logs_it(
    caplog: pytest.LogCaptureFixture, graceful: bool
) -> None:
    with caplog.at_level(logging.ERROR, logger="twinrpc"):
        # Every attempt is lost: worker 1 never hears of it. A graceful shutdown still ends: its join
        # waits for a control message only until the sender gives it up.
        plan = FaultPlan((Drop(kind="context-cleanup", src=0, dst=1, count=None),))
        result = _run(plan, graceful=graceful)
    assert [o.error for o in result.outcomes] == [None, None, None]
    _, held = result.values()[0]
    assert held == [True, True]
    assert len(_sends(result, "CONTEXT_CLEANUP", "0->1")) == 21  # the first send and 20 retries
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "Could not release Dist Autograd Context on node 1" in m and "max retries (20)" in m for m in messages
    ), messages
