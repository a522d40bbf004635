"""``python -m twinrpc.simulator run --check-determinism``: run the program twice, compare the runs.

A seed is only worth printing if it replays the run. Under ``run`` time is virtual and torch's,
NumPy's and Python's global generators are seeded from ``--seed``, but a program can still read
entropy the command does not control (``os.urandom``, ``secrets``, ``uuid.uuid4``,
``random.SystemRandom``), order work by ``id()``, read the real clock through ``datetime.now()``, run
OS threads, or depend on files and other state outside the run. This runs the program twice with the
same options, as :func:`~twinrpc.simulator.check_determinism` does for a function, and compares the
two traces event by event and the workers' exit codes; the first difference is printed with the
events around it in each run.
"""

from __future__ import annotations

import dataclasses
import io
import sys
from typing import TextIO

from .._traces._diff import diff_traces
from ._launch import LaunchOptions, launch

#: what the report says to look for when the runs differ
CAUSES = (
    "entropy the command does not seed (os.urandom, secrets, uuid.uuid4, random.SystemRandom), "
    "id()-ordered sets or dicts, datetime.now(), OS threads, or files and other state outside the run"
)


def launch_twice(
    options: LaunchOptions, *, stdout: TextIO | None = None, stderr: TextIO | None = None, context: int = 3
) -> int:
    """Run the program as ``launch`` does, then once more with the same options, its output
    discarded, and compare the two runs.

    Returns:
        The exit status: 1 when the runs differ (the first divergence is printed on ``stderr``),
        otherwise the first run's own status (0 iff every worker exited 0).
    """
    err = stderr if stderr is not None else sys.stderr
    first = launch(options, stdout=stdout, stderr=stderr)
    quiet = io.StringIO()
    second = launch(dataclasses.replace(options, trace=None), stdout=quiet, stderr=quiet)
    seed = options.seed
    divergence = diff_traces(first.trace, second.trace, context=context)
    if divergence is not None:
        print(
            f"twinrpc.simulator: the run is not deterministic: two runs with seed {seed} differ "
            f"({len(first.trace)} vs {len(second.trace)} trace events). Look for {CAUSES}.\n"
            + divergence.describe(("run 1", "run 2")),
            file=err,
        )
        return 1
    if first.exitcodes != second.exitcodes:
        print(
            f"twinrpc.simulator: the run is not deterministic: two runs with seed {seed} recorded the "
            f"same trace but the workers exited differently: run 1 {list(first.exitcodes)}, run 2 "
            f"{list(second.exitcodes)} (exit code per rank; None: did not exit). Look for {CAUSES}.",
            file=err,
        )
        return 1
    print(
        f"twinrpc.simulator: deterministic: two runs with seed {seed} recorded the same "
        f"{len(first.trace)} trace events and exit codes",
        file=err,
    )
    return first.status
