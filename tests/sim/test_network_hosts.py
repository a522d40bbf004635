"""Workers on hosts in the simulator's network model: same-host links take their own parameters, the
default placement (a host per worker) keeps every schedule, and calibration fits both kinds of link."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from twinrpc.simulator import Crash, FaultPlan, NetworkModel, Simulation, now
from twinrpc.simulator.calibration import (
    CalibrationError,
    Pipelined,
    RoundTrip,
    fit_network_model,
    measure,
    predict,
)

import twinrpc.rpc as rpc

KiB, MiB = 1024, 1024 * 1024

#: cross-host 200 us / 1 GB/s, same-host 10 us / 10 GB/s, no jitter: every delay is exact
TWO_KINDS = NetworkModel(
    latency=200e-6,
    jitter=0.0,
    bandwidth=1e9,
    same_host_latency=10e-6,
    same_host_jitter=0.0,
    same_host_bandwidth=10e9,
)


def _round_trips(model: NetworkModel, world_size: int, nbytes: int = 0) -> list[float]:
    """Worker 0's rpc_sync round trip to each other worker (virtual seconds), with a float32 tensor of
    ``nbytes`` (0: a small integer), over a link made by a first call (links are made on first use)."""
    import torch

    def program(rank: int) -> list[float]:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
        out = []
        if rank == 0:
            arg: Any = 1 if nbytes == 0 else torch.ones(nbytes // 4)
            for peer in range(1, world_size):
                rpc.rpc_sync(f"w{peer}", abs, args=(1,))  # makes the link
                t0 = now()
                rpc.rpc_sync(f"w{peer}", torch.clone if nbytes else abs, args=(arg,))
                out.append(now() - t0)
        rpc.shutdown()
        return out

    return Simulation(world_size, network=model).run(program).values()[0]


def test_a_same_host_link_takes_the_same_host_latency_and_a_cross_host_link_the_other() -> None:
    same, cross = _round_trips(TWO_KINDS.with_hosts([0, 0, 1]), 3)
    assert same == pytest.approx(2 * 10e-6, abs=1e-6)  # + bytes / 10 GB/s: a few hundred bytes
    assert cross == pytest.approx(2 * 200e-6, abs=2e-6)


def test_a_same_host_link_takes_the_same_host_bandwidth() -> None:
    small_same, small_cross = _round_trips(TWO_KINDS.with_hosts([0, 0, 1]), 3)
    big_same, big_cross = _round_trips(TWO_KINDS.with_hosts([0, 0, 1]), 3, nbytes=16 * MiB)
    # a 16 MiB tensor goes and comes back: 32 MiB at 10 GB/s on one host, at 1 GB/s between hosts
    assert big_same - small_same == pytest.approx(32 * MiB / 10e9, rel=0.01)
    assert big_cross - small_cross == pytest.approx(32 * MiB / 1e9, rel=0.01)


def test_workers_per_host_places_ranks_in_blocks() -> None:
    model = TWO_KINDS.with_hosts(workers_per_host=2)
    trips = _round_trips(model, 4)  # worker 0 to 1 (its host), 2 and 3 (the next host)
    assert trips[0] == pytest.approx(20e-6, abs=1e-6)
    assert trips[1] == pytest.approx(400e-6, abs=2e-6) and trips[2] == pytest.approx(400e-6, abs=2e-6)
    assert [model.host_of(r) for r in range(5)] == [0, 0, 1, 1, 2]


def test_a_rank_the_placement_does_not_name_is_on_a_host_of_its_own() -> None:
    model = NetworkModel(hosts=(7, 7))
    assert model.same_host(0, 1) and not model.same_host(1, 2) and not model.same_host(2, 3)
    assert model.host_of(2) is None
    assert not NetworkModel().placed and not NetworkModel().same_host(0, 1)


def test_without_hosts_every_link_takes_the_cross_host_parameters() -> None:
    assert _round_trips(TWO_KINDS, 3) == pytest.approx([400e-6, 400e-6], abs=2e-6)


def _digest(model: NetworkModel, seed: int, plan: FaultPlan | None) -> str:
    """The trace digest of the rich scenario, or the error it ended with (a crash plan may end it so)."""
    from _trace_scenarios import rich

    try:
        return Simulation(3, seed=seed, network=model, faults=plan).run(rich).digest
    except Exception as exc:  # the same failure, at the same moment, is the same schedule
        return f"{type(exc).__name__}: {exc}"


def test_placing_workers_changes_no_schedule_when_both_kinds_of_link_are_alike() -> None:
    """The same delays and the same random draws whichever kind of link a message takes: a placement
    with same-host parameters equal to the cross-host ones gives the trace of no placement, crash and
    departure announcements included."""
    alike = NetworkModel(same_host_latency=50e-6, same_host_jitter=20e-6, same_host_bandwidth=2e9)
    for seed in range(3):
        plan = FaultPlan([Crash(2, at=0.002)]) if seed == 2 else None
        assert _digest(alike.with_hosts([0, 0, 1]), seed, plan) == _digest(alike, seed, plan), seed


def test_hosts_change_the_schedule_when_the_links_differ() -> None:
    from _trace_scenarios import rich

    plain = Simulation(3, seed=1, network=TWO_KINDS).run(rich)
    placed = Simulation(3, seed=1, network=TWO_KINDS.with_hosts([0, 0, 1])).run(rich)
    assert placed.digest != plain.digest
    assert placed.virtual_time < plain.virtual_time  # two of three workers talk at 10 us, not 200


def test_a_departure_reaches_each_peer_over_its_own_kind_of_link() -> None:
    """A worker's shutdown is announced to each peer after that link's latency (the generic path,
    not the inlined one of a model without hosts)."""
    from twinrpc.simulator import sleep

    model = NetworkModel(latency=1e-3, jitter=0.0, same_host_latency=1e-6, same_host_jitter=0.0)

    def program(rank: int) -> None:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=3)
        if rank == 0:  # a departure is announced over links, made on first use
            for peer in (1, 2):
                rpc.rpc_sync(f"w{peer}", abs, args=(1,))
        else:
            sleep(0.1)
        rpc.shutdown(graceful=False)

    def heard(model: NetworkModel) -> dict[int, float]:
        result = Simulation(3, network=model).run(program)
        left = [
            e for e in result.trace.events() if e.event == "peer-left" and str(e.detail).startswith("rank 0")
        ]
        return {e.worker: e.time for e in left}

    plain, placed = heard(model), heard(model.with_hosts([0, 0, 1]))
    assert set(plain) == set(placed) == {1, 2}
    assert plain[1] == pytest.approx(plain[2])
    assert placed[2] - placed[1] == pytest.approx(1e-3 - 1e-6, rel=1e-6)


def test_the_model_refuses_a_malformed_placement() -> None:
    with pytest.raises(ValueError, match=r"hosts\[1\] must be an integer"):
        NetworkModel(hosts=(0, "a"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="workers_per_host must be an integer >= 1, got 0"):
        NetworkModel(workers_per_host=0)
    with pytest.raises(ValueError, match="not both"):
        NetworkModel(hosts=(0, 0), workers_per_host=2)
    with pytest.raises(ValueError, match="same_host_bandwidth must be > 0"):
        NetworkModel(same_host_bandwidth=0)
    with pytest.raises(ValueError, match="same_host_latency must be a number >= 0"):
        NetworkModel(same_host_latency=-1.0)


def test_a_placed_model_round_trips_through_dict_and_file(tmp_path: Path) -> None:
    model = TWO_KINDS.with_hosts([0, 0, 1, 1])
    assert NetworkModel.from_dict(model.to_dict()) == model
    for name in ("m.toml", "m.json"):
        model.dump(tmp_path / name)
        assert NetworkModel.load(tmp_path / name) == model
    blocks = NetworkModel(workers_per_host=8)
    assert NetworkModel.from_dict(blocks.to_dict()) == blocks


def test_a_model_without_hosts_writes_no_host_fields() -> None:
    """Reproduction commands and saved cases of models without hosts read as before hosts existed."""
    assert set(NetworkModel(latency=1e-3).to_dict()) == {
        "latency",
        "jitter",
        "bandwidth",
        "loopback_latency",
        "failure_detection",
        "message_cost",
    }
    assert NetworkModel(same_host_latency=1e-3).to_dict()["same_host_latency"] == 1e-3


# -- calibration ---------------------------------------------------------------------------------------
def test_fit_of_simulated_round_trips_on_and_between_hosts_recovers_both_kinds_of_link() -> None:
    truth = NetworkModel(
        latency=150e-6,
        jitter=0.0,
        bandwidth=1.2e9,
        message_cost=20e-6,
        same_host_latency=12e-6,
        same_host_jitter=0.0,
        same_host_bandwidth=6e9,
    ).with_hosts([0, 0, 1])
    sizes = (0, KiB, 64 * KiB, MiB, 4 * MiB)

    def program(rank: int) -> Any:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
        out = None
        if rank == 0:
            kw: dict[str, Any] = {"sizes": sizes, "calls": 5, "pipelined_calls": 2000}
            out = measure("worker1", same_host=True, **kw) + measure("worker2", **kw)
        rpc.shutdown()
        return out

    samples = Simulation(3, network=truth).run(program).values()[0]
    assert [s.same_host for s in samples] == [True] * 6 + [False] * 6
    fit = fit_network_model(
        [s for s in samples if isinstance(s, RoundTrip)],
        [s for s in samples if isinstance(s, Pipelined)],
        base=NetworkModel().with_hosts([0, 0, 1]),
    )
    for field in ("latency", "bandwidth", "same_host_latency", "same_host_bandwidth", "message_cost"):
        assert getattr(fit.model, field) == pytest.approx(getattr(truth, field), rel=0.02), field
    assert fit.model.hosts == (0, 0, 1)
    assert fit.same_host and fit.cross_host
    assert "same host: same_host_latency 1" in fit.describe()  # 11.9 or 12.0 us


def test_fit_of_exact_same_host_data_leaves_the_cross_host_parameters_of_the_base() -> None:
    truth = NetworkModel(
        same_host_latency=8e-6, same_host_jitter=2e-6, same_host_bandwidth=7e9, message_cost=30e-6
    )
    trips = [
        RoundTrip(n, n, predict(truth, RoundTrip(n, n, 1.0, same_host=True)), 1.1056 * 2e-6, same_host=True)
        for n in (200, 5_000, 2_000_000, 16_000_000)
    ]
    pipe = [Pipelined(predict(truth, Pipelined(1.0, 64, True)), 64, True)]
    base = NetworkModel(latency=321e-6)
    fit = fit_network_model(trips, pipe, base=base)
    assert fit.model.latency == 321e-6 and fit.model.bandwidth == base.bandwidth
    for field in ("same_host_latency", "same_host_bandwidth", "message_cost"):
        assert getattr(fit.model, field) == pytest.approx(getattr(truth, field), rel=1e-3), field
    assert fit.model.same_host_jitter == pytest.approx(2e-6, rel=1e-3)
    assert (fit.same_host, fit.cross_host) == (True, False)
    assert "between hosts" not in fit.describe()


def test_fit_refuses_one_size_on_a_kind_of_link() -> None:
    cross = [RoundTrip(100, 100, 300e-6), RoundTrip(10**6, 10**6, 2e-3)]
    with pytest.raises(CalibrationError, match="two different sizes between two workers of one host"):
        fit_network_model([*cross, RoundTrip(100, 100, 40e-6, same_host=True)])
    with pytest.raises(CalibrationError, match="do not grow with their size"):
        fit_network_model(
            [
                *cross,
                RoundTrip(100, 100, 40e-6, same_host=True),
                RoundTrip(10**6, 10**6, 40e-6, same_host=True),
            ]
        )
