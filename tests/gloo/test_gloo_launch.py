"""Launching twinrpc's gloo world the ways PyTorch users launch jobs (LIFE-4, LIFE-5, LIFE-6).

Multiprocess tests: each starts fresh interpreters (a few seconds of importing torch each), so each
test packs a whole sequence of worlds into one launch and prints a line per step. Bad launch input is
checked in-process (nothing is opened before it is refused).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from _launch import ROOT, base_env, free_port, run_all, run_workers
from twinrpc.impl import LaunchError

import twinrpc.rpc as rpc

WORKER = ROOT / "tests" / "_launch_worker.py"
EXAMPLE = ROOT / "examples" / "torch_program.py"
PORTER = ROOT / "examples" / "port_imports.py"


def _lines(results: list, rank: int) -> list[str]:
    return results[rank].stdout.splitlines()


# -- rendezvous, re-initialisation, clean exit -------------------------------------------------------
@pytest.mark.spec("LIFE-4", "LIFE-6")
def test_env_tcp_and_file_init_methods_and_reinit_after_graceful_shutdown(tmp_path: Path) -> None:
    """env:// reads RANK/MASTER_*; then tcp:// and file:// worlds one after another."""
    start = time.monotonic()
    results = run_workers(
        WORKER,
        "reinit",
        str(tmp_path),
        str(free_port()),
        cwd=ROOT,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    for r, res in enumerate(results):
        res.check_clean()
        assert _lines(results, r) == [
            f"rank {r}: env:// ok",
            f"rank {r}: re-init 1 tcp:// ok",
            f"rank {r}: re-init 2 file:// ok",
            f"rank {r}: re-init 3 file:// ok",
        ], res.describe()
    assert time.monotonic() - start < 120


@pytest.mark.spec("SHUT-3")
def test_a_program_that_exits_without_shutdown_exits_cleanly_while_its_peer_still_talks() -> None:
    """Exiting without rpc.shutdown() (an exception in the training loop, a forgotten call) while a
    peer's heartbeats keep arriving: no abort at interpreter exit on either side."""
    results = run_workers(
        WORKER,
        "exit-without-shutdown",
        cwd=ROOT,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    for r, res in enumerate(results):
        res.check_clean()
        assert _lines(results, r) == [f"rank {r}: rpc ok", f"rank {r}: exiting without shutdown ok"], (
            res.describe()
        )


# -- a user's own default process group beside RPC ---------------------------------------------------
@pytest.mark.spec("LIFE-6")
def test_user_process_group_on_the_same_file_works_beside_rpc_in_either_order(tmp_path: Path) -> None:
    results = run_workers(WORKER, "pg-same-file", str(tmp_path), cwd=ROOT)
    for r, res in enumerate(results):
        res.check_clean()
        assert _lines(results, r) == [
            f"rank {r}: pg-then-rpc: pg ok",
            f"rank {r}: pg-then-rpc: rpc ok",
            f"rank {r}: pg-then-rpc: pg after rpc shutdown ok",
            f"rank {r}: rpc-then-pg: rpc ok",
            f"rank {r}: rpc-then-pg: pg ok",
            f"rank {r}: rpc-then-pg: rpc after destroy_process_group ok",
        ], res.describe()
    # FileStore counts its users: the file both used is deleted once the last one closes it.
    assert not (tmp_path / "pg-then-rpc").exists()


@pytest.mark.spec("LIFE-6")
def test_user_process_group_on_the_same_master_port_works_beside_rpc_in_either_order() -> None:
    """Including a default group over the user's own TCPStore, where PyTorch's RPC hits EADDRINUSE."""
    results = run_workers(
        WORKER,
        "pg-same-port",
        str(free_port()),
        str(free_port()),
        cwd=ROOT,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    for r, res in enumerate(results):
        res.check_clean()
        assert _lines(results, r) == [
            f"rank {r}: pg-then-rpc: pg ok",
            f"rank {r}: pg-then-rpc: rpc ok",
            f"rank {r}: pg-then-rpc: rpc after destroy_process_group ok",
            f"rank {r}: rpc-then-pg: rpc ok",
            f"rank {r}: rpc-then-pg: pg ok",
            f"rank {r}: rpc-then-pg: pg after rpc shutdown ok",
            f"rank {r}: own-store: pg ok",
            f"rank {r}: own-store: rpc ok",
            f"rank {r}: own-store: rpc after destroy_process_group ok",
        ], res.describe()


# -- a torch.distributed.rpc program ported by its imports -------------------------------------------
def test_port_imports_changes_only_import_lines(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from port_imports import port_source
    finally:
        sys.path.remove(str(ROOT / "examples"))
    source = EXAMPLE.read_text()
    ported = port_source(source)
    changed = [(a, b) for a, b in zip(source.splitlines(), ported.splitlines(), strict=True) if a != b]
    assert changed == [("import torch.distributed.rpc as rpc", "import twinrpc.rpc as rpc")]
    assert port_source("from torch.distributed.rpc import rpc_sync\n") == "from twinrpc.rpc import rpc_sync\n"
    assert port_source("import torch.distributed.rpc_x\n") == "import torch.distributed.rpc_x\n"


@pytest.mark.parametrize("launcher", ["torchrun", "mp.spawn"])
def test_torch_rpc_program_runs_on_twinrpc_by_changing_only_its_imports(
    tmp_path: Path, launcher: str
) -> None:
    """examples/torch_program.py on PyTorch and its import-ported copy on twinrpc print the same."""
    twin = tmp_path / "twin_program.py"
    results = run_all([([sys.executable, str(PORTER), str(EXAMPLE), str(twin)], base_env())], ROOT)
    results[0].check_clean()
    commands = []
    for program in (EXAMPLE, twin):
        if launcher == "torchrun":
            args = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(program),
            ]
        else:  # the program calls torch.multiprocessing.spawn itself when RANK is not set
            args = [sys.executable, str(program)]
        commands.append((args, base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))))
    on_torch, on_twinrpc = run_all(commands, ROOT)
    on_torch.check_clean(tracebacks=True)  # PyTorch logs the remote ValueError's traceback on worker1
    on_twinrpc.check_clean()
    assert on_torch.stdout.splitlines()[-1] == "shut down cleanly", on_torch.describe()
    assert "remote error: ValueError mentions the message: True" in on_torch.stdout
    assert on_twinrpc.stdout == on_torch.stdout, f"{on_torch.describe()}\n{on_twinrpc.describe()}"


# -- bad launch input ----------------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _init(init_method: str, **kwargs: object) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=1)
    rpc.init_rpc("w0", rpc_backend_options=options, **kwargs)  # type: ignore[arg-type]


@pytest.mark.spec("LIFE-4", "LIFE-5")
@pytest.mark.parametrize(
    ("init_method", "kwargs", "env", "fragments"),
    [
        ("env://", {"rank": 0, "world_size": 1}, {}, ["MASTER_ADDR and MASTER_PORT", "torchrun sets both"]),
        ("env://", {"rank": 0, "world_size": 1}, {"MASTER_ADDR": "127.0.0.1"}, ["needs MASTER_PORT"]),
        (
            "env://",
            {"rank": 0, "world_size": 1},
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
            ["MASTER_PORT must be an integer, got 'http'"],
        ),
        ("file:///tmp/x", {"world_size": 2}, {}, ["needs this worker's rank", "set RANK"]),
        ("file:///tmp/x", {}, {}, ["needs this worker's rank", "set RANK"]),  # a dynamic group too
        ("file:///tmp/x", {}, {"RANK": "one", "WORLD_SIZE": "2"}, ["RANK must be an integer, got 'one'"]),
        (
            "file:///tmp/x?world_size=2",
            {"rank": 0},
            {},
            ["has world_size= in its query but init_rpc got no world_size", "pass world_size to init_rpc"],
        ),
        ("env://", {"rank": 0}, {}, ["MASTER_ADDR and MASTER_PORT"]),  # dynamic: same checks
        (
            "file:///tmp/x",
            {"rank": 2, "world_size": 2},
            {},
            ["rank 2 is outside the world of size 2", "0 to 1"],
        ),
        ("file:///tmp/x", {"world_size": 2}, {"RANK": "3"}, ["rank 3 is outside the world of size 2"]),
        ("file:///tmp/x", {"rank": 0, "world_size": -1}, {}, ["world_size must be at least 1, got -1"]),
        (
            "nccl://host:1",
            {"rank": 0, "world_size": 1},
            {},
            ["unknown init_method 'nccl://host:1'", "tcp://"],
        ),
        ("/tmp/rendezvous", {"rank": 0, "world_size": 1}, {}, ["unknown init_method", "file:///"]),
        ("tcp://127.0.0.1", {"rank": 0, "world_size": 1}, {}, ["needs a host and a port"]),
        ("tcp://127.0.0.1:99999", {"rank": 0, "world_size": 1}, {}, ["needs a host and a port"]),
        # PyTorch hangs for ever here (FileStore retries opening the file without a timeout).
        (
            "file:///no/such/dir/f",
            {"rank": 0, "world_size": 1},
            {},
            ["'/no/such/dir' of init_method", "create"],
        ),
    ],
)
def test_bad_launch_input_says_what_is_wrong_and_how_to_fix_it(
    clean_env: pytest.MonkeyPatch,
    init_method: str,
    kwargs: dict[str, object],
    env: dict[str, str],
    fragments: list[str],
) -> None:
    for var, value in env.items():
        clean_env.setenv(var, value)
    with pytest.raises(LaunchError) as info:
        _init(init_method, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)
    # Both what PyTorch raises for a missing variable (ValueError) and for a bad scheme (RuntimeError).
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.get_worker_info()


@pytest.mark.spec("LIFE-4")
def test_init_names_the_ranks_that_never_joined_when_it_times_out(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    start = time.monotonic()
    with pytest.raises(
        rpc.RPCTimeoutError, match=r"timed out after 1 s waiting for rank\(s\) \[1, 2\] of a world of 3"
    ):
        _init(f"file://{tmp_path}/rendezvous", rank=0, world_size=3)
    assert time.monotonic() - start < 10
    # The failed attempt left nothing that makes a retry look like a stale run.
    with pytest.raises(rpc.RPCTimeoutError, match="timed out"):
        _init(f"file://{tmp_path}/rendezvous", rank=0, world_size=3)


@pytest.mark.spec("LIFE-4")
def test_init_refuses_a_file_left_over_from_an_earlier_run(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch.distributed as dist

    path = tmp_path / "rendezvous"
    leftover = dist.FileStore(str(path), 1)
    dist.PrefixStore("twinrpc/0", leftover).set("name/0", "w0")
    with pytest.raises(LaunchError, match="already holds rank 0's name from an earlier run"):
        _init(f"file://{path}", rank=0, world_size=2)


@pytest.mark.spec("LIFE-4")
def test_unreachable_master_is_reported_with_the_address(clean_env: pytest.MonkeyPatch) -> None:
    port = free_port()  # nothing listens there
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(port))
    with pytest.raises(rpc.RPCError, match=f"could not open the rendezvous store at 127.0.0.1:{port}"):
        _init("env://", rank=1, world_size=2)
