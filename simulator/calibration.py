"""Fit a :class:`~twinrpc.simulator.NetworkModel` to measured round trips, by least squares.

Measure a real world (two twinrpc workers over gloo, say) and fit the simulator's model to it, so that
simulated time means something on that machine::

    from twinrpc.simulator.calibration import Pipelined, RoundTrip, fit_network_model

    fit = fit_network_model(
        [RoundTrip(request_bytes=180, response_bytes=120, seconds=310e-6, spread=60e-6),
         RoundTrip(request_bytes=1_048_800, response_bytes=1_048_700, seconds=2.1e-3)],
        [Pipelined(seconds_per_call=95e-6, in_flight=64)],
    )
    fit.model.dump("network.toml")          # python -m twinrpc.simulator run --network network.toml
    print(fit.describe())                   # parameters and residuals

Round trips measured between two processes of one host (``same_host=True``: the gloo world's
shared-memory path) fit the model's ``same_host_*`` parameters, the others ``latency``, ``jitter`` and
``bandwidth`` (between hosts); ``message_cost``, work in each process, is one for both. A model with
both kinds is used with workers placed on hosts (:meth:`~twinrpc.simulator.NetworkModel.with_hosts`).

The fit uses the simulator's own arithmetic for two workers and no other traffic (tested by fitting
round trips the simulator itself produced, which gives the model back):

- a synchronous round trip takes ``2 * latency + jitter + bytes / bandwidth + 4 * message_cost``
  (request and response each cost their sender and their receiver ``message_cost``; the median of
  a uniform jitter on each leg is ``jitter / 2``);
- with many calls in flight, the two workers' message handling is the bottleneck: each worker sends
  one message and receives one per call, so a call takes ``2 * message_cost`` of each worker's time.

``jitter`` comes from the spread (90th minus 10th percentile) of the smallest round trip: for the sum of
two uniform delays that spread is ``1.1056 * jitter``. The unknowns are fitted by weighted least
squares on relative error (a 100 us round trip counts as much as a 20 ms one), none below zero. What
the model cannot express shows in the residuals: handler compute, per-byte CPU work, load from other
processes.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

import twinrpc.rpc as rpc
from twinrpc import _serialize

from ._errors import CalibrationError
from ._kernel._compute import count_operations
from ._model._compute import ComputeModel
from ._model._network import NetworkModel
from ._simulation import now

__all__ = [
    "DEFAULT_SIZES",
    "SPREAD_PER_JITTER",
    "CalibrationError",
    "ComputeFit",
    "ComputeSample",
    "NetworkFit",
    "Pipelined",
    "Residual",
    "RoundTrip",
    "count_operations",
    "fit_compute_model",
    "fit_network_model",
    "measure",
    "predict",
]

KiB, MiB = 1024, 1024 * 1024
#: tensor sizes :func:`measure` sends by default (0: a call with a small integer argument)
DEFAULT_SIZES: tuple[int, ...] = (0, KiB, 16 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB)

#: the 90th minus the 10th percentile of the sum of two uniform [0, j) delays, in units of j
SPREAD_PER_JITTER = 2.0 * (1.0 - math.sqrt(0.2))


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """A measured synchronous call (``rpc_sync``): ``seconds`` from sending the request to having the
    reply, typically the median of many calls.

    Args:
        request_bytes: the request message's bytes as the simulator counts them (pickled payload plus
            tensor data; :attr:`twinrpc.simulator.MessageInfo.nbytes` of its ``send`` trace event).
        response_bytes: the reply's bytes, counted the same way.
        seconds: the round-trip time.
        spread: 90th minus 10th percentile of the round-trip times (0: unknown); the smallest round
            trip's spread sets ``jitter``.
        same_host: measured between two workers of one host (it fits the ``same_host_*``
            parameters); False: between hosts, or with no hosts in the picture.
    """

    request_bytes: int
    response_bytes: int
    seconds: float
    spread: float = 0.0
    same_host: bool = False

    @classmethod
    def from_samples(
        cls, request_bytes: int, response_bytes: int, samples: Sequence[float], *, same_host: bool = False
    ) -> RoundTrip:
        """The median and the 10-90 percentile spread of ``samples`` (seconds, one per call)."""
        if not samples:
            raise CalibrationError(f"RoundTrip.from_samples({request_bytes} B): no samples")
        xs = sorted(samples)

        def pct(q: float) -> float:
            pos = q * (len(xs) - 1)
            lo = math.floor(pos)
            hi = min(lo + 1, len(xs) - 1)
            return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

        return cls(request_bytes, response_bytes, pct(0.5), pct(0.9) - pct(0.1), same_host)

    @property
    def nbytes(self) -> int:
        return self.request_bytes + self.response_bytes

    def label(self) -> str:
        where = "same host: " if self.same_host else ""
        return f"{where}round trip {self.request_bytes:,} B + {self.response_bytes:,} B"


@dataclass(frozen=True, slots=True)
class Pipelined:
    """Measured calls with ``in_flight`` small calls outstanding at once (a sliding window):
    ``seconds_per_call`` is the elapsed time divided by the number of calls; ``same_host`` as for
    :class:`RoundTrip`."""

    seconds_per_call: float
    in_flight: int = 64
    same_host: bool = False

    def label(self) -> str:
        where = "same host: " if self.same_host else ""
        return f"{where}pipelined, {self.in_flight} in flight (per call)"


@dataclass(frozen=True, slots=True)
class Residual:
    """One measurement against the fitted model's prediction."""

    label: str
    measured: float
    predicted: float

    @property
    def relative(self) -> float:
        """``(predicted - measured) / measured``."""
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True, slots=True)
class NetworkFit:
    """The fitted model and how well it reproduces each measurement; ``same_host`` and ``cross_host``
    say which kinds of link the measurements covered, so which parameters were fitted (the
    ``same_host_*`` ones, and ``latency``, ``jitter``, ``bandwidth``)."""

    model: NetworkModel
    residuals: tuple[Residual, ...]
    same_host: bool = False
    cross_host: bool = True

    @property
    def rms_relative_error(self) -> float:
        """Root mean square of the residuals' relative errors."""
        return math.sqrt(sum(r.relative**2 for r in self.residuals) / len(self.residuals))

    def describe(self) -> str:
        """The parameters and a table of residuals, for people."""
        m = self.model
        lines = []
        if self.cross_host:
            between = "between hosts: " if self.same_host else ""
            lines.append(
                f"{between}latency {m.latency * 1e6:.1f} us, jitter {m.jitter * 1e6:.1f} us, "
                f"bandwidth {m.bandwidth / 1e9:.3f} GB/s"
            )
        if self.same_host:
            lines.append(
                f"same host: same_host_latency {m.same_host_latency * 1e6:.1f} us, same_host_jitter "
                f"{m.same_host_jitter * 1e6:.1f} us, same_host_bandwidth {m.same_host_bandwidth / 1e9:.3f} GB/s"
            )
        lines[-1] += f", message_cost {m.message_cost * 1e6:.1f} us"
        lines.append(f"  {'measurement':<54}{'measured':>12}{'model':>12}{'error':>9}")
        for r in self.residuals:
            lines.append(
                f"  {r.label:<54}{r.measured * 1e6:>10.1f}us{r.predicted * 1e6:>10.1f}us{r.relative:>+9.1%}"
            )
        lines.append(f"  rms relative error {self.rms_relative_error:.1%}")
        return "\n".join(lines)


def predict(model: NetworkModel, sample: RoundTrip | Pipelined) -> float:
    """What the simulator takes for ``sample`` under ``model`` (two workers, nothing else running;
    on one host when ``sample.same_host``, else on two)."""
    cost = model.message_cost
    if sample.same_host:
        latency, jitter, bandwidth = (
            model.same_host_latency,
            model.same_host_jitter,
            model.same_host_bandwidth,
        )
    else:
        latency, jitter, bandwidth = model.latency, model.jitter, model.bandwidth
    if isinstance(sample, RoundTrip):
        return 2 * latency + jitter + sample.nbytes / bandwidth + 4 * cost
    round_trip = 2 * latency + jitter + 4 * cost
    return max(2 * cost, round_trip / sample.in_flight)


def fit_network_model(
    round_trips: Sequence[RoundTrip],
    pipelined: Sequence[Pipelined] = (),
    *,
    base: NetworkModel | None = None,
) -> NetworkFit:
    """Fit ``latency``, ``jitter``, ``bandwidth`` and ``message_cost`` to measurements; with
    measurements between two workers of one host (``same_host=True``) also, or instead,
    ``same_host_latency``, ``same_host_jitter`` and ``same_host_bandwidth``.

    Args:
        round_trips: synchronous calls of at least two different sizes on each kind of link measured
            (the sizes set the bandwidth).
        pipelined: calls with many in flight; they set ``message_cost`` (without them it stays 0 and
            all per-call overhead is latency: a busy worker would not slow down). Handling a message
            is work in a process, whichever link it takes, so one ``message_cost`` fits both kinds.
        base: the other fields (``loopback_latency``, ``failure_detection``, ``heartbeat_timeout``,
            the placement on hosts, and the parameters of a kind of link not measured) are taken
            from it (default: :class:`~twinrpc.simulator.NetworkModel`'s defaults, where
            ``heartbeat_timeout=None`` leaves silence detection to each worker's heartbeat options:
            the measurements say nothing about it).

    Raises:
        CalibrationError: fewer than two distinct round-trip sizes on a kind of link measured, or a
            time that is not positive.
    """
    base = base or NetworkModel()
    round_trips = list(round_trips)
    pipelined = list(pipelined)
    measured: list[RoundTrip | Pipelined] = [*round_trips, *pipelined]
    for s in measured:
        t = s.seconds if isinstance(s, RoundTrip) else s.seconds_per_call
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise CalibrationError(f"{s.label()}: the time must be a positive number of seconds, got {t!r}")
    kinds = sorted({s.same_host for s in measured})
    if not round_trips:
        raise CalibrationError(
            "fit_network_model needs round trips of at least two different sizes; got none"
        )
    for same in kinds:
        trips = [s for s in round_trips if s.same_host == same]
        if len({s.nbytes for s in trips}) < 2:
            where = "between two workers of one host" if same else "between hosts"
            raise CalibrationError(
                f"fit_network_model needs round trips of at least two different sizes {where} to tell "
                f"latency from bandwidth; got sizes {sorted({s.nbytes for s in trips})}"
            )

    # Unknowns x = (fixed = 2 * latency + jitter, 1 / bandwidth) between hosts, the same on one host,
    # then message_cost; all >= 0. A row's link kind picks its pair of columns.
    def link(same: bool, fixed: float, per_byte: float) -> list[float]:
        return [0.0, 0.0, fixed, per_byte] if same else [fixed, per_byte, 0.0, 0.0]

    rows: list[tuple[list[float], float]] = [
        ([*link(s.same_host, 1.0, float(s.nbytes)), 4.0], s.seconds) for s in round_trips
    ]
    rows += [([0.0, 0.0, 0.0, 0.0, 2.0], s.seconds_per_call) for s in pipelined]
    free = [c for same in kinds for c in ((2, 3) if same else (0, 1))] + ([4] if pipelined else [])
    x = _nonnegative_least_squares(rows, free)
    model = replace(base, message_cost=x[4])
    for same in kinds:
        fixed, inv_bw = (x[2], x[3]) if same else (x[0], x[1])
        if inv_bw <= 0:
            where = "between two workers of one host" if same else "between hosts"
            raise CalibrationError(
                f"the round trips {where} do not grow with their size (fitted bandwidth is infinite): "
                "measure larger messages, e.g. 1 MiB and 16 MiB tensors"
            )
        smallest = min((s for s in round_trips if s.same_host == same), key=lambda s: (s.nbytes, s.seconds))
        # the spread cannot exceed the fixed part: the rest is latency
        jitter = min(max(0.0, smallest.spread) / SPREAD_PER_JITTER, fixed)
        if same:
            model = replace(
                model,
                same_host_latency=(fixed - jitter) / 2,
                same_host_jitter=jitter,
                same_host_bandwidth=1.0 / inv_bw,
            )
        else:
            model = replace(model, latency=(fixed - jitter) / 2, jitter=jitter, bandwidth=1.0 / inv_bw)
    residuals = tuple(Residual(s.label(), s.seconds, predict(model, s)) for s in round_trips) + tuple(
        Residual(s.label(), s.seconds_per_call, predict(model, s)) for s in pipelined
    )
    return NetworkFit(model, residuals, same_host=True in kinds, cross_host=False in kinds)


def _nonnegative_least_squares(rows: list[tuple[list[float], float]], free: list[int]) -> list[float]:
    """Minimise the sum of ((a . x - y) / y)^2 over x >= 0, x[i] = 0 outside ``free``.

    A few unknowns at most: try every subset of them held at zero, solve the rest exactly and keep the
    best solution that has no negative component (what an active-set NNLS would find)."""
    best: tuple[float, list[float]] | None = None
    for k in range(len(free), 0, -1):
        for subset in itertools.combinations(free, k):
            x = _weighted_solve(rows, list(subset))
            if x is None or any(v < 0 for v in x):
                continue
            err = sum(((sum(a * v for a, v in zip(row, x, strict=True)) - y) / y) ** 2 for row, y in rows)
            if best is None or err < best[0]:
                best = (err, x)
    if best is None:
        raise CalibrationError("the measurements admit no model with non-negative parameters")
    return best[1]


def _weighted_solve(rows: list[tuple[list[float], float]], cols: list[int]) -> list[float] | None:
    """Weighted least squares on the columns ``cols`` (others zero), via the normal equations on
    column-scaled data (the columns differ by 10 orders of magnitude: bytes vs seconds)."""
    n = len(cols)
    scale = [max(abs(row[c]) for row, _ in rows) or 1.0 for c in cols]
    ata = [[0.0] * n for _ in range(n)]
    atb = [0.0] * n
    for row, y in rows:
        a = [row[c] / scale[i] / y for i, c in enumerate(cols)]  # weight 1/y: relative error
        for i in range(n):
            atb[i] += a[i]  # (y / y)
            for j in range(n):
                ata[i][j] += a[i] * a[j]
    sol = _solve(ata, atb)
    if sol is None:
        return None
    x = [0.0] * len(rows[0][0])
    for i, c in enumerate(cols):
        x[c] = sol[i] / scale[i]
    return x


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


# -- computation ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ComputeSample:
    """A measured computation: ``seconds`` of wall time for ``ops`` torch operator calls doing ``flops``
    floating-point operations (count them with :func:`count_operations`, time them without it)."""

    ops: int
    flops: int
    seconds: float
    label: str = "computation"


@dataclass(frozen=True, slots=True)
class ComputeFit:
    """The fitted compute model and how well it reproduces each measurement."""

    model: ComputeModel
    residuals: tuple[Residual, ...]

    def describe(self) -> str:
        """The parameters and a table of residuals, for people."""
        m = self.model
        rate = f" ({1 / m.flop_cost / 1e9:.2f} GFLOP/s)" if m.flop_cost else ""
        lines = [
            f"op_cost {m.op_cost * 1e6:.2f} us per operator, flop_cost {m.flop_cost * 1e12:.2f} ps per FLOP{rate}",
            f"  {'measurement':<44}{'measured':>12}{'model':>12}{'error':>9}",
        ]
        for r in self.residuals:
            lines.append(
                f"  {r.label:<44}{r.measured * 1e3:>10.2f}ms{r.predicted * 1e3:>10.2f}ms{r.relative:>+9.1%}"
            )
        return "\n".join(lines)


def fit_compute_model(samples: Sequence[ComputeSample]) -> ComputeFit:
    """Fit ``op_cost`` and ``flop_cost`` of a :class:`~twinrpc.simulator.ComputeModel` to measured
    computations, by least squares on relative error, neither below zero. Samples with different
    ratios of FLOPs to operators (different batch sizes, say) tell the two apart.

    Raises:
        CalibrationError: no sample, or a time that is not positive.
    """
    if not samples:
        raise CalibrationError("fit_compute_model needs at least one ComputeSample")
    for s in samples:
        if not (isinstance(s.seconds, (int, float)) and math.isfinite(s.seconds) and s.seconds > 0):
            raise CalibrationError(
                f"{s.label}: the time must be a positive number of seconds, got {s.seconds!r}"
            )
    rows = [([float(s.ops), float(s.flops)], s.seconds) for s in samples]
    free = [0, 1] if len({(s.ops, s.flops) for s in samples}) > 1 else [0]
    op_cost, flop_cost = _nonnegative_least_squares(rows, free)
    model = ComputeModel(op_cost, flop_cost)
    residuals = tuple(Residual(s.label, s.seconds, model.cost(s.ops, s.flops)) for s in samples)
    return ComputeFit(model, residuals)


# -- measuring (the same program in either world) ------------------------------------------------------
def _echo(x: Any) -> Any:
    return x


def _message_bytes(obj: Any) -> int:
    """Bytes of a message carrying ``obj``, as the simulator counts them (payload + tensor data)."""
    payload, tensors = _serialize.dumps(obj)
    return len(payload) + sum(int(t.numel()) for t in tensors)


def measure(
    peer: str | int,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    calls: int = 200,
    max_bytes_per_size: int = 256 * MiB,
    in_flight: int = 64,
    pipelined_calls: int = 2000,
    same_host: bool = False,
) -> list[RoundTrip | Pipelined]:
    """Measure round trips to ``peer`` from the calling worker (after ``init_rpc``), in whatever world
    it runs: wall-clock time in the real world, virtual time in a simulation.

    For each size, ``rpc_sync`` of a function returning its argument (a float32 tensor of that many
    bytes; size 0: a small integer), up to ``calls`` times and at most ``max_bytes_per_size`` bytes
    each way (at least 5 calls), after two unrecorded warm-up calls; then ``pipelined_calls`` small
    ``rpc_async`` calls with ``in_flight`` outstanding. Byte counts are what the simulator would
    charge for these messages. ``same_host`` tags the results as measured between two workers of one
    host (:class:`RoundTrip`): say whether ``peer`` runs on the caller's host.

    Returns:
        One :class:`RoundTrip` per size, then one :class:`Pipelined`: the input of
        :func:`fit_network_model`.
    """
    out: list[RoundTrip | Pipelined] = []
    for size in sizes:
        arg: Any = 1 if size == 0 else torch.ones(size // 4, dtype=torch.float32)
        request = _message_bytes((_echo, (arg,), {}))
        response = _message_bytes(arg)
        n = max(5, min(calls, max_bytes_per_size // max(size, 1)))
        for _ in range(2):
            rpc.rpc_sync(peer, _echo, args=(arg,))
        samples = []
        for _ in range(n):
            t0 = now()
            rpc.rpc_sync(peer, _echo, args=(arg,))
            samples.append(now() - t0)
        out.append(RoundTrip.from_samples(request, response, samples, same_host=same_host))
    window: collections.deque[Any] = collections.deque()
    t0 = now()
    for _ in range(pipelined_calls):
        if len(window) >= in_flight:
            window.popleft().wait()
        window.append(rpc.rpc_async(peer, _echo, args=(1,)))
    for fut in window:
        fut.wait()
    out.append(Pipelined((now() - t0) / pipelined_calls, in_flight, same_host))
    return out
