"""The network model: per-link latency with seeded jitter, bandwidth, and failure detection delays."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import FaultPlanError


@dataclass(frozen=True, slots=True)
class NetworkModel:
    """How long a message takes: ``latency + uniform(0, jitter) + nbytes / bandwidth`` on the link,
    plus ``message_cost`` of work at each end.

    Jitter makes messages of one link overtake each other (PyTorch promises no ordering, RPC-11).
    Defaults are in the range of two processes on one host, with message handling free;
    ``benchmarks/bench_calibration.py`` fits ``latency``, ``jitter``, ``bandwidth`` and
    ``message_cost`` to the gloo world measured on this machine (docs: how-to "Calibrate the network
    model").

    Args:
        latency: fixed one-way delay in seconds.
        jitter: extra delay drawn uniformly from [0, jitter) with the simulation's seeded RNG.
        bandwidth: bytes per second.
        loopback_latency: one-way delay of a message a worker sends to itself.
        failure_detection: how long after a worker crashes its peers learn of it (the real world
            sees a closed connection within milliseconds of a process dying).
        heartbeat_timeout: how long a worker may hear nothing from a peer (the peer is paused, or the
            link is held or partitioned) before declaring it dead. ``None``, the default: each worker's
            own heartbeat options decide, in virtual time, as in the gloo world: the
            ``heartbeat_interval * heartbeat_misses`` seconds of the options it passed to ``init_rpc``
            (default 1 s x 10; never with ``heartbeat_interval=0``), and the default options while it
            has no agent (before ``init_rpc``, after ``shutdown``). A number overrides the options of
            every worker (0 = never), e.g. to explore short and long bounds without changing the
            program.
        message_cost: virtual seconds of work each message costs its sender (pickling, framing)
            before it leaves and its receiver (unpickling, dispatch) before its handler starts. A worker
            does this work for one message at a time, in order (one Python process holds one GIL), so
            a worker many peers talk to at once queues them: a busy parameter server slows down. It is
            deterministic (no wall clock). 0, the default, makes handling free: only the link delays
            messages. What handlers compute (the user's functions, autograd) is never charged.

    Raises:
        FaultPlanError: a value is negative or not a number (``heartbeat_timeout`` may also be
            ``None``), or ``bandwidth`` is 0.
    """

    latency: float = 50e-6
    jitter: float = 20e-6
    bandwidth: float = 2e9
    loopback_latency: float = 5e-6
    failure_detection: float = 1e-3
    heartbeat_timeout: float | None = None
    message_cost: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "latency",
            "jitter",
            "bandwidth",
            "loopback_latency",
            "failure_detection",
            "heartbeat_timeout",
            "message_cost",
        ):
            value = getattr(self, name)
            if value is None and name == "heartbeat_timeout":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                also = " or None" if name == "heartbeat_timeout" else ""
                raise FaultPlanError(f"NetworkModel.{name} must be a number >= 0{also}, got {value!r}")
        if self.bandwidth == 0:
            raise FaultPlanError("NetworkModel.bandwidth must be > 0 (bytes per second)")

    def delay(self, src: int, dst: int, nbytes: int, rng: random.Random) -> float:
        if src == dst:
            return self.loopback_latency + nbytes / self.bandwidth
        return self.latency + rng.random() * self.jitter + nbytes / self.bandwidth

    # -- plain data --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field by name (``NetworkModel.from_dict(m.to_dict()) == m``)."""
        from .._files import network_to_dict

        return network_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> NetworkModel:
        """The model a dict describes; missing fields take their defaults.

        Raises:
            FaultPlanError: naming an unknown or malformed field.
        """
        from .._files import network_from_dict

        return network_from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> NetworkModel:
        """Read a model from a ``.json`` or ``.toml`` file (the form of :meth:`to_dict`)."""
        from .._files import load_network

        return load_network(path)

    def dump(self, path: str | Path) -> None:
        """Write the model to a ``.json`` or ``.toml`` file."""
        from .._files import dump_data

        dump_data(self.to_dict(), path)
