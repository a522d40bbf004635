"""Exploration: many seeds and fault plans searched for a failure, shrunk, and replayed.

``_case`` is one run (a seed, a fault plan, network and compute models) and
:func:`~twinrpc.simulator.replay`; ``_signature`` says what "the same failure" is; ``_search`` draws
cases with hypothesis, caches verdicts and shrinks; ``_explore`` is
:func:`~twinrpc.simulator.explore`; ``_failure`` the :class:`~twinrpc.simulator.Failure` it reports;
``_reproduce`` the replay command and regression test a failure prints; ``_parallel`` an exploration
cut into blocks of runs for worker processes and shards (``explore --jobs``/``--shard``). ``_rref_workload`` is the RRef
property tests' own workload (lists of RRef operations, run with the monitors on).
"""
