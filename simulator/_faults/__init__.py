"""Faults as plain data and the engine that applies them.

``_plan`` holds the fault values (:class:`~twinrpc.simulator.FaultPlan`, ``Drop``, ``Crash``, ...),
``_swarm`` draws a plan from the seed, and ``_engine`` applies a plan (and the fault verbs) to the
messages and workers of one run. Their file format (dicts, JSON, TOML), shared with the network and
compute models, is ``simulator/_files.py``.
"""
