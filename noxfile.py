"""How people run everything: ``nox -l`` lists the sessions."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["tests"]
#: the gloo world's transport and failure tests (tests/gloo/test_gloo_*.py and the three named here, and
#: the hostile-peer ones of tests/security/), run again with the same-host path off
GLOO_TESTS = (
    "tests/gloo/test_gloo_*.py",
    "tests/security/test_gloo_*.py",
    "tests/gloo/test_failure_gloo.py",
    "tests/gloo/test_builtin_gloo.py",
    "tests/gloo/test_soak_gloo.py",
)
#: gloo test files that switch the same-host path on themselves, whatever the run's TWINRPC_SHM: the
#: run with it off would repeat them as they are
PATH_ON_TESTS = ("test_gloo_shm.py",)
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

BACKENDS = ("sim", "gloo", "torch")
#: the browser tests/sim/test_trace_html_browser.py drives (Debian's chromium package)
CHROMIUM = os.environ.get("TWINRPC_CHROMIUM", "/usr/bin/chromium")


def _install(session: nox.Session, extras: str = "test") -> None:
    """Install twinrpc (editable) with torch pinned by constraints.txt (a small CPU build)."""
    session.install("-e", f".[{extras}]", "-c", "constraints.txt")


def _workers() -> str:
    return os.environ.get("TWINRPC_XDIST", "2")


def _chromium(session: nox.Session) -> None:
    """Debian's chromium for the HTML trace test: installed with apt-get when missing (as root; CI runs
    as root, as .ci/run does for iproute2). Playwright drives it; no browser is downloaded."""
    if Path(CHROMIUM).exists():
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        session.error(
            f"no Chromium at {CHROMIUM}: install it (Debian: apt-get install -y chromium) or set "
            "TWINRPC_CHROMIUM to a Chromium binary"
        )
    session.run("apt-get", "update", "-q", external=True)
    session.run("apt-get", "install", "-y", "-q", "chromium", external=True)


@nox.session
def browser(session: nox.Session) -> None:
    """The HTML trace diagram in headless Chromium (installs Debian's chromium when missing)."""
    _install(session)
    _chromium(session)
    session.run("pytest", "tests/sim/test_trace_html_browser.py", "-q", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite: unit tests, the conformance suite on every backend, then the docs."""
    _install(session, "test,docs,train")
    _chromium(session)  # tests/sim/test_trace_html_browser.py runs with the rest, in CI too
    session.run("pytest", "tests", "-q", "-n", _workers(), *session.posargs)
    for backend in BACKENDS:
        _conformance(session, backend)
    # The gloo world once more as between hosts (every byte over gloo, no same-host rings): its own
    # tests, then the conformance suite, there with a job key too (every frame and rendezvous entry
    # authenticated). Together with the runs above, each switch is tested on and off.
    off = {"TWINRPC_SHM": "0"}
    gloo_tests = sorted(
        str(p.relative_to(ROOT))
        for pattern in GLOO_TESTS
        for p in ROOT.glob(pattern)
        if p.name not in PATH_ON_TESTS
    )
    session.run("pytest", *gloo_tests, "-q", "-n", _workers(), env=off)
    _conformance(session, "gloo", env={**off, "TWINRPC_AUTH_KEY": "nox tests job key"}, matrix=False)
    # The conformance matrix in the docs comes from the three runs above: all must be there.
    _build_docs(session, require_matrix=True)


@nox.session
def conformance(session: nox.Session) -> None:
    """The conformance suite on one backend: `nox -s conformance -- torch` (default: sim)."""
    _install(session)
    backend = session.posargs[0] if session.posargs else "sim"
    _conformance(session, backend, *session.posargs[1:])


def _conformance(
    session: nox.Session,
    backend: str,
    *extra: str,
    env: dict[str, str] | None = None,
    matrix: bool = True,
    silent: bool = False,
) -> None:
    """``matrix``: write the run's results for the docs' conformance matrix (one run per backend);
    ``silent``: show pytest's output only if the run fails."""
    report = ROOT / "build" / "conformance" / f"{backend}.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    session.run(
        "pytest",
        "conformance",
        "-q",
        "-n",
        _workers(),
        f"--backend={backend}",
        *([f"--matrix-json={report}"] if matrix else []),
        *extra,
        env=env,
        silent=silent,
    )


@nox.session
def docs(session: nox.Session) -> None:
    """The Sphinx docs in build/docs/html; first, quietly, the conformance runs its matrix still lacks.

    The conformance matrix is generated from build/conformance/<backend>.json: a backend whose JSON is
    missing is run first, its output shown only if it fails (`nox -s conformance -- <backend>`
    refreshes one by hand, with its output).
    """
    _install(session, "test,docs")
    missing = [b for b in BACKENDS if not (ROOT / "build" / "conformance" / f"{b}.json").is_file()]
    if missing:
        session.log(
            f"the conformance matrix needs a run of {', '.join(missing)}: running the suite on each first "
            "(a few minutes; output only on failure)"
        )
    for backend in missing:
        _conformance(session, backend, silent=True)
        session.log(f"conformance on {backend}: passed")
    _build_docs(session, require_matrix=True)


def _build_docs(session: nox.Session, *, require_matrix: bool) -> None:
    session.run(
        "sphinx-build",
        "-W",
        "--keep-going",
        "-n",
        "-q",
        "-b",
        "html",
        "docs",
        "build/docs/html",
        env={"TWINRPC_DOCS_REQUIRE_MATRIX": "1" if require_matrix else "0"},
    )
    session.log(f"docs: {ROOT / 'build' / 'docs' / 'html' / 'index.html'}")


@nox.session
def demo(session: nox.Session) -> None:
    """A first look: a small RPC program run on the simulator (examples/hello_simulator.py), printing what it did."""
    _install(session, "test")
    session.run("python", "examples/hello_simulator.py", *session.posargs)


@nox.session
def train(session: nox.Session) -> None:
    """The parameter-server training job: `nox -s train` (simulator), `nox -s train -- --world gloo`."""
    # with the `sim` extra, .nox/train is also the README's environment for `python -m twinrpc.simulator`
    _install(session, "train,sim")
    session.run("python", "examples/parameter_server.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (~60 min on 2 cores), written to benchmarks/results/ and the docs' results page.

    What runs: simulated round trips per wall-clock second; the gloo world vs TensorPipe vs raw gloo (ratios,
    alternating rounds); what a job key costs a call; the simulator's models fitted to gloo on one host
    and between two network namespaces, and the training job's simulated vs real time; 256 simulated
    workers training, and the simulator's cost per message at 2,048 workers against 256 (and the memory of
    8,192); distributed autograd vs TensorPipe; wake-ups, CPU and messages per operation vs
    TensorPipe; scale under torchrun vs TensorPipe (8 to 64 workers, each calling every peer or two of
    them: init, first calls, shutdown, threads, descriptors, memory); twinrpc between two namespaces
    vs the raw gloo floor there; parameter-server training
    vs TensorPipe and the reply hand-off; exploration throughput (runs per second) against the number
    of jobs; an RRef soak and a soak of calls, RRefs and autograd contexts
    on gloo.

    Posargs go to the simulator benchmark. The gloo soak (benchmarks/bench_soak.py, ~20 min) runs
    TWINRPC_SOAK_CALLS tiny calls (1,000,000), TWINRPC_SOAK_CYCLES RRef cycles and TWINRPC_SOAK_CONTEXTS
    autograd contexts (10,000) and checks memory, threads and descriptors stay flat. The RRef soak runs
    100,000 create/to_here/delete cycles on gloo
    (about 5 minutes) and prints owner-side state before and after; set
    TWINRPC_SOAK_CYCLES for a quicker look.
    """
    _install(session, "test,train")
    results = "benchmarks/results"
    session.run("python", "benchmarks/bench_simulator.py", *session.posargs)
    session.run("python", "benchmarks/bench_gloo.py", "--json", f"{results}/bench_gloo.json")
    session.run("python", "benchmarks/bench_auth.py", "--mac")
    network = "build/bench/network-calibrated.toml"
    session.run(
        "python",
        "benchmarks/bench_calibration.py",
        "--out",
        network,
        "--json",
        f"{results}/bench_calibration.json",
    )
    session.run("python", "benchmarks/bench_sim_scale.py", "--network", network)
    session.run(
        "python",
        "benchmarks/bench_sim_scale.py",
        *("--steps", "2", "--against", "2048", "--memory", "8192"),
        *("--json", f"{results}/bench_sim_scale.json"),
    )
    session.run(
        "python", "benchmarks/bench_dist_autograd.py", "--json", f"{results}/bench_dist_autograd.json"
    )
    session.run("python", "benchmarks/bench_wakeups.py", "--json", f"{results}/bench_wakeups.json")
    # TensorPipe's workers take 0.4-0.7 GB each: past 16 of them a 24 GB machine runs out of memory
    session.run(
        "python",
        "benchmarks/bench_scale.py",
        "--tensorpipe-up-to",
        "16",
        # three alternating launches per size: one launch's times swing by tens of percent
        "--repeat",
        "3",
        "--json",
        f"{results}/bench_scale.json",
    )
    session.run("python", "benchmarks/bench_two_hosts.py", "--json", f"{results}/bench_two_hosts.json")
    session.run("python", "benchmarks/bench_auth.py", "--two-hosts", "--json", f"{results}/bench_auth.json")
    session.run(
        "python", "benchmarks/bench_explore.py", "--runs", "1000", "--json", f"{results}/bench_explore.json"
    )
    session.run("python", "benchmarks/render_results.py", "--results", results)
    session.run("python", "benchmarks/bench_reply_hop.py")
    session.run("python", "benchmarks/bench_ps.py")
    cycles = os.environ.get("TWINRPC_SOAK_CYCLES", "100000")
    session.run("python", "benchmarks/bench_rref_soak.py", "--world", "gloo", "--cycles", cycles)
    calls = os.environ.get("TWINRPC_SOAK_CALLS", "1000000")
    contexts = os.environ.get("TWINRPC_SOAK_CONTEXTS", "10000")
    session.run(
        "python", "benchmarks/bench_soak.py", "--calls", calls, "--rrefs", cycles, "--contexts", contexts
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy (strict) on the twinrpc package, simulator included, and on the public conformance harness."""
    _install(session, "test,dev")
    # mypy cannot follow setuptools' package-dir mapping, so check a tree of links that has the
    # import layout (twinrpc/, twinrpc/simulator/, twinrpc/impl/).
    tree = ROOT / "build" / "mypy-tree"
    pkg = tree / "twinrpc"
    if pkg.exists():
        for link in (pkg / "simulator", pkg / "impl"):
            if link.is_symlink():
                link.unlink()
        for item in sorted(pkg.iterdir()):
            if item.is_symlink():
                item.unlink()
    pkg.mkdir(parents=True, exist_ok=True)
    for item in sorted((ROOT / "src" / "twinrpc").iterdir()):
        if item.name != "__pycache__":
            (pkg / item.name).symlink_to(item)
    (pkg / "simulator").symlink_to(ROOT / "simulator")
    (pkg / "impl").symlink_to(ROOT / "impl")
    session.run("mypy", "-p", "twinrpc", env={"MYPYPATH": str(tree)})
    # the conformance harness is public (third-party backends build on it): typed as strictly
    session.run("mypy", "--strict", "conformance/harness", "docs/examples/slow_network_backend.py")


@nox.session
def explore(session: nox.Session) -> None:
    """Long RRef exploration on the simulator: `nox -s explore -- 20000` generated workload/schedule pairs."""
    _install(session)
    examples = session.posargs[0] if session.posargs else "20000"
    session.run(
        "pytest",
        "tests/properties/test_rref_properties.py",
        "-q",
        "-k",
        "generated",
        "--hypothesis-show-statistics",
        env={"TWINRPC_RREF_EXAMPLES": examples},
    )


@nox.session
def twin(session: nox.Session) -> None:
    """Differential twin test, long run: `nox -s twin -- --programs 500 [--departures all] [--seeds 5]`.

    Generated RPC programs run on the simulator (every seed) and in gloo processes; any disagreement
    fails with the shrunk program. ``--departures`` adds workers leaving (``all``, or a comma-separated
    subset of leave, leave-graceful, kill); other arguments go to pytest.
    """
    _install(session)
    options = {"--programs": "TWIN_PROGRAMS", "--departures": "TWIN_DEPARTURES", "--seeds": "TWIN_SEEDS"}
    env = {"TWIN_PROGRAMS": "500"}
    args = list(session.posargs)
    rest = []
    while args:
        arg = args.pop(0)
        name, _, value = arg.partition("=")
        if name in options:
            env[options[name]] = value or args.pop(0)
        else:
            rest.append(arg)
    # One test runs every program: the per-test faulthandler dump (pyproject) would fire mid-run.
    session.run(
        "pytest",
        "tests/twin/test_twin_differential.py",
        "-q",
        "--hypothesis-show-statistics",
        "-o",
        "faulthandler_timeout=0",
        *rest,
        env=env,
    )
