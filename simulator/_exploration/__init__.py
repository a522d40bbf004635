"""Exploration: many seeds and fault plans searched for a failure, shrunk, and replayed.

``_explore`` holds :func:`~twinrpc.simulator.explore`, :func:`~twinrpc.simulator.replay` and the
failure report that prints the replay command.
"""
