"""The gloo world's opt-in recorder (``TWINRPC_TRACE=dir``) and a structural diff against the simulator.

Multiprocess: one launch of two real workers (a few seconds of importing torch), then in-process
checks of the recorded files.
"""

from __future__ import annotations

import json
from pathlib import Path

import _trace_scenarios as scenarios
import pytest
from _launch import ROOT, free_port, run_workers
from twinrpc.simulator import Simulation, Trace, diff_traces
from twinrpc.simulator._cli import _main as cli

SCRIPT = ROOT / "tests" / "_trace_scenarios.py"
CALLS = 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("gloo-trace")
    results = run_workers(
        SCRIPT,
        str(CALLS),
        cwd=ROOT,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        TWINRPC_TRACE=str(where),
    )
    for res in results:
        res.check_clean()
    return where


def test_each_gloo_worker_writes_its_sends_and_deliveries_with_wall_clock_times(recorded: Path) -> None:
    assert sorted(p.name for p in recorded.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    lines = (recorded / "rank0.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["source"] == "gloo" and header["clock"] == "wall" and header["rank"] == 0
    assert header["workers"] == ["worker0", "worker1"]
    events = [json.loads(line) for line in lines[1:]]
    assert {e["e"] for e in events} == {"send", "deliver"}
    calls = [e for e in events if e["e"] == "send" and e["m"][0] == "CALL"]
    assert len(calls) == CALLS and all(e["w"] == 0 and e["m"][3] == 1 for e in calls)
    assert all(e["t"] > 1e9 for e in events)  # seconds since the epoch


def test_loading_the_directory_pairs_every_delivery_with_its_send(recorded: Path) -> None:
    trace = Trace.load(recorded)
    assert trace.source == "gloo" and trace.workers == ["worker0", "worker1"]
    events = trace.events()
    sends = {ev.message.seq: ev for ev in events if ev.event == "send"}
    for ev in events:
        if ev.event == "deliver":
            send = sends[ev.message.seq]  # paired
            assert send.index < ev.index
            assert all(x >= y for x, y in zip(ev.clock, send.clock, strict=True))


def test_simulation_and_gloo_run_of_one_program_match_structurally(recorded: Path) -> None:
    gloo = Trace.load(recorded)
    sim = Simulation(2, seed=0).run(scenarios.rpc_calls, 2, CALLS).trace
    assert diff_traces(sim, gloo) is not None  # times differ, of course
    # the calls and replies of each worker are the same sequence in both worlds
    assert diff_traces(sim, gloo, structural=True, kinds={"CALL", "RESPONSE"}) is None
    # one call more in the simulation: pointed at, on worker 0, after the shared prefix
    more = Simulation(2, seed=0).run(scenarios.rpc_calls, 2, CALLS + 1).trace
    div = diff_traces(more, gloo, structural=True, kinds={"CALL", "RESPONSE"})
    assert div is not None and div.worker == 0 and div.index == 2 * CALLS
    assert div.a is not None and div.a.detail.startswith(f"CALL#{CALLS} 0->1") and div.b is None


def test_cli_diffs_a_saved_simulation_against_the_recorded_directory(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "sim.jsonl"
    Simulation(2, seed=0).run(scenarios.rpc_calls, 2, CALLS).trace.save(saved)
    args = ["trace", "diff", "--structural", "--kinds", "CALL,RESPONSE", str(saved), str(recorded)]
    assert cli.main(args) == 0, capsys.readouterr()
    html = tmp_path / "gloo.html"
    assert cli.main(["trace", "export", "-f", "html", str(recorded), "-o", str(html)]) == 0
    assert "worker1" in html.read_text()
