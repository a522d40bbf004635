"""Calibrating the simulator's network model: message handling cost, and the least-squares fit."""

from __future__ import annotations

import math
from typing import Any

import pytest
from twinrpc.simulator import NetworkModel, Simulation, now, sleep
from twinrpc.simulator.calibration import (
    SPREAD_PER_JITTER,
    CalibrationError,
    Pipelined,
    RoundTrip,
    fit_network_model,
    measure,
    predict,
)

import twinrpc.rpc as rpc

KiB, MiB = 1024, 1024 * 1024


def _measure_in_simulation(model: NetworkModel, seed: int = 0, **kwargs: Any) -> tuple[list[Any], Any]:
    def program(rank: int) -> Any:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        out = measure("worker1", **kwargs) if rank == 0 else None
        rpc.shutdown()
        return out

    result = Simulation(2, seed=seed, network=model).run(program)
    return result.values()[0], result.trace


def test_fit_of_simulated_round_trips_recovers_the_model() -> None:
    truth = NetworkModel(latency=80e-6, jitter=0.0, bandwidth=1.5e9, message_cost=30e-6)
    samples, _ = _measure_in_simulation(
        truth, sizes=(0, KiB, 64 * KiB, MiB, 4 * MiB), calls=5, pipelined_calls=400
    )
    fit = fit_network_model(
        [s for s in samples if isinstance(s, RoundTrip)], [s for s in samples if isinstance(s, Pipelined)]
    )
    assert fit.model.latency == pytest.approx(truth.latency, rel=0.01)
    assert fit.model.bandwidth == pytest.approx(truth.bandwidth, rel=0.01)
    assert fit.model.message_cost == pytest.approx(truth.message_cost, rel=0.01)
    assert fit.model.jitter == pytest.approx(0.0, abs=1e-12)
    assert fit.rms_relative_error < 0.01


def test_fit_estimates_jitter_from_the_spread_of_small_round_trips() -> None:
    truth = NetworkModel(latency=50e-6, jitter=40e-6, bandwidth=2e9, message_cost=10e-6)
    samples, _ = _measure_in_simulation(truth, seed=3, sizes=(0, 64 * KiB), calls=400, pipelined_calls=400)
    fit = fit_network_model([s for s in samples[:-1]], [samples[-1]])
    assert fit.model.jitter == pytest.approx(truth.jitter, rel=0.15)
    assert fit.model.latency == pytest.approx(truth.latency, rel=0.15)
    assert fit.model.message_cost == pytest.approx(truth.message_cost, rel=0.05)


def test_fit_of_exact_synthetic_data_is_exact_and_keeps_the_other_fields() -> None:
    truth = NetworkModel(latency=120e-6, jitter=30e-6, bandwidth=0.8e9, message_cost=45e-6)
    base = NetworkModel(failure_detection=0.25, heartbeat_timeout=3.0)
    trips = [
        RoundTrip(n, n + 40, predict(truth, RoundTrip(n, n + 40, 1.0)), SPREAD_PER_JITTER * truth.jitter)
        for n in (150, 2_000, 300_000, 17_000_000)
    ]
    pipe = [Pipelined(predict(truth, Pipelined(1.0, 64)), 64)]
    fit = fit_network_model(trips, pipe, base=base)
    for field in ("latency", "jitter", "bandwidth", "message_cost"):
        assert getattr(fit.model, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    assert (fit.model.failure_detection, fit.model.heartbeat_timeout) == (0.25, 3.0)
    assert all(abs(r.relative) < 1e-6 for r in fit.residuals)
    assert "message_cost 45.0 us" in fit.describe()


def test_fit_without_pipelined_calls_puts_all_overhead_in_latency() -> None:
    trips = [RoundTrip(100, 100, 200e-6), RoundTrip(1_000_100, 1_000_100, 1_200e-6)]
    fit = fit_network_model(trips)
    assert fit.model.message_cost == 0.0
    assert fit.model.latency == pytest.approx((200e-6 - 200 / 2e9) / 2, rel=1e-3)
    assert fit.model.bandwidth == pytest.approx(2e9, rel=1e-3)


def test_fit_never_returns_negative_parameters() -> None:
    # Pipelined calls slower than a whole round trip: message_cost alone would exceed the round trip.
    trips = [RoundTrip(100, 100, 100e-6), RoundTrip(10**6, 10**6, 1.1e-3)]
    fit = fit_network_model(trips, [Pipelined(80e-6)])
    m = fit.model
    assert min(m.latency, m.jitter, m.message_cost) >= 0 and math.isfinite(m.bandwidth)


def test_fit_refuses_measurements_that_cannot_determine_a_model() -> None:
    with pytest.raises(CalibrationError, match="at least two different sizes"):
        fit_network_model([RoundTrip(100, 100, 1e-4), RoundTrip(100, 100, 2e-4)])
    with pytest.raises(CalibrationError, match="positive number of seconds"):
        fit_network_model([RoundTrip(100, 100, 0.0), RoundTrip(10**6, 10**6, 1e-3)])
    with pytest.raises(CalibrationError, match="do not grow with their size"):
        fit_network_model([RoundTrip(100, 100, 1e-3), RoundTrip(10**6, 10**6, 1e-3)])
    with pytest.raises(CalibrationError, match="no samples"):
        RoundTrip.from_samples(10, 10, [])


def test_measured_byte_counts_are_the_simulators() -> None:
    samples, trace = _measure_in_simulation(NetworkModel(), sizes=(0, 4 * KiB), calls=5, pipelined_calls=10)
    sent = {(e.message.kind, e.message.nbytes) for e in trace.events() if e.event == "send" and e.message}
    for s in samples[:2]:
        assert ("CALL", s.request_bytes) in sent and ("RESPONSE", s.response_bytes) in sent


def test_a_busy_worker_handles_one_message_at_a_time() -> None:
    """N callers call one server at once: its N receives are booked first, then each reply's send."""
    n, latency, cost = 6, 100e-6, 10e-6
    model = NetworkModel(latency=latency, jitter=0.0, bandwidth=1e18, message_cost=cost)

    def program(rank: int) -> float:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=n + 1)
        elapsed = 0.0
        if rank > 0:
            rpc.rpc_sync("w0", abs, args=(-rank,))  # makes the link (links are made on first use)
            sleep(0.01 - now())  # then every caller calls at once
            t0 = now()
            rpc.rpc_sync("w0", abs, args=(-rank,))
            elapsed = now() - t0
        rpc.shutdown()
        return elapsed

    slowest = max(Simulation(n + 1, network=model).run(program).values())
    assert slowest == pytest.approx(2 * latency + 2 * cost + 2 * n * cost, rel=1e-9)


def test_free_message_handling_is_the_default() -> None:
    assert NetworkModel().message_cost == 0.0
    with pytest.raises(ValueError, match="message_cost must be a number >= 0"):
        NetworkModel(message_cost=-1e-6)
