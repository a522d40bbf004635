"""The network model: per-link latency with seeded jitter, and bandwidth."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NetworkModel:
    """How long a message takes: ``latency + uniform(0, jitter) + nbytes / bandwidth``.

    Jitter makes messages of one link overtake each other (PyTorch promises no ordering, RPC-11).
    Defaults are in the range of two processes on one host.

    Args:
        latency: fixed one-way delay in seconds.
        jitter: extra delay drawn uniformly from [0, jitter) with the simulation's seeded RNG.
        bandwidth: bytes per second.
        loopback_latency: one-way delay of a message a worker sends to itself.
        failure_detection: how long after a worker crashes its peers learn of it (the real world
            sees a closed connection within milliseconds of a process dying).
    """

    latency: float = 50e-6
    jitter: float = 20e-6
    bandwidth: float = 2e9
    loopback_latency: float = 5e-6
    failure_detection: float = 1e-3

    def delay(self, src: int, dst: int, nbytes: int, rng: random.Random) -> float:
        if src == dst:
            return self.loopback_latency + nbytes / self.bandwidth
        return self.latency + rng.random() * self.jitter + nbytes / self.bandwidth
