"""The one interpreter of twin programs: the same module-level code runs in both worlds.

:func:`interpret` is a conformance-harness worker program (``fn(ctx, program, run_id)``): the
simulator runner calls it inside a :class:`~twinrpc.simulator.Simulation`, the gloo runner sends it
by reference to real processes (``conformance.harness``'s gloo backend). Worker 0 performs the
operations and records what each one observed; the others serve and, in a fresh world
(``ctx.spawned``), obey the driver's orders to leave, die or finish.

Everything a call may wait for is bounded (``LONG``), so a lost reply shows as a timeout in the
outcome rather than a hang. Times are chosen with wide gaps (a ``SHORT`` timeout against a ``HOLD``
long handler, ``SETTLE`` after a departure) because gloo runs them on the wall clock of a loaded
machine while the simulator runs them in virtual time.
"""

from __future__ import annotations

import builtins
from typing import Any

from .outcome import Result, describe_exception
from .programs import (
    Builtin,
    Chain,
    Fail,
    FanOut,
    Kill,
    Leave,
    PassOn,
    Program,
    Remote,
    RemoteOf,
    Slow,
    Start,
    Sync,
    ToHere,
    Train,
    Wait,
)

__all__ = ["HOLD", "LONG", "SETTLE", "SHORT", "interpret"]

#: how long a :class:`Slow` handler sleeps (seconds), and a :class:`Start` handler in a program
#: without departures
HOLD = 0.6
#: how long a :class:`Start` handler sleeps in a program with departures: far longer than a departure
#: takes to happen, so that a departure ordered while it runs happens before it returns in both
#: worlds, however slow the operations between them were on the wall clock (see _drive's Leave/Kill
#: branch; with HOLD, 0.15 s of operations on a loaded host let the reply beat the departure)
START_HOLD = 3.0
#: wall-clock slack the driver leaves for operations' own cost: a pending Start to a departing worker
#: whose *nominal* elapsed time (the sleeps the program itself made, equal in both worlds) is within
#: this of START_HOLD is waited for before the departure, so both worlds see it complete
SLACK = 1.5
#: the timeout of ``Slow(timeout=True)``: far below HOLD, so it expires in both worlds
SHORT = 0.1
#: every other call's timeout: far above anything a program does, so only a lost reply reaches it
LONG = 10.0
#: how long the driver waits after ordering a departure, for it to happen and peers to learn of it
SETTLE = 0.4
#: how often a serving worker looks for the driver's orders
POLL = 0.005
#: how long a worker waits between taking an order to leave or die and carrying it out
GRACE = 0.05
#: bound of the final graceful shutdown (0 would wait forever for a worker that died)
SHUTDOWN_TIMEOUT = 2 * LONG

#: (run id, rank) -> orders not yet carried out. Keyed by rank because simulated workers share it.
_ORDERS: dict[tuple[str, int], list[str]] = {}


def _rpc() -> Any:
    import twinrpc.rpc as rpc

    return rpc


def _sleep(seconds: float) -> None:
    from twinrpc.simulator import sleep  # virtual time in a simulation, wall time elsewhere

    sleep(seconds)


def _me() -> str:
    return str(_rpc().get_worker_info().name)


# -- user functions (module level: pickled by reference) -------------------------------------------------
def _echo(x: int) -> tuple[str, int]:
    return (_me(), x)


def _hop(rest: tuple[int, ...]) -> list[str]:
    visited = [_me()]
    if rest:
        visited += _rpc().rpc_sync(rest[0], _hop, args=(rest[1:],), timeout=LONG)
    return visited


def _raise(kind: str) -> None:
    raise getattr(builtins, kind)(f"{kind} raised on {_me()}")


def _hold(seconds: float) -> str:
    # The answer is known before the wait: whether a worker that left meanwhile still delivers it is
    # what a departure during a running call tests, not whether its API still works.
    name = _me()
    _sleep(seconds)
    return name


def _make(x: int) -> tuple[str, str, int]:
    return ("made", _me(), x)


def _plain(value: Any) -> Any:
    import twinrpc.rpc as rpc

    if isinstance(value, rpc.RRef):
        return ("rref", value.owner().name)
    if isinstance(value, tuple | list):
        return type(value)(_plain(v) for v in value)
    return value


def _deref(rref: Any) -> tuple[str, str, Any]:
    return ("deref", _me(), _plain(rref.to_here(timeout=LONG)))


def _param(k: int) -> Any:
    import torch

    return torch.full((2,), float(k), requires_grad=True)


def _use(p: Any) -> Any:
    return (p.local_value() * 2.0).sum()


def _value(p: Any) -> list[float]:
    return [float(v) for v in p.local_value().detach()]


def _order(run_id: str, what: str) -> None:
    _ORDERS.setdefault((run_id, _rpc().get_worker_info().id), []).append(what)


# -- the driver --------------------------------------------------------------------------------------------
def _attempt(thunk: Any) -> Result:
    try:
        return ("ok", thunk())
    except Exception as exc:
        return ("raised", *describe_exception(exc))


def _train(ctx: Any, owners: tuple[int, ...], steps: int) -> list[list[float]]:
    import torch

    rpc = ctx.rpc
    params = [rpc.remote(o, _param, args=(k + 1,), timeout=LONG) for k, o in enumerate(owners)]
    opt = ctx.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.5)
    for _ in range(steps):
        with ctx.dist_autograd.context() as cid:
            loss = sum(rpc.rpc_sync(p.owner(), _use, args=(p,), timeout=LONG) for p in params)
            ctx.dist_autograd.backward(cid, [loss])
            opt.step(cid)
    return [rpc.rpc_sync(p.owner(), _value, args=(p,), timeout=LONG) for p in params]


def _drive(ctx: Any, program: Program, run_id: str) -> dict[str, Any]:
    rpc = ctx.rpc
    records: list[tuple[int, str, Result]] = []
    rrefs: list[Any] = []
    pending: list[tuple[int, Any]] = []  # (index of the Start, future)
    gone: set[int] = set()
    timed_out = False
    #: the sleeps the driver's program made so far (virtual seconds; the same in both worlds), and
    #: per pending Start its destination and that nominal time when it started
    nominal = 0.0
    started_at: dict[int, tuple[int, float]] = {}

    def pick(items: list[Any], slot: int) -> int | None:
        return slot % len(items) if items else None

    def skip(i: int) -> None:
        records.append((i, "op", ("skipped",)))

    for i, op in enumerate(program.ops):
        if isinstance(op, Sync):
            res = _attempt(lambda op=op: rpc.rpc_sync(op.dst, _echo, args=(op.x,), timeout=LONG))
        elif isinstance(op, Builtin):

            def builtin(op: Builtin = op) -> list[float]:
                import torch

                args = (torch.full((2,), float(op.x)), torch.ones(3) if op.bad else 1)
                if op.sync:
                    value = rpc.rpc_sync(op.dst, torch.add, args=args, timeout=LONG)
                else:
                    value = rpc.rpc_async(op.dst, torch.add, args=args, timeout=LONG).wait()
                return [float(v) for v in value]

            res = _attempt(builtin)
        elif isinstance(op, Chain):
            res = _attempt(lambda op=op: rpc.rpc_sync(op.hops[0], _hop, args=(op.hops[1:],), timeout=LONG))
        elif isinstance(op, FanOut):

            def fan(op: FanOut = op) -> list[Result]:
                futs = [rpc.rpc_async(d, _echo, args=(op.x,), timeout=LONG) for d in op.dsts]
                return [_attempt(f.wait) for f in futs]

            res = _attempt(fan)
        elif isinstance(op, Fail):
            if op.sync:
                res = _attempt(lambda op=op: rpc.rpc_sync(op.dst, _raise, args=(op.error,), timeout=LONG))
            else:
                res = _attempt(
                    lambda op=op: rpc.rpc_async(op.dst, _raise, args=(op.error,), timeout=LONG).wait()
                )
        elif isinstance(op, Slow):
            timed_out = timed_out or op.timeout
            timeout = SHORT if op.timeout else LONG
            res = _attempt(lambda op=op, t=timeout: rpc.rpc_sync(op.dst, _hold, args=(HOLD,), timeout=t))
            nominal += SHORT if op.timeout else HOLD
        elif isinstance(op, Start):
            hold = START_HOLD if ctx.spawned else HOLD
            started = _attempt(lambda op=op, h=hold: rpc.rpc_async(op.dst, _hold, args=(h,), timeout=LONG))
            if started[0] == "ok":
                pending.append((i, started[1]))
                started_at[i] = (op.dst, nominal)
                res = ("started",)
            else:
                res = started
        elif isinstance(op, Wait):
            k = pick(pending, op.slot)
            if k is None:
                skip(i)
                continue
            start, fut = pending.pop(k)
            res = ("waited", start, _attempt(fut.wait))
        elif isinstance(op, Remote):
            res = _attempt(lambda op=op: rpc.remote(op.owner, _make, args=(op.x,), timeout=LONG))
            if res[0] == "ok":
                rrefs.append(res[1])
                res = ("ok", ("rref", len(rrefs) - 1))
        elif isinstance(op, ToHere | PassOn | RemoteOf):
            k = pick(rrefs, op.slot)
            if k is None:
                skip(i)
                continue
            rref = rrefs[k]
            if isinstance(op, ToHere):
                res = _attempt(lambda r=rref: _plain(r.to_here(timeout=LONG)))
            elif isinstance(op, PassOn):
                res = _attempt(lambda op=op, r=rref: rpc.rpc_sync(op.via, _deref, args=(r,), timeout=LONG))
            else:
                res = _attempt(lambda op=op, r=rref: rpc.remote(op.via, _deref, args=(r,), timeout=LONG))
                if res[0] == "ok":
                    rrefs.append(res[1])
                    res = ("ok", ("rref", len(rrefs) - 1))
            del rref
        elif isinstance(op, Train):
            res = _attempt(lambda op=op: _train(ctx, op.owners, op.steps))
        elif isinstance(op, Leave | Kill):
            if not ctx.spawned or op.rank in gone or not 0 < op.rank < program.world_size:
                skip(i)
                continue
            gone.add(op.rank)
            for start, fut in pending:
                dst, t0 = started_at[start]
                if dst == op.rank and nominal - t0 + SETTLE + GRACE > START_HOLD - SLACK:
                    _attempt(fut.wait)  # too close to call on the wall clock: let it finish first
            order = "kill" if isinstance(op, Kill) else "leave-graceful" if op.graceful else "leave"
            res = _attempt(
                lambda op=op, o=order: rpc.rpc_sync(op.rank, _order, args=(run_id, o), timeout=LONG)
            )
            _sleep(SETTLE)
            nominal += SETTLE
        else:  # pragma: no cover - the Op union is exhaustive
            raise TypeError(f"not an operation: {op!r}")
        records.append((i, "op", res))
    for start, fut in pending:  # every call is accounted for: the ones never waited, in start order
        records.append((start, "end-wait", _attempt(fut.wait)))
    rrefs.clear()
    if timed_out and not ctx.spawned:
        _sleep(HOLD)  # timed-out handlers finish before the pooled world runs the next program
    out: dict[str, Any] = {"ops": records}
    if ctx.spawned:
        for rank in range(1, program.world_size):
            if rank not in gone:
                out[f"finish-order-{rank}"] = _attempt(
                    lambda r=rank: rpc.rpc_sync(r, _order, args=(run_id, "finish"), timeout=LONG)
                )
        out["shutdown"] = _attempt(lambda: rpc.shutdown(graceful=True, timeout=SHUTDOWN_TIMEOUT))
    return out


def _serve(ctx: Any, run_id: str) -> dict[str, Any]:
    """A worker of a fresh world other than the driver: serve until an order says leave, die or finish."""
    rpc = ctx.rpc
    key = (run_id, ctx.rank)
    while True:
        orders = _ORDERS.get(key)
        if not orders:
            _sleep(POLL)
            continue
        order = orders.pop(0)
        _ORDERS.pop(key, None)
        # Let the reply to the order leave first: a process killed while its reply still waits in
        # the outbox loses it (the simulator sends at once), which is not what the program tests.
        _sleep(GRACE)
        if order == "kill":
            ctx.crash()
        graceful = order != "leave"
        return {
            "order": order,
            "shutdown": _attempt(lambda g=graceful: rpc.shutdown(graceful=g, timeout=SHUTDOWN_TIMEOUT)),
        }


def interpret(ctx: Any, program: Program, run_id: str) -> dict[str, Any] | None:
    """Run ``program`` on this worker: the driver (rank 0) performs its operations; in a fresh world
    (``ctx.spawned``) every worker also initialises RPC and shuts it down. Returns plain data: the
    driver's records (see :mod:`twin.outcome`), or a serving worker's order and shutdown result."""
    if ctx.spawned:
        ctx.init_rpc(rpc_timeout=LONG)
    if ctx.rank == 0:
        return _drive(ctx, program, run_id)
    if ctx.spawned:
        return _serve(ctx, run_id)
    return None
