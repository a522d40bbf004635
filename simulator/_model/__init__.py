"""The simulator's ground floor: the plain data a simulation is described by, and its file forms.

Frozen values that know nothing of the engine that runs them: the fault kinds and
:class:`~twinrpc.simulator.FaultPlan` (``_plan``), :class:`~twinrpc.simulator.Swarm` (``_swarm``),
:class:`~twinrpc.simulator.NetworkModel` (``_network``), :class:`~twinrpc.simulator.ComputeModel`
(``_compute``), their dicts, JSON and TOML (``_codec``, and ``_files`` for ``--faults FILE`` and flag
values) and the error they raise (``_errors``). Nothing here imports the rest of the simulator
(tests/architecture/test_sim_boundaries.py): the kernel, the network, the fault engine and the entry points stand
on it.
"""
