"""Explore the lost update: find a failing run, shrink it, replay it, keep it as a regression test.

``explore`` runs the program of ``lost_update.py`` under seeds and fault plans drawn by hypothesis
(seeded: the same call explores the same runs), stops at the first run that fails, and shrinks it to
a minimal one that still fails the same way. The fix passes that very run.

Run it: ``python docs/examples/explore_lost_update.py``.
"""

from __future__ import annotations

from lost_update import STEPS, _servers, program
from twinrpc.simulator import Failure, explore, replay


def checked(rank: int, fixed: bool = False) -> None:
    """The program, plus the check that no update was lost (on the server, once all are done)."""
    program(rank, fixed)
    if rank == 0:
        value = _servers.pop(0).value
        assert value == 2 * STEPS, f"lost an update: the counter is {value}, expected {2 * STEPS}"


def main() -> None:
    # 1. Explore: at most 200 runs; the first failure is shrunk before explore raises it.
    try:
        explore(checked, 3, runs=200)
    except Failure as failure:
        print(failure)  # what failed, the minimal seed and fault plan, the replay command
        found = failure
    # 2. Replay the minimal run: it fails the same way, every time.
    try:
        replay(checked, 3, seed=found.seed, faults=found.faults)
    except AssertionError as exc:
        print(f"replayed: {str(exc).splitlines()[0]}")
    # 3. The fix passes that very run; keep it as a regression test.
    replay(checked, 3, seed=found.seed, faults=found.faults, args=(True,))
    print("fixed: the minimal run passes")
    print(found.to_pytest("test_no_update_is_lost").splitlines()[0])


if __name__ == "__main__":
    main()
