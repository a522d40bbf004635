"""Shrink a failure: hypothesis searches fault plans for one that loses an update, then shrinks it.

Uses the lost-update program of ``lost_update.py`` with a seed under which the default network never
loses an update (the trainers do not overlap), and asks hypothesis for a :class:`FaultPlan` under
which it does. ``hypothesis.find`` returns the *smallest* such plan it can shrink to, which is printed
with the one line that replays it.

Run it: ``python docs/examples/shrink_fault_plan.py``.
"""

from __future__ import annotations

from hypothesis import find, settings
from lost_update import STEPS, _servers, program
from twinrpc.simulator import FaultPlan, Simulation
from twinrpc.simulator.strategies import fault_plans

SEED = 0  # under this seed, with no faults, no update is lost


def loses_an_update(plan: FaultPlan) -> bool:
    _servers.clear()
    Simulation(world_size=3, seed=SEED, faults=plan).run(program).values()
    return _servers[0].value != 2 * STEPS


def main() -> None:
    assert not loses_an_update(FaultPlan())
    plan = find(
        fault_plans(world_size=3, kinds=("delay",), max_faults=3),
        loses_an_update,
        settings=settings(max_examples=2000, database=None, deadline=None),
    )
    print("smallest failing plan:", plan.describe())
    print(f"replay: Simulation(world_size=3, seed={SEED}, faults={plan!r}).run(program)")
    assert loses_an_update(plan)  # the replay fails the same way, every time


if __name__ == "__main__":
    main()
