"""The fault engine: what applies a fault plan (and the fault verbs) to one run.

The fault values themselves (:class:`~twinrpc.simulator.FaultPlan`, ``Drop``, ``Crash``, ...,
:class:`~twinrpc.simulator.Swarm`) and their file forms are plain data in ``simulator/_model/``;
``_engine`` applies them to the messages and workers of one run.
"""
