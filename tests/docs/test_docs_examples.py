"""Every code example of the docs is a real file, and this module runs each of them.

The docs include code only with ``literalinclude`` from ``docs/examples/`` or ``examples/``; a
```python fence in a page is refused here, so no example can go stale unseen.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _warm_python import close, python

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True, scope="module")
def _warm_interpreter_closed_after_this_module() -> Iterator[None]:
    """The warm interpreter (tests/_warm_python.py) holds torch's memory: not for the other modules."""
    yield
    close()


def _process(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, warm: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` from the repository root, with docs/examples importable.

    ``warm``: forked from an interpreter that imported torch already (tests/_warm_python.py), for
    programs whose work happens in the processes they start (gloo worlds, torchrun). A program run on
    the simulator gets a new interpreter: its schedule depends on when Python's cyclic collector
    frees RRefs, so on the import history of the process, and the docs show what
    ``python x.py`` prints.
    """
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(ROOT)]), **(env or {})}
    if warm:
        return python(args, env=full_env, cwd=ROOT, timeout=timeout)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 300, warm: bool = False) -> str:
    proc = _process(*args, env=env, timeout=timeout, warm=warm)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _pages() -> list[Path]:
    return [p for p in DOCS.rglob("*.md") if "generated" not in p.parts and "_build" not in p.parts]


def test_pages_hold_no_inline_python_only_included_files():
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"^```(python|py|pycon)\s*$", text, re.MULTILINE), (
            f"{page.relative_to(ROOT)} has an inline Python block: put the code in docs/examples/ "
            "and literalinclude it, so tests/docs/test_docs_examples.py runs it"
        )


# Included by the docs and run elsewhere: examples/tutorials/rnn.py and examples/tutorials/ddp_rpc.py
# (tests/docs/test_tutorial_programs.py runs each PyTorch example program in three worlds).


def test_every_included_file_exists_and_is_run_here():
    this = Path(__file__).read_text(encoding="utf-8")
    for page in _pages():
        for target in re.findall(r"^```\{literalinclude\}\s+(\S+)", page.read_text(encoding="utf-8"), re.M):
            path = (page.parent / target).resolve()
            assert path.is_file(), f"{page.relative_to(ROOT)} includes missing {target}"
            assert path.name in this, f"{path.relative_to(ROOT)} is included by the docs but not run here"


# -- the explanation pages name only files that exist ------------------------------------------------
#: pages that point into the tree; a moved or renamed module must be renamed there too
MAP_PAGES = ("explanation/architecture.md", "explanation/gloo-world.md", "explanation/benchmarks.md")
_TREE_PATH = re.compile(
    r"(?<![\w/.])((?:src/twinrpc|simulator|impl|conformance|tests|docs|spec|benchmarks|examples)/[\w./*-]*\w)"
)
_TABLE_ROOT = re.compile(r"`((?:src/twinrpc|simulator|impl)/)`")
_CELL_FILE = re.compile(r"`([\w/]+(?:\.py|/))`")


def _missing_tree_paths(text: str) -> list[str]:
    """Paths of the repository ``text`` names that do not exist: every ``simulator/...``,
    ``src/twinrpc/...``, ``impl/...`` (and other top-level folders) path, with or without ``.py``, and
    in a table whose header names those folders, each cell's ``_module.py`` or ``package/`` under its
    column's folder."""
    missing = []
    for path in _TREE_PATH.findall(text):
        if "*" not in path and not any((ROOT / p).exists() for p in (path, path + ".py")):
            missing.append(path)
    roots: list[str | None] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            roots = []
            continue
        cells = line.strip().strip("|").split("|")
        if not roots:
            roots = [(m.group(1) if (m := _TABLE_ROOT.search(c)) else None) for c in cells]
            continue
        for root, cell in zip(roots, cells, strict=False):
            if root is None:
                continue
            for name in _CELL_FILE.findall(cell):
                if not _TREE_PATH.fullmatch(name) and not (ROOT / root / name).exists():
                    missing.append(root + name)
    return missing


def test_explanation_pages_name_only_files_that_exist():
    for page in MAP_PAGES:
        path = DOCS / page
        missing = _missing_tree_paths(path.read_text(encoding="utf-8")) if path.is_file() else [page]
        assert not missing, f"docs/{page} names files that do not exist: {missing}"


def test_a_wrong_path_on_a_map_page_is_caught():
    table = "| concept | core (`src/twinrpc/`) | sim (`simulator/`) |\n|---|---|---|\n"
    assert _missing_tree_paths(table + "| the world | `_world.py` | `_kernel/_scheduler.py` |\n") == []
    assert _missing_tree_paths(table + "| x | `_nowhere.py` | `_kernel/` |\n") == ["src/twinrpc/_nowhere.py"]
    assert _missing_tree_paths("see `simulator/_no_such_module.py` and impl/_link") == [
        "simulator/_no_such_module.py"
    ]


def test_hello_simulator():
    out = _run("examples/hello_simulator.py", "--seed", "3")
    assert "rpc_sync torch.add on worker1          -> [2.0, 2.0]" in out
    assert "digest" in out


def test_porting_on_the_simulator():
    assert _run("docs/examples/porting.py", "--world", "sim").strip() == "[10.0, 10.0, 10.0]"


def test_porting_on_gloo():
    assert _run("docs/examples/porting.py", "--world", "gloo", warm=True).strip() == "[10.0, 10.0, 10.0]"


# -- docs/howto/generations: each seed generation's program, in both worlds ---------------------------
GENERATION_1_4 = [
    "rpc_sync: [4.0, 4.0]",
    "rpc_async: [5.0, 5.0]",
    "remote: [6.0, 6.0]",
    "gradients: [9.0, 9.0]",
    "after step: [[3.95, 3.95], [1.95, 1.95]]",
    "worker: 1",
]
GENERATION_1_6 = [
    "async_add_chained: [3.0, 3.0]",
    "moved by: [0.1, 0.15]",
    "num_send_recv_threads: 4",
    "rpc_timeout: 20.0",
]
GENERATION_2 = ["last loss: 0.002", "weights: [1.989, -0.983, 0.48, 2.996]"]


@pytest.mark.parametrize("world", ["sim", "gloo"])
def test_pytorch_1_4_program_runs_unchanged(world: str) -> None:
    assert (
        _run("docs/examples/generation_1_4.py", "--world", world, warm=world == "gloo").splitlines()
        == GENERATION_1_4
    )


@pytest.mark.parametrize("world", ["sim", "gloo"])
def test_pytorch_1_6_program_runs_unchanged(world: str) -> None:
    assert (
        _run("docs/examples/generation_1_6.py", "--world", world, warm=world == "gloo").splitlines()
        == GENERATION_1_6
    )


@pytest.mark.parametrize("world", ["sim", "gloo"])
def test_pytorch_2_program_runs_unchanged(world: str) -> None:
    assert (
        _run("docs/examples/generation_2.py", "--world", world, warm=world == "gloo").splitlines()
        == GENERATION_2
    )


@pytest.mark.parametrize("world", ["sim", "gloo"])
def test_ddp_with_rpc_gradients_in_contexts_equal_local_ddp(world: str) -> None:
    lines = _run("docs/examples/ddp_rpc.py", "--world", world, warm=world == "gloo").splitlines()
    assert [line.split(", 'last loss'")[0] for line in lines] == [
        "trainer 0: {'fc gradients equal local DDP': True",
        "trainer 1: {'fc gradients equal local DDP': True",
    ]
    if world == "sim":  # the same seed gives the same run (docs/howto/ddp-with-rpc.md shows it)
        assert lines[0].endswith("'last loss': 2.3497}") and lines[1].endswith("'last loss': 3.5184}")


@pytest.mark.parametrize("world", ["sim", "gloo"])
def test_dynamic_group_trainers_join_and_leave_while_the_server_runs(world: str) -> None:
    lines = _run("docs/examples/dynamic_group.py", "--world", world, warm=world == "gloo").splitlines()
    assert lines == [
        "{'from': 'trainer1', 'value': 10, 'group': ['server', 'trainer1']}",
        "{'from': 'trainer2', 'value': 20, 'group': ['server', 'trainer2']}",
        "group at the end: ['server']",
    ]


# -- the parameter-server tutorial: the main job, examples/parameter_server.py, short runs ------------
# (tests/docs/test_dist_train_example.py trains it to its accuracy on the simulator)
def _parameter_server_short_run(world: str, out_dir: Path) -> dict[str, Any]:
    short = ["--epochs", "1", "--max-batches", "3", "--out-dir", str(out_dir)]
    out = _run("examples/parameter_server.py", "--world", world, *short, warm=world == "gloo")
    assert f"test images ({world})" in out, out
    result: dict[str, Any] = json.loads(
        (out_dir / f"result-{world}{'-seed0' if world == 'sim' else ''}.json").read_text()
    )
    assert result["world"] == world and set(result["final_loss"]) == {"1", "2"}, result
    return result


def test_parameter_server_on_the_simulator(tmp_path: Path) -> None:
    _parameter_server_short_run("sim", tmp_path)


def test_parameter_server_on_gloo(tmp_path: Path) -> None:
    # Once failed ~2 runs in 3: a worker that finished graceful shutdown closed its links and failed a
    # slower peer's last all-gather; fixed by orderly departures (b2061e9).
    _parameter_server_short_run("gloo", tmp_path)


def test_lost_update_is_found_replayed_and_fixed():
    out = _run("docs/examples/lost_update.py")
    assert "seeds 0..99: 8 lose an update, first: [2, 6, 13, 22, 26]" in out
    assert "seed 2: counter 5 instead of 6" in out
    assert "fixed: counter 6 on every seed 0..99" in out


def test_shrink_fault_plan_finds_a_one_fault_plan():
    out = _run("docs/examples/shrink_fault_plan.py")
    assert "smallest failing plan: FaultPlan(faults=[delay the 1st message by 0.0001s])" in out


def test_fault_plan():
    out = _run("docs/examples/fault_plan.py")
    assert "held link: RPCTimeoutError: RPC ran for more than set timeout (1000 ms)" in out
    assert "no faults:           [1, 2]" in out
    assert "first call delayed:  [2, 1] - FaultPlan(faults=[delay the 1st request 0->1 by 0.01s])" in out
    assert "lost reply: RPCTimeoutError: RPC ran for more than set timeout (1000 ms)" in out
    assert "partition healed: 3 after 2.000 s" in out
    # faults.toml: its lost reply times the call out
    assert "from faults.toml: FaultPlan(faults=[drop the 1st response 1->0; " in out
    assert out.count("swarm seed") == 2


def test_torchrun_program():
    out = _run(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "docs/examples/torchrun_program.py",
        warm=True,
    )
    assert "worker0: worker1 runs on" in out and "returned [1.0, 1.0]" in out
    assert "worker1: worker0 runs on" in out and "returned [2.0, 2.0]" in out


def test_restrict_unpickling_refuses_the_unlisted_call_and_serves_the_rest():
    out = _run("docs/examples/restrict_unpickling.py").splitlines()
    assert out == [
        "step: tensor([2., 2.])",
        "evil refused: True | nothing ran: True",
        "add: tensor([2., 2.])",
    ]


def test_auth_key_workers_with_the_same_key_work_and_with_different_keys_fail_init():
    out = _run("docs/examples/auth_key.py", warm=True).splitlines()
    assert out == [
        "same key:",
        "  rank 0: worker1 says 1 + 2 = 3",
        "different keys:",
        "  rank 0: init_rpc failed: AuthenticationError, mentions authentication: True",
        "  rank 1: init_rpc failed: AuthenticationError, mentions authentication: True",
    ]


def test_pause_a_peer_from_the_program_under_the_simulator_command():
    out = _run("-m", "twinrpc.simulator", "run", "--nproc-per-node", "2", "docs/examples/pause_a_peer.py")
    assert "[rank0]:worker1 answered after 5.0 s" in out


def test_slow_network_backend_runs_the_conformance_suite():
    # slow_network_backend.py: a sample of the suite (the whole suite on the sim backend is CI's job),
    # with its deviation SLOWNET-1 from slow_network_backend.deviations.toml as two strict xfails (the
    # deviations file's own checks: tests/harness/test_conformance_third_party.py)
    out = _run(
        "-m",
        "pytest",
        "conformance/test_timeouts.py",
        "conformance/test_rpc_calls.py",
        "conformance/test_futures.py",
        "-q",
        "-rxX",
        "-p",
        "no:cacheprovider",
        "--backend",
        "slow_network_backend:SlowNetworkBackend",
    )
    assert " passed, 2 xfailed" in out and "failed" not in out.replace("xfailed", "")
    assert (
        "XFAIL conformance/test_timeouts.py::test_default_rpc_timeout_is_60_seconds - SLOWNET-1 (ERR-4)"
        in out
    )


def test_explore_lost_update_finds_shrinks_replays_and_exports():
    out = _run("docs/examples/explore_lost_update.py")
    assert "twinrpc.simulator.explore: run 7 failed; shrunk in 7 more runs to seed 1117 and 0 faults" in out
    assert (
        "replay: python -m twinrpc.simulator replay docs/examples/explore_lost_update.py:checked --world-size 3 --seed 1117"
        in out
    )
    assert "replayed: lost an update: the counter is 5, expected 6" in out
    assert "fixed: the minimal run passes" in out
    assert '"""Regression test exported by twinrpc.simulator (explore, then shrink).' in out


def test_lost_update_sim_runs_once_and_is_explored_with_the_simulation_fixture():
    test = "docs/examples/test_lost_update_sim.py"
    out = _run("-m", "pytest", test, "-q", "-p", "no:cacheprovider", "--rootdir", "docs/examples")
    assert "1 passed" in out
    args = ("-m", "pytest", test, "-q", "-p", "no:cacheprovider", "--rootdir", "docs/examples")
    proc = _process(*args, "--sim-explore", "200")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "lost an update: the counter is" in proc.stdout
    assert (
        "replay: pytest docs/examples/test_lost_update_sim.py::test_no_update_is_lost --sim-seed "
        in proc.stdout
    )


def test_calibrate_network_recovers_a_known_model_from_the_simulator(tmp_path: Path) -> None:
    out = _run("docs/examples/calibrate_network.py", "--world", "sim", "--out", str(tmp_path / "net.toml"))
    assert "bandwidth 1.500 GB/s" in out and "rms relative error 0.0%" in out
    from twinrpc.simulator import NetworkModel

    model = NetworkModel.load(tmp_path / "net.toml")
    assert abs(model.message_cost - 30e-6) < 1e-6 and abs(model.latency - 80e-6) < 2e-6


def test_calibrate_network_on_gloo_writes_a_model(tmp_path: Path) -> None:
    out = _run(
        "docs/examples/calibrate_network.py",
        "--world",
        "gloo",
        "--quick",
        "--out",
        str(tmp_path / "n.json"),
        warm=True,
    )
    assert "rms relative error" in out
    from twinrpc.simulator import NetworkModel

    assert NetworkModel.load(tmp_path / "n.json").bandwidth > 0


def test_read_a_trace_prints_saves_compares_and_checks_determinism() -> None:
    out = _run("docs/examples/read_a_trace.py").splitlines()
    shown = {  # the lines the how-to shows
        "     5  0.001000000  worker0     link                   rank 0 sets up its link to rank 1  [4, 0]",
        "    13  0.001453516  worker1     deliver                CALL#0 0->1 (125 B)  "
        "<- sent by worker0 at 0.001400000 (+53.516 us)  [6, 8]",
        "traces diverge at event #0, t=0.000000000, worker 1:",
        "    #3      0.000000000 w1 init worker1 generation 0",
    }
    assert shown <= set(out), out
    assert (
        out[16].startswith("saved and loaded: 60 events")
        and out[-1] == "check_determinism: seed 7 twice, the same trace"
    )


# -- the race tutorial (docs/tutorials/ps-race.md): docs/examples/ps_race.py ---------------------------
PS_RACE = "docs/examples/ps_race.py"
RACE = "one of the variables needed for gradient computation has been modified by an inplace operation"


def _simulator(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m twinrpc.simulator ARGS`` from the repository root, as the tutorial runs it."""
    return _process("-m", "twinrpc.simulator", *args)


def test_ps_race_runs_once_and_passes_with_seed_0() -> None:
    run = _simulator("run", "--nproc-per-node", "3", PS_RACE)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == [
        "[rank1]:Trainer 1: 5 batches, last loss 1.4940",
        "[rank2]:Trainer 2: 5 batches, last loss 1.5012",
    ]


def test_the_fixed_ps_race_passes_with_the_server_paused_while_the_group_forms(tmp_path: Path) -> None:
    # The run bench_explore stopped at: the server paused from t=40 us (before init_rpc completes at
    # 1 ms) to 2.04 ms. The trainers' first calls wait for it instead of finding it "not initialised".
    plan = tmp_path / "pause.json"
    plan.write_text('{"faults": [{"type": "pause", "worker": 0, "duration": 0.002, "at": 4e-05}]}')
    run = _simulator("run", "--nproc-per-node", "3", "--seed", "0", "--faults", str(plan), PS_RACE, "--fixed")
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(run.stdout.splitlines()) == [
        "[rank1]:Trainer 1: 5 batches, last loss 1.4940",
        "[rank2]:Trainer 2: 5 batches, last loss 1.5012",
    ]


def test_ps_race_is_found_shrunk_replayed_and_drawn_and_the_pinned_bug_still_fails(tmp_path: Path) -> None:
    # 2-3. The tutorial's exploration (with --expect fail and another --out: the same runs, the same
    # output; the regression test it writes pins the bug instead of asserting the fix).
    found = tmp_path / "found"
    explore = _simulator("explore", "--nproc-per-node", "3", "--expect", "fail", "--out", str(found), PS_RACE)
    out = explore.stdout
    assert explore.returncode == 1, out + explore.stderr
    assert "twinrpc.simulator.explore: run 17 failed; shrunk in 28 more runs to seed 0 and 1 fault" in out
    assert "  error: RuntimeError raised by worker 1 at t=0.002873 s" in out and RACE in out
    assert "  minimal faults: FaultPlan(faults=[delay the 1st message by 0.001s])" in out
    assert (
        f"  replay: python -m twinrpc.simulator run --nproc-per-node 3 --seed 0 --faults {found}/faults.json "
        f"{PS_RACE}" in out
    )
    # 3-4. The replay command the page shows (with the committed plan), writing the trace.
    trace = tmp_path / "race.jsonl"
    replay = _simulator(
        "run", "--nproc-per-node", "3", "--seed", "0", "--faults",
        "docs/examples/ps_race_found/faults.json", "--trace", str(trace), PS_RACE,
    )  # fmt: skip
    assert replay.returncode == 1 and f"[rank1]:RuntimeError: Error on Node 0: {RACE}" in replay.stderr
    # trainer 2 finishes: the server keeps serving it after trainer 1 died, until it reaches shutdown (SHUT-7)
    assert replay.stdout.splitlines() == ["[rank2]:Trainer 2: 5 batches, last loss 1.5017"]
    assert (
        "[rank2]:twinrpc._errors.WorkerUnavailableError: the shutdown leader parameter_server aborted "
        "_all_gather: worker 'trainer_1' (rank 1) is unavailable" in replay.stderr
    )
    _check_the_step_lands_between_forward_and_backward(trace)
    html = tmp_path / "race.html"
    export = _simulator("trace", "export", "--format", "html", str(trace), "-o", str(html))
    assert export.returncode == 0 and "441 events" in html.read_text(encoding="utf-8")
    # the tutorial's figure, made the same way (headless Chromium; exit status 1 on a console error)
    png = tmp_path / "race.png"
    out = _run("docs/examples/trace_screenshot.py", str(html), str(png), "--window", "240", "330",
               "--select", "44", "--hide", "rref")  # fmt: skip
    assert f"wrote {png}" in out and png.read_bytes().startswith(b"\x89PNG")
    # 6. The exported test pins the bug: the unfixed program still fails the known way.
    test = found / "test_ps_race_regression.py"
    assert "The run still fails the known way" in test.read_text(encoding="utf-8")
    _exported_test(test)(tmp_path)


def _check_the_step_lands_between_forward_and_backward(path: Path) -> None:
    """What the tutorial reads in the diagram: on the server, trainer 1's forward (CALL#3), trainer 2's
    optimizer step (CALL#17), trainer 1's backward (GRADIENT#8), which the server answers with an error;
    and nothing orders the step after that backward or before that forward (vector clocks)."""
    from twinrpc.simulator import Trace

    events = Trace.load(path).events()
    server = [
        (i, ev.detail) for i, ev in enumerate(events) if ev.worker == 0 and ev.event in ("deliver", "send")
    ]
    lines = [f"#{i} {detail}" for i, detail in server if 247 <= i <= 310]
    forward = lines.index("#261 CALL#3 1->0 (847 B)")
    step = lines.index("#282 CALL#17 2->0 (265 B)")
    backward = lines.index("#308 GRADIENT#8 1->0 (204 B)")
    # (the exception's size depends on the paths in its traceback: not checked)
    assert forward < step < backward and lines[-1].startswith("#310 EXCEPTION#8 0->1 ("), lines
    step_sent, backward_sent = events[258].clock, events[297].clock
    assert events[258].detail == "CALL#17 2->0 (265 B)" and events[297].detail == "GRADIENT#8 1->0 (204 B)"
    assert step_sent is not None and backward_sent is not None
    pairs = list(zip(step_sent, backward_sent, strict=True))
    assert any(a > b for a, b in pairs) and any(a < b for a, b in pairs), pairs  # concurrent


def _exported_test(path: Path) -> Any:
    """The test function of an exported regression test file (it runs the program in a subprocess)."""
    namespace = runpy.run_path(str(path))
    (name,) = [name for name in namespace if name.startswith("test_")]
    return namespace[name]


def test_ps_race_regression_test_passes_with_the_fix(tmp_path: Path) -> None:
    # docs/examples/ps_race_found/test_ps_race_regression.py: written by the tutorial's explore command,
    # run with --fixed (see its PROGRAM_ARGS)
    _exported_test(EXAMPLES / "ps_race_found" / "test_ps_race_regression.py")(tmp_path)
