"""The simulator's compute model: virtual time for the torch operators tasks run, and its fit."""

from __future__ import annotations

import pytest
import torch
from twinrpc.simulator import ComputeModel, FaultPlanError, NetworkModel, Simulation, now
from twinrpc.simulator.calibration import (
    CalibrationError,
    ComputeSample,
    count_operations,
    fit_compute_model,
)

import twinrpc.rpc as rpc

N = 48  # a N x N x N matrix product: 2 * N**3 FLOPs
FLAT = NetworkModel(latency=100e-6, jitter=0.0, bandwidth=1e18)


def _product(seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.rand(N, N, generator=g), torch.rand(N, N, generator=g)
    return float(torch.mm(a, b).sum())


def _round_trips(world_size: int, compute: ComputeModel | None) -> list[float]:
    def program(rank: int) -> float:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
        elapsed = 0.0
        if rank > 0:
            rpc.rpc_sync("w0", abs, args=(1,))  # makes the link (links are made on first use)
            t0 = now()
            rpc.rpc_sync("w0", _product, args=(rank,))
            elapsed = now() - t0
        rpc.shutdown()
        return elapsed

    return Simulation(world_size, network=FLAT, compute=compute).run(program).values()[1:]


def test_operations_and_flops_are_counted() -> None:
    value, ops, flops = count_operations(_product, 0)
    assert value == _product(0)
    assert flops == 2 * N**3 and ops >= 3  # two rand, one mm (and a sum)


def test_a_handlers_computation_delays_its_reply_by_its_cost() -> None:
    free = _round_trips(2, None)[0]
    assert free == pytest.approx(2 * FLAT.latency)
    per_flop = _round_trips(2, ComputeModel(flop_cost=1e-9))[0]
    assert per_flop - free == pytest.approx(1e-9 * 2 * N**3, rel=1e-9)


def test_a_worker_computes_one_task_at_a_time() -> None:
    """Three callers at once: the server's three products run one after another."""
    times = sorted(_round_trips(4, ComputeModel(flop_cost=1e-9)))
    one = 1e-9 * 2 * N**3
    assert times == pytest.approx([2 * FLAT.latency + k * one for k in (1, 2, 3)], rel=1e-9)


def test_operator_cost_charges_every_operator_and_runs_stay_deterministic() -> None:
    model = ComputeModel(op_cost=2e-6)
    first, second = _round_trips(2, model)[0], _round_trips(2, model)[0]
    assert first == second > 2 * FLAT.latency + 3 * 2e-6


def test_compute_model_fit_recovers_known_costs() -> None:
    truth = ComputeModel(op_cost=12e-6, flop_cost=40e-12)
    shapes = [(2_000, 10**7), (2_000, 10**9), (8_000, 5 * 10**8)]
    samples = [ComputeSample(o, f, truth.cost(o, f), f"{o} ops") for o, f in shapes]
    fit = fit_compute_model(samples)
    assert fit.model.op_cost == pytest.approx(truth.op_cost, rel=1e-6)
    assert fit.model.flop_cost == pytest.approx(truth.flop_cost, rel=1e-6)
    assert "op_cost 12.00 us per operator" in fit.describe()


def test_bad_compute_models_and_samples_are_refused() -> None:
    with pytest.raises(FaultPlanError, match=r"ComputeModel\.flop_cost must be a finite number >= 0"):
        ComputeModel(flop_cost=-1.0)
    with pytest.raises(CalibrationError, match="at least one ComputeSample"):
        fit_compute_model([])
    with pytest.raises(CalibrationError, match="positive number of seconds"):
        fit_compute_model([ComputeSample(10, 10, 0.0)])


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_compute_model_written_to_a_file_reads_back_equal(tmp_path, suffix: str) -> None:
    model = ComputeModel(op_cost=2.5e-6, flop_cost=3e-11)
    assert ComputeModel.from_dict(model.to_dict()) == model
    path = tmp_path / f"compute{suffix}"
    model.dump(path)
    assert ComputeModel.load(path) == model
    assert ComputeModel.from_dict({"flop_cost": 1e-9}) == ComputeModel(op_cost=0.0, flop_cost=1e-9)


def test_a_bad_compute_file_names_the_field() -> None:
    with pytest.raises(
        FaultPlanError, match="unknown field 'cost_per_op'; expected one of op_cost, flop_cost"
    ):
        ComputeModel.from_dict({"cost_per_op": 1e-6})
    with pytest.raises(FaultPlanError, match=r"flop_cost"):
        ComputeModel.from_dict({"flop_cost": "fast"})
    with pytest.raises(FaultPlanError, match=r"op_cost must be a finite number >= 0"):
        ComputeModel.from_dict({"op_cost": -1})
