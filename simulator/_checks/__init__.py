"""Checks that watch a run: online RRef monitors and the determinism check.

``_monitors`` checks the RRef protocol invariants at every RRef event (it raises
:class:`~twinrpc.simulator.MonitorViolation`); ``_determinism`` runs a scenario twice with one seed and
points at the first difference (:func:`~twinrpc.simulator.check_determinism`).
"""
