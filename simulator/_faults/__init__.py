"""Faults as plain data and the engine that applies them.

``_plan`` holds the fault values (:class:`~twinrpc.simulator.FaultPlan`, ``Drop``, ``Crash``, ...),
``_swarm`` draws a plan from the seed, ``_files`` reads and writes plans, swarms and models as dicts,
JSON and TOML, and ``_engine`` applies a plan (and the fault verbs) to the messages and workers of one
run.
"""
