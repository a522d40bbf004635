"""Dynamic groups (LIFE-5): ``init_rpc`` without ``world_size`` joins a group whose members come and go.

PyTorch's protocol (torch/distributed/rpc/backend_registry.py ``_tensorpipe_init_backend_handler``,
torch/distributed/rpc/api.py ``shutdown``, torch/distributed/rpc/_utils.py), written once for both
worlds: joins and leaves are serialized by a token in the rendezvous store. A joiner, holding the token,
registers its name in the store (refusing a duplicate name or rank, and a group that has static
members), then tells every current member over RPC that it joined; ``init_rpc`` returns once every
member has it in its membership. A leaver, holding the token, tells every other member over RPC that it
leaves, waits for its own outstanding calls, removes its name from the store and stops: the others keep
working, and a call to it by name or rank raises "could not find destination" as for any unknown worker.

The world provides the store's part as a ``twinrpc._world.GroupMembership`` (``world.membership``);
a world of a static group has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._current import current_agent
from ._worker_info import WorkerInfo

if TYPE_CHECKING:
    from ._agent import RpcAgent
    from ._world import GroupMembership

#: PyTorch's text (its trailing space included), raised when static and dynamic workers meet in one group
MIXED_GROUP_ERROR = "RPC group mixes statically and dynamically initialized members which is not supported. "


def update_group_membership(info: WorkerInfo, is_join: bool) -> None:
    """Runs on a member when ``info`` joins or leaves (PyTorch's ``_update_group_membership``). With
    ``unpickle_allow``, ``info`` must be a WorkerInfo (a peer chose the argument)."""
    agent = current_agent()
    if agent.unpickle_allow is not None:
        agent.unpickle_allow.check_type(info, WorkerInfo, "update_group_membership")
    agent.update_membership(info, bool(is_join))
    membership = agent.world.membership
    if membership is not None:
        membership.changed(info, bool(is_join))


def member_ready() -> None:
    """Runs on each member before a join changes anything (PyTorch asks each for its devices)."""


def _on_every_member(agent: RpcAgent, fn: Any, args: tuple[Any, ...]) -> None:
    """Call ``fn(*args)`` on every other member at once and wait for all; the first error raises
    once every call has ended."""
    futures = [agent.call(w, fn, args, None, -1.0) for w in agent.workers if w.id != agent.info.id]
    error: Exception | None = None
    for fut in futures:
        try:
            fut.wait()
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error


def join_group(agent: RpcAgent, membership: GroupMembership) -> None:
    """The joiner, holding the token (its connect took it): check that every member answers, tell
    every member, then give the token back.

    On failure the joiner leaves again (its name is removed from the store; a member that was told
    already is told it left) and the error propagates. A member that stopped without leaving fails
    the first round, so no member lists a joiner whose join failed.
    """
    agent.dynamic = True
    try:
        _on_every_member(agent, member_ready, ())
        try:
            _on_every_member(agent, update_group_membership, (agent.info, True))
        except BaseException:
            # Best effort (a member that died meanwhile is gone anyway), but waited for: a member
            # still listing this worker would contradict the next joiner's member list.
            told = []
            for w in agent.workers:
                if w.id != agent.info.id:
                    try:
                        told.append(agent.call(w, update_group_membership, (agent.info, False), None, -1.0))
                    except Exception:
                        pass
            for fut in told:
                try:
                    fut.wait()
                except Exception:
                    pass
            raise
    except BaseException:
        try:
            membership.remove()
        finally:
            membership.unlock()
            agent.finalize()
        raise
    membership.unlock()


def leave_group(agent: RpcAgent, graceful: bool, timeout: float, *, ignore_rref_leak: bool) -> None:
    """``shutdown`` of a dynamic member. ``graceful``: holding the token, tell every other member that
    this worker leaves, wait for this worker's own outstanding calls, remove its name from the store.
    Otherwise (as in PyTorch) stop at once: the others still list this worker, and calls to it fail
    as calls to a worker that is gone. ``timeout`` bounds nothing here, as in PyTorch."""
    membership = agent.world.membership
    completed = False
    try:
        if graceful and membership is not None:
            membership.lock()
            try:
                for w in list(agent.workers):
                    if w.id != agent.info.id:
                        agent.call(w, update_group_membership, (agent.info, False), None, -1.0).wait()
                agent.wait_idle()
                membership.remove()
                completed = True
            finally:
                membership.unlock()
    finally:
        agent.finalize(graceful=graceful, ignore_rref_leak=ignore_rref_leak, completed=completed)
