"""Which worker is "this" worker.

A real process is one worker. In the simulator many workers share a process, so each simulated task
carries its worker's slot in a context variable; the public API looks the agent up here and so works
unchanged in both worlds.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._errors import NotInitializedError
from ._world import Connect, Connection, JoinOptions, installed_world

if TYPE_CHECKING:
    from ._agent import RpcAgent


@dataclass(eq=False)
class WorkerSlot:
    """Holds a worker's agent between init_rpc and shutdown, and how init_rpc joins its world (a
    simulation gives each simulated worker a slot with its own connect)."""

    connect: Connect
    agent: RpcAgent | None = None
    #: how many times this worker has called init_rpc (a simulated worker's k-th init joins round k)
    generation: int = 0


def _connect_default_world(
    *, name: str, rank: int, world_size: int | None, options: JoinOptions, generation: int
) -> Connection:
    """Outside a simulation, init_rpc joins the installed default world: the real multiprocess gloo
    world (``twinrpc._world.installed_world``)."""
    connect = installed_world()
    return connect(name=name, rank=rank, world_size=world_size, options=options, generation=generation)


PROCESS_SLOT = WorkerSlot(connect=_connect_default_world)
CURRENT_SLOT: contextvars.ContextVar[WorkerSlot | None] = contextvars.ContextVar("twinrpc_slot", default=None)


def current_slot() -> WorkerSlot:
    slot = CURRENT_SLOT.get()
    return PROCESS_SLOT if slot is None else slot


def current_agent() -> RpcAgent:
    """This worker's running agent, or ``RuntimeError("RPC has not been initialized...")``."""
    slot = CURRENT_SLOT.get()
    agent = (PROCESS_SLOT if slot is None else slot).agent
    if agent is None:
        raise NotInitializedError()
    return agent


def maybe_current_agent() -> RpcAgent | None:
    slot = CURRENT_SLOT.get()
    return (PROCESS_SLOT if slot is None else slot).agent
