"""One configuration value, ``SimConfig``, reaches every entry point of the simulator.

Each test passes a compute model that charges a visible cost (a matrix product on the server costs
``COST`` virtual seconds) through one entry point (``Simulation``, ``SimConfig.build``, ``explore``,
``replay``, an exploration's ``Case``, the ``run``/``explore``/``replay`` commands, the pytest fixture)
and checks that the run's virtual time shows it: a path that drops the setting fails here.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from twinrpc.simulator import (
    ComputeModel,
    FaultPlan,
    NetworkModel,
    SimConfig,
    Simulation,
    Swarm,
    explore,
    now,
    replay,
)
from twinrpc.simulator._cli._main import main
from twinrpc.simulator._exploration._case import Case

import twinrpc.rpc as rpc

N = 48  # an N x N x N matrix product: 2 * N**3 FLOPs
MODEL = ComputeModel(flop_cost=1e-9)
COST = 1e-9 * 2 * N**3  # what MODEL charges for the product
SLOW = ComputeModel(flop_cost=1e-5)  # the product takes 2.2 s: more than any default fault delays it
FLAT = NetworkModel(latency=100e-6, jitter=0.0, bandwidth=1e18)
FREE = 2 * FLAT.latency  # the round trip when computing is free


def product(seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.rand(N, N, generator=g), torch.rand(N, N, generator=g)
    return float(torch.mm(a, b).sum())


def program(rank: int) -> float:
    """Worker 1 asks worker 0 for a product; returns how long that took in virtual time."""
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    elapsed = 0.0
    if rank == 1:
        rpc.rpc_sync("w0", abs, args=(1,))  # makes the link (links are made on first use)
        t0 = now()
        rpc.rpc_sync("w0", product, args=(rank,))
        elapsed = now() - t0
    rpc.shutdown()
    return elapsed


def charged(elapsed: float) -> bool:
    """The round trip took the product's cost on top of the network's."""
    return elapsed == pytest.approx(FREE + COST, rel=1e-6)


def check_charged(result: object) -> bool:
    return charged(result.values()[1])  # type: ignore[attr-defined]


# -- SimConfig itself -------------------------------------------------------------------------------
def test_a_config_is_a_frozen_value_with_fluent_copies() -> None:
    base = SimConfig(world_size=2)
    config = base.with_seed(7).with_network(FLAT).with_compute(MODEL).with_max_time(5.0)
    assert base == SimConfig(2) and base.seed == 0 and base.compute is None  # unchanged
    assert (config.world_size, config.seed, config.network, config.compute) == (2, 7, FLAT, MODEL)
    assert config.with_trace(False).trace is False and config.with_monitors(False).monitors is False
    assert config.with_faults(Swarm()).plan() == Swarm().plan(7, 2)
    with pytest.raises(AttributeError):
        config.seed = 3  # type: ignore[misc]


def test_a_config_refuses_what_is_not_a_setting() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        SimConfig(0)
    with pytest.raises(TypeError, match=r"SimConfig\.compute must be a ComputeModel"):
        SimConfig(2, compute="model.json")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a SimConfig setting: colour"):
        SimConfig.merged(None, colour="red")
    with pytest.raises(TypeError, match="needs a world_size"):
        Simulation()


def test_a_numpy_integer_world_size_or_seed_becomes_a_plain_int() -> None:
    import numpy as np

    config = SimConfig(np.int64(2), seed=np.int32(5))
    assert (config.world_size, config.seed) == (2, 5)
    assert type(config.world_size) is int and type(config.seed) is int


def test_keywords_override_the_config_and_none_leaves_its_value() -> None:
    config = SimConfig(2, seed=4, compute=MODEL)
    assert SimConfig.merged(config, seed=None, compute=None) is config
    assert SimConfig.merged(config, seed=9).seed == 9
    sim = Simulation(3, config=config)
    assert (sim.world_size, sim.seed, sim.compute) == (3, 4, MODEL)


# -- Simulation ---------------------------------------------------------------------------------------
def test_simulation_takes_the_compute_model_by_keyword_by_config_and_by_builder() -> None:
    free = Simulation(2, network=FLAT).run(program).values()[1]
    assert free == pytest.approx(FREE)
    config = SimConfig(2).with_network(FLAT).with_compute(MODEL)
    for sim in (
        Simulation(2, network=FLAT, compute=MODEL),
        Simulation(config=config),
        config.build(),
    ):
        assert sim.config == config
        assert charged(sim.run(program).values()[1])


# -- explore, replay, Case ------------------------------------------------------------------------------
def test_explore_runs_every_case_with_the_compute_model_of_its_config_or_keyword() -> None:
    just_seeds = st.just(FaultPlan())
    config = SimConfig(2, network=FLAT, compute=MODEL)
    assert explore(program, config=config, faults=just_seeds, runs=3, check=check_charged).failure is None
    by_keyword = explore(
        program, 2, compute=MODEL, network=st.just(FLAT), faults=just_seeds, runs=3, check=check_charged
    )
    assert by_keyword.failure is None and by_keyword.runs == 3
    # and a failure found under a compute model carries it: in its case and in its replay command
    found = explore(
        program, config=config, faults=just_seeds, runs=3, check=lambda r: False, raise_on_failure=False
    ).failure
    assert found is not None and found.case.compute == MODEL and found.compute == MODEL
    assert "--compute" in found.replay_command or "compute=" in found.replay_command


def test_explore_refuses_a_config_whose_seed_or_faults_it_would_replace() -> None:
    with pytest.raises(ValueError, match="draws each run's seed"):
        explore(program, config=SimConfig(2, seed=3), runs=1)
    with pytest.raises(ValueError, match="draws each run's fault plan"):
        explore(program, config=SimConfig(2, faults=FaultPlan()), runs=1)


def test_replay_takes_the_compute_model_by_keyword_by_data_and_by_config() -> None:
    assert replay(program, 2, network=FLAT).values()[1] == pytest.approx(FREE)
    assert charged(replay(program, 2, network=FLAT, compute=MODEL).values()[1])
    assert charged(replay(program, 2, network=FLAT, compute=MODEL.to_dict()).values()[1])
    assert charged(replay(program, config=SimConfig(2, network=FLAT, compute=MODEL)).values()[1])


def test_a_case_round_trips_its_compute_model_and_makes_the_config_of_its_run() -> None:
    case = Case(5, FaultPlan(), FLAT, MODEL)
    data = json.loads(json.dumps(case.to_dict()))
    assert data["compute"] == MODEL.to_dict()
    assert Case.from_dict(data) == case
    assert Case.from_dict({"seed": 5}) == Case(5)  # data from before compute models were cases' own
    config = case.config(SimConfig(2, trace=False))
    assert (config.seed, config.network, config.compute, config.trace) == (5, FLAT, MODEL, False)
    assert Case.of(config) == case
    assert charged(config.build().run(program).values()[1])


# -- the command line -------------------------------------------------------------------------------------
_SCRIPT = """
import os, time
import torch
import torch.distributed.rpc as rpc

def product(seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.rand(48, 48, generator=g), torch.rand(48, 48, generator=g)
    return float(torch.mm(a, b).sum())

rank = int(os.environ["RANK"])
rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
if rank == 1:
    t0 = time.monotonic()
    rpc.rpc_sync("w0", product, args=(rank,))
    print(f"ELAPSED {time.monotonic() - t0!r}")
rpc.shutdown()
"""


def _elapsed(out: str) -> float:
    return float(next(line.split("ELAPSED ")[1] for line in out.splitlines() if "ELAPSED" in line))


def test_the_run_command_takes_compute_file_and_its_replay_command_carries_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from twinrpc.simulator._launch._launch import LaunchOptions

    script = tmp_path / "prog.py"
    script.write_text(_SCRIPT)
    network, compute = tmp_path / "network.json", tmp_path / "compute.json"
    FLAT.dump(network)
    MODEL.dump(compute)
    argv = ["run", "--nproc-per-node", "2", "--network", str(network)]
    assert main([*argv, str(script)]) == 0
    free = _elapsed(capsys.readouterr().out)
    assert main([*argv, "--compute", str(compute), str(script)]) == 0
    assert _elapsed(capsys.readouterr().out) == pytest.approx(free + COST, rel=1e-6)
    options = LaunchOptions(str(script), nproc_per_node=2, compute=str(compute))
    assert f"--compute {compute}" in options.replay_command()


def test_the_replay_command_takes_a_compute_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{__name__}:program"  # this module, importable by name (its directory is on sys.path)
    argv = ["replay", target, "--world-size", "2", "--network", json.dumps(FLAT.to_dict())]
    assert main(argv) == 0
    free = float(capsys.readouterr().out.split("virtual time ")[1].split(" s")[0])
    assert main([*argv, "--compute", json.dumps(MODEL.to_dict())]) == 0
    charged_time = float(capsys.readouterr().out.split("virtual time ")[1].split(" s")[0])
    assert charged_time == pytest.approx(free + COST, abs=2e-6)


def test_the_explore_command_runs_under_compute_and_its_replay_command_carries_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "prog.py"
    script.write_text(
        _SCRIPT
        + textwrap.dedent(
            """
            if rank == 1 and time.monotonic() - t0 > 1.0:
                raise RuntimeError("the product was charged")
            """
        )
    )
    compute = tmp_path / "compute.json"
    SLOW.dump(compute)
    out_dir = tmp_path / "out"
    argv = ["explore", "--nproc-per-node", "2", "--runs", "2", "--shrink-runs", "0", "--out", str(out_dir)]
    assert main([*argv, str(script)]) == 0  # free computing: never slow enough to fail
    capsys.readouterr()
    assert main([*argv, "--compute", str(compute), str(script)]) == 1
    out = capsys.readouterr().out
    assert "the product was charged" in out
    assert f"--compute {compute}" in out


# -- the pytest fixture -----------------------------------------------------------------------------------
_FIXTURE_TEST = """
import pytest
from twinrpc.simulator import ComputeModel
from sim.test_sim_config import COST, FREE, FLAT, program

@pytest.mark.simulation(network=FLAT{marker})
def test_charged(simulation):
    elapsed = simulation.run(program, 2).values()[1]
    assert simulation.config(2).compute == simulation.compute
    print("ELAPSED", repr(elapsed), "EXPECTED", repr(FREE + COST if simulation.compute else FREE))
    assert elapsed == pytest.approx(FREE + COST if simulation.compute else FREE, rel=1e-6)
"""


def test_the_pytest_fixture_takes_compute_by_marker_and_by_option(pytester: pytest.Pytester) -> None:
    pytester.syspathinsert(Path(__file__).parents[1])
    plugins = ("unraisableexception", "xdist", "xdist.looponfail", "benchmark")
    no = [a for p in plugins for a in ("-p", f"no:{p}")]
    pytester.makepyfile(test_marked=_FIXTURE_TEST.format(marker=", compute=ComputeModel(flop_cost=1e-9)"))
    pytester.runpytest(*no, "-s", "test_marked.py").assert_outcomes(passed=1)
    pytester.makepyfile(test_plain=_FIXTURE_TEST.format(marker=""))
    pytester.runpytest(*no, "test_plain.py").assert_outcomes(passed=1)
    result = pytester.runpytest(*no, "test_plain.py", "--sim-compute", json.dumps(MODEL.to_dict()))
    result.assert_outcomes(passed=1)


def test_a_failing_fixture_test_prints_a_replay_command_that_carries_the_compute_model(
    pytester: pytest.Pytester,
) -> None:
    pytester.syspathinsert(Path(__file__).parents[1])
    plugins = ("unraisableexception", "xdist", "xdist.looponfail", "benchmark")
    no = [a for p in plugins for a in ("-p", f"no:{p}")]
    pytester.makepyfile(
        test_slow=_FIXTURE_TEST.format(marker="").replace(
            "FREE + COST if simulation.compute else FREE", "FREE"
        )
    )
    result = pytester.runpytest(*no, "test_slow.py", "--sim-compute", json.dumps(MODEL.to_dict()))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["replay: pytest test_slow.py::test_charged --sim-seed 0 *--sim-compute *flop_cost*"]
    )
