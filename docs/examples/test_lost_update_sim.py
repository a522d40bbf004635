"""The lost update as a pytest test that runs its program through the ``simulation`` fixture.

``pytest docs/examples/test_lost_update_sim.py`` runs it once (seed 0, no fault: it passes);
``--sim-explore 200`` runs it over 200 seeds and fault plans and shrinks the first failure;
``--sim-export DIR`` writes that failure as a regression test.
"""

from __future__ import annotations

from lost_update import STEPS, _servers, program


def test_no_update_is_lost(simulation):
    _servers.clear()
    simulation.run(program, 3)
    assert _servers[0].value == 2 * STEPS, f"lost an update: the counter is {_servers[0].value}"
