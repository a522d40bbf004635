"""The network model: per-link latency with seeded jitter, bandwidth, and failure detection delays.

Workers may be placed on hosts (``hosts``, ``workers_per_host``): a link between two workers of one host
then takes the ``same_host_*`` parameters, a link between hosts the others. Without a placement every
worker is on a host of its own, so every link is a cross-host one, exactly as before hosts existed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ._codec import build, dump_data, plain, read_data
from ._errors import FaultPlanError


@dataclass(frozen=True, slots=True)
class NetworkModel:
    """How long a message takes: ``latency + uniform(0, jitter) + nbytes / bandwidth`` on the link,
    plus ``message_cost`` of work at each end; between two workers placed on one host,
    ``same_host_latency + uniform(0, same_host_jitter) + nbytes / same_host_bandwidth``.

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
        hosts: the host of each worker, by rank (any integers: equal means one host); a rank past the
            end of the tuple is on a host of its own. ``()``, the default, with ``workers_per_host=1``:
            every worker on a host of its own, so every link takes ``latency``, ``jitter`` and
            ``bandwidth`` (the schedules of a model without hosts). Build it with :meth:`with_hosts`.
        workers_per_host: place ranks on hosts in blocks: ranks ``r`` and ``s`` share a host when
            ``r // workers_per_host == s // workers_per_host`` (``torchrun``'s layout with that many
            processes per node). 1, the default: no sharing. Not together with ``hosts``.
        same_host_latency: fixed one-way delay between two workers of one host (the gloo world's
            shared-memory path), in seconds.
        same_host_jitter: its extra delay, drawn uniformly from [0, same_host_jitter).
        same_host_bandwidth: its bytes per second.
        message_cost: virtual seconds of work each message costs its sender (pickling, framing)
            before it leaves and its receiver (unpickling, dispatch) before its handler starts. A worker
            does this work for one message at a time, in order (one Python process holds one GIL), so
            a worker many peers talk to at once queues them: a busy parameter server slows down. It is
            deterministic (no wall clock). 0, the default, makes handling free: only the link delays
            messages. What handlers compute (the user's functions, autograd) is never charged.

    Raises:
        FaultPlanError: a value is negative or not a number (``heartbeat_timeout`` may also be
            ``None``), ``bandwidth`` or ``same_host_bandwidth`` is 0, a host is not an integer,
            ``workers_per_host`` is below 1, or both ``hosts`` and ``workers_per_host`` place workers.
    """

    latency: float = 50e-6
    jitter: float = 20e-6
    bandwidth: float = 2e9
    loopback_latency: float = 5e-6
    failure_detection: float = 1e-3
    heartbeat_timeout: float | None = None
    message_cost: float = 0.0
    hosts: tuple[int, ...] = ()
    workers_per_host: int = 1
    same_host_latency: float = 15e-6
    same_host_jitter: float = 5e-6
    same_host_bandwidth: float = 5e9

    def __post_init__(self) -> None:
        for name in (
            "latency",
            "jitter",
            "bandwidth",
            "loopback_latency",
            "failure_detection",
            "heartbeat_timeout",
            "message_cost",
            "same_host_latency",
            "same_host_jitter",
            "same_host_bandwidth",
        ):
            value = getattr(self, name)
            if value is None and name == "heartbeat_timeout":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                also = " or None" if name == "heartbeat_timeout" else ""
                raise FaultPlanError(f"NetworkModel.{name} must be a number >= 0{also}, got {value!r}")
        for name in ("bandwidth", "same_host_bandwidth"):
            if getattr(self, name) == 0:
                raise FaultPlanError(f"NetworkModel.{name} must be > 0 (bytes per second)")
        if not isinstance(self.hosts, tuple):
            object.__setattr__(self, "hosts", tuple(self.hosts))  # a list, from Python or a file
        for rank, host in enumerate(self.hosts):
            if not isinstance(host, int) or isinstance(host, bool):
                raise FaultPlanError(
                    f"NetworkModel.hosts[{rank}] must be an integer (the host of rank {rank}), got {host!r}"
                )
        per = self.workers_per_host
        if not isinstance(per, int) or isinstance(per, bool) or per < 1:
            raise FaultPlanError(f"NetworkModel.workers_per_host must be an integer >= 1, got {per!r}")
        if self.hosts and per != 1:
            raise FaultPlanError(
                f"NetworkModel: give hosts ({list(self.hosts)}) or workers_per_host ({per}), not both"
            )

    def delay(self, src: int, dst: int, nbytes: int, rng: random.Random) -> float:
        if src == dst:
            return self.loopback_latency + nbytes / self.bandwidth
        if (self.hosts or self.workers_per_host != 1) and self.same_host(src, dst):
            return (
                self.same_host_latency
                + rng.random() * self.same_host_jitter
                + nbytes / self.same_host_bandwidth
            )
        return self.latency + rng.random() * self.jitter + nbytes / self.bandwidth

    # -- hosts -------------------------------------------------------------------------------------
    @property
    def placed(self) -> bool:
        """Whether some workers share a host (``hosts`` or ``workers_per_host`` is given)."""
        return bool(self.hosts) or self.workers_per_host != 1

    def host_of(self, rank: int) -> int | None:
        """The host ``rank`` is placed on (``None``: a host of its own)."""
        if self.workers_per_host != 1:
            return rank // self.workers_per_host
        return self.hosts[rank] if 0 <= rank < len(self.hosts) else None

    def same_host(self, src: int, dst: int) -> bool:
        """Whether ranks ``src`` and ``dst`` are placed on one host (their link is a same-host one)."""
        host = self.host_of(src)
        return host is not None and host == self.host_of(dst)

    def with_hosts(self, hosts: Sequence[int] = (), *, workers_per_host: int = 1) -> NetworkModel:
        """A copy with workers placed on hosts: ``hosts[rank]`` is the host of each rank, or ranks in
        blocks of ``workers_per_host`` (``with_hosts(workers_per_host=4)``: ranks 0-3 on one host,
        4-7 on the next...). ``with_hosts()`` places every worker on a host of its own again.

        Raises:
            FaultPlanError: as the constructor does.
        """
        return replace(self, hosts=tuple(hosts), workers_per_host=workers_per_host)

    # -- plain data --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field by name (``NetworkModel.from_dict(m.to_dict()) == m``), but those of hosts that
        keep their defaults: a model without hosts writes what it wrote before hosts existed."""
        data = network_to_dict(self)
        for name in _HOST_FIELDS:
            if data[name] == _DEFAULTS[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> NetworkModel:
        """The model a dict describes; missing fields take their defaults.

        Raises:
            FaultPlanError: naming an unknown or malformed field.
        """
        return network_from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> NetworkModel:
        """Read a model from a ``.json`` or ``.toml`` file (the form of :meth:`to_dict`)."""
        return network_from_dict(read_data(path), f"{path}")

    def dump(self, path: str | Path) -> None:
        """Write the model to a ``.json`` or ``.toml`` file."""
        dump_data(self.to_dict(), path)


#: the fields :meth:`NetworkModel.to_dict` leaves out while they keep their defaults
_HOST_FIELDS = ("hosts", "workers_per_host", "same_host_latency", "same_host_jitter", "same_host_bandwidth")
_DEFAULTS: dict[str, Any] = {
    f.name: list(f.default) if isinstance(f.default, tuple) else f.default
    for f in fields(NetworkModel)
    if f.name in _HOST_FIELDS
}


def network_to_dict(model: NetworkModel) -> dict[str, Any]:
    return plain(model, include_defaults=True)


def network_from_dict(data: Any, where: str = "") -> NetworkModel:
    return build(NetworkModel, data, where or "network model")  # type: ignore[no-any-return]
