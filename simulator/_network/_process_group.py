"""``torch.distributed`` process groups inside a simulation (spec SIM-8).

Programs that combine RPC with ``DistributedDataParallel`` (PyTorch's "DDP with the distributed RPC
framework" pattern) call ``torch.distributed.init_process_group`` on some of their workers. In a
simulation every worker is a task of one process, while c10d keeps its groups in process-wide state,
and a real gloo group would block the one thread every simulated worker runs on. So, for the run:

* c10d's state (the default group and its registry) is kept per simulated worker;
* ``init_process_group`` makes a :class:`SimProcessGroup`, whatever backend and ``init_method`` it
  names (``dist.get_backend()`` still answers the backend the program asked for);
* a collective parks the calling task until every member of the group has made the same call, then
  the last one to arrive computes the result for all; meanwhile the other workers run. Collectives
  take no virtual time and their traffic is not on the simulated network.

Members that call different collectives in the same position get an error naming both calls (a real
gloo group would fail or hang). A collective the simulator does not model raises an error naming it.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

from twinrpc._future import Future

from .._kernel._current import CURRENT_SIMULATION

if TYPE_CHECKING:
    from .._kernel._scheduler import Scheduler, Task

#: what the DDP logger and other C++ code read as the backend's name
BACKEND_NAME = "twinrpc-sim"


class _WorkerC10d:
    """One simulated worker's c10d state: what ``c10d._World`` keeps for the whole process."""

    def __init__(self) -> None:
        #: how many default groups this worker has made (the k-th one of every worker meets the others')
        self.default_groups = 0
        self.clear()

    def clear(self) -> None:
        """Forget every group (``destroy_process_group()``)."""
        self.default_pg: Any = None
        self.pg_map: dict[Any, tuple[str, Any]] = {}
        self.pg_names: dict[Any, str] = {}
        self.pg_group_ranks: dict[Any, dict[int, int]] = {}
        self.pg_backend_config: dict[Any, str] = {}
        self.group_count = 0
        self.tags_to_pg: dict[str, list[Any]] = {}
        self.pg_to_tag: dict[Any, str] = {}
        self.pg_coalesce_state: dict[Any, list[Any]] = {}
        self.comms: list[Any] = []
        #: how many groups of each member list this worker made since its default group
        self.subgroups: dict[tuple[int, ...], int] = {}


class _PerWorkerWorld(c10d._World):
    """c10d's ``_world`` for the run: the calling simulated worker's state, or the process's outside
    the simulation's tasks."""

    def __init__(
        self, sched: Scheduler, owner: object, state_of: Callable[[Task], _WorkerC10d], outside: c10d._World
    ) -> None:
        self._sched = sched
        #: the simulation whose tasks see the per-worker state (others, the process's own)
        self._owner = owner
        self._state_of = state_of
        self._outside = outside

    def _state(self) -> Any:
        task = self._sched.current_task()
        if task is None or CURRENT_SIMULATION.get() is not self._owner:
            return self._outside
        return self._state_of(task)

    @property
    def default_pg(self) -> Any:
        return self._state().default_pg

    @default_pg.setter
    def default_pg(self, value: Any) -> None:
        self._state().default_pg = value

    @property
    def pg_map(self) -> Any:
        return self._state().pg_map

    @property
    def pg_names(self) -> Any:
        return self._state().pg_names

    @property
    def pg_group_ranks(self) -> Any:
        return self._state().pg_group_ranks

    @property
    def pg_backend_config(self) -> Any:
        return self._state().pg_backend_config

    @property
    def group_count(self) -> int:
        return self._state().group_count  # type: ignore[no-any-return]

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._state().group_count = value

    @property
    def tags_to_pg(self) -> Any:
        return self._state().tags_to_pg

    @property
    def pg_to_tag(self) -> Any:
        return self._state().pg_to_tag

    @property
    def pg_coalesce_state(self) -> Any:
        return self._state().pg_coalesce_state

    @property
    def comms(self) -> Any:
        return self._state().comms


class _Meeting:
    """One collective call of a group, waiting for its members."""

    __slots__ = ("arrivals", "complete", "futures", "op", "waiting")

    def __init__(self, op: str) -> None:
        self.op = op
        self.arrivals: dict[int, Any] = {}
        self.complete = False
        #: members parked until the call completes, in arrival order
        self.waiting: list[_Parked] = []
        #: members that went on inside autograd's engine: their Work's futures, with what they carry
        self.futures: list[tuple[torch.futures.Future[Any], Any]] = []


class _EngineWait:
    """What one task inside autograd's engine waits for before the engine finishes its pass."""

    __slots__ = ("done", "pending", "resuming")

    def __init__(self) -> None:
        self.pending: list[_Meeting] = []
        self.done: Future[None] = Future()
        self.resuming = False

    def ready(self) -> bool:
        return all(m.complete for m in self.pending)

    def resume(self) -> None:
        self.done.set_result(None)


class _Parked:
    """A member parked until its collective lets it go on (every member arrived, or a broadcast's
    root did). One parked inside a C++ call resumes only from the top of the suspended stack."""

    __slots__ = ("done", "error", "in_cpp", "released", "resuming")

    def __init__(self, in_cpp: bool) -> None:
        self.done: Future[None] = Future()
        self.in_cpp = in_cpp
        self.released = False
        self.resuming = False
        self.error: BaseException | None = None

    def ready(self) -> bool:
        return self.released

    def resume(self) -> None:
        if self.error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(self.error)


class Collectives:
    """The meeting point of every simulated process group of one simulation.

    Outside autograd's engine, a member that cannot go on before the others arrive parks until they
    do. Inside it (DDP's gradient all-reduce runs in hooks during backward), a member only leaves its
    part and goes on; before that engine call ends it waits, once, for every collective it joined
    there (a callback queued on the engine, which runs before DDP's own).

    Every simulated worker runs on one thread, and both autograd's engine and pybind11 keep per-thread
    state that a call restores when it returns: the tasks suspended inside such calls must resume in
    the reverse order of their suspension. So parked members are woken latest-first, a task suspended
    inside a C++ call (at the end of an engine call, or parked in a collective that DDP's C++ code
    called) resumes only once every task that began waiting inside one after it has, and a
    broadcast's root never waits.
    """

    def __init__(self, sched: Scheduler, process_of: Callable[[Task], Hashable | None] | None) -> None:
        self.sched = sched
        #: which process a task runs in, when processes are not workers (``Simulation.process_of``)
        self.process_of = process_of
        #: the c10d state of each worker (or simulated process: ``Simulation.process_of``)
        self.states: dict[Any, _WorkerC10d] = {}
        self._meetings: dict[tuple[Any, int], _Meeting] = {}
        #: (task id, graph task id) -> the collectives that task joined inside that engine call
        self._engine_waits: dict[tuple[int, int], _EngineWait] = {}
        #: the tasks waiting at the end of an engine call (autograd's engine keeps per-thread state)
        #: and those parked in a collective that other C++ code called (pybind11 keeps a per-thread
        #: stack of its calls), each in the order they began to wait: only a stack's top resumes. The
        #: two are independent: an engine call made from Python holds nothing on pybind11's stack.
        self._engine_stack: list[_EngineWait] = []
        self._cpp_stack: list[_Parked] = []

    def _join(self, key: tuple[Any, int], rank: int, op: str, payload: Any) -> _Meeting:
        meeting = self._meetings.get(key)
        if meeting is None:
            meeting = self._meetings[key] = _Meeting(op)
        elif meeting.op != op:
            other = min(meeting.arrivals)
            self._fail(
                key,
                RuntimeError(
                    f"twinrpc.simulator: collective #{key[1]} of process group {key[0]!r}: rank {rank} "
                    f"called {op} while rank {other} called {meeting.op}; every member must make the same "
                    "collective calls in the same order"
                ),
            )
        meeting.arrivals[rank] = payload
        return meeting

    def _fail(self, key: tuple[Any, int], error: BaseException) -> NoReturn:
        """End collective ``key`` with ``error`` for every member: those waiting and the caller."""
        meeting = self._meetings.pop(key, None)
        if meeting is not None:
            self._complete(meeting, error)
        raise error

    def _park(self, key: tuple[Any, int], meeting: _Meeting, rank: int, from_cpp: bool) -> None:
        parked = _Parked(from_cpp)
        meeting.waiting.append(parked)
        if not from_cpp:
            parked.done.wait()
            return
        self._cpp_stack.append(parked)
        try:
            parked.done.wait()
        finally:
            self._cpp_stack.remove(parked)
            # runs once this task yields, after it has left its C++ call (or parked in it again)
            self.sched.schedule(0.0, lambda _arg: self._wake_top(), None)

    def _release(self, parked: _Parked, error: BaseException | None = None) -> None:
        parked.released, parked.error = True, error
        if not parked.in_cpp:
            parked.resume()
        else:
            self._wake_top()

    def _complete(self, meeting: _Meeting, error: BaseException | None = None) -> None:
        meeting.complete = True
        for parked in reversed(meeting.waiting):
            self._release(parked, error)
        for fut, value in meeting.futures:
            if error is None:
                fut.set_result(value)
            else:
                fut.set_exception(error)
        self._wake_top()

    def _wake_top(self) -> None:
        """Resume the latest task suspended inside a C++ call once what it waits for is done; the one
        below it only after this one has yielded, that is has left its call."""
        for stack in (self._engine_stack, self._cpp_stack):
            if stack and not stack[-1].resuming and stack[-1].ready():
                stack[-1].resuming = True
                stack[-1].resume()

    def _finish(
        self, key: tuple[Any, int], meeting: _Meeting, size: int, finish: Callable[[list[Any]], None]
    ) -> None:
        del self._meetings[key]
        try:
            finish([meeting.arrivals[r] for r in range(size)])
        except BaseException as exc:
            self._complete(meeting, exc)
            raise
        self._complete(meeting)

    def meet(
        self,
        key: tuple[Any, int],
        rank: int,
        size: int,
        op: str,
        payload: Any,
        finish: Callable[[list[Any]], None],
        result: Any = None,
        caller: CallerKind = "python",
    ) -> torch.futures.Future[Any]:
        """Take part in collective ``key`` as ``rank``; ``finish`` (given the payloads in rank order)
        runs once all ``size`` members did. Returns the future of the member's Work, which carries
        ``result``: complete on return outside autograd's engine; inside it, complete once the last
        member has joined (the engine call waits for it before it ends)."""
        meeting = self._join(key, rank, op, payload)
        fut: torch.futures.Future[Any] = torch.futures.Future()
        if len(meeting.arrivals) == size:
            self._finish(key, meeting, size, finish)
            fut.set_result(result)
            return fut
        if caller != "engine":
            self._park(key, meeting, rank, from_cpp=caller == "cpp")
            fut.set_result(result)
            return fut
        meeting.futures.append((fut, result))
        self._wait_at_engine_end(torch._C._current_graph_task_id()).pending.append(meeting)
        return fut

    def state_of(self, task: Task) -> _WorkerC10d:
        """The c10d state of the process ``task`` runs in: its worker's, or in a program run by
        ``python -m twinrpc.simulator run``, its simulated process's (``Simulation.process_of``):
        process groups belong to processes, and the processes a program starts with ``mp.spawn``
        may set up theirs before they join RPC as a worker."""
        process_of = self.process_of
        key = process_of(task) if process_of is not None else None
        if key is None:
            key = task.worker
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = _WorkerC10d()
        return state

    def _wait_at_engine_end(self, graph_task: int) -> _EngineWait:
        task = self.sched.current_task()
        assert task is not None
        key = (task.id, graph_task)
        wait = self._engine_waits.get(key)
        if wait is None:
            wait = self._engine_waits[key] = _EngineWait()

            def before_the_engine_ends() -> None:
                del self._engine_waits[key]
                if all(m.complete for m in wait.pending):
                    return
                self._engine_stack.append(wait)
                try:
                    wait.done.wait()
                finally:
                    self._engine_stack.remove(wait)
                    # runs once this task yields, after its engine call has returned
                    self.sched.schedule(0.0, lambda _arg: self._wake_top(), None)

            torch.autograd.Variable._execution_engine.queue_callback(before_the_engine_ends)
        return wait

    def broadcast(
        self,
        key: tuple[Any, int],
        rank: int,
        size: int,
        root: int,
        tensors: list[torch.Tensor],
        from_cpp: bool = False,
    ) -> None:
        """Broadcast ``root``'s tensors: the root goes on at once (its tensors are copied), a member
        arriving after it takes them at once, one arriving before it waits for it."""
        meeting = self._join(key, rank, f"broadcast from {root}", tensors)
        if rank == root:
            sent = [t.clone() for t in tensors]
            meeting.arrivals[root] = sent
            for r, theirs in meeting.arrivals.items():
                if r != root:
                    _copy_all(theirs, sent)
            for parked in reversed(meeting.waiting):
                self._release(parked)
            meeting.waiting.clear()
        elif root in meeting.arrivals:
            _copy_all(tensors, meeting.arrivals[root])
        else:
            self._park(key, meeting, rank, from_cpp)
            return
        if len(meeting.arrivals) == size:
            del self._meetings[key]


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


#: who called a process-group method, told by its Python caller's frame: c10d's Python API or this
#: module ("python"); autograd's engine, whose every Python entry is ``_engine_run_backward``
#: ("engine": a hook, such as DDP's reducer, during backward); other C++ code that Python called
#: ("cpp": a pybind11 call is open beneath, such as DDP's bucket rebuild). Torch's thread-local engine
#: state cannot tell: another task suspended inside an engine leaves it set on the shared thread.
CallerKind = str


def _caller_kind(caller: Any) -> CallerKind:
    code = caller.f_code
    if code.co_filename in _PYTHON_CALLERS:
        return "python"
    if code.co_name == "_engine_run_backward" and code.co_filename == _ENGINE_FILE:
        return "engine"
    return "cpp"


_PYTHON_CALLERS = frozenset({c10d.__file__, __file__})
_ENGINE_FILE = torch.autograd.graph.__file__


def _work(result: Any) -> Any:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _reduce(op: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
    R = dist.ReduceOp
    if op == R.SUM or op == R.AVG:
        out = torch.stack(tensors).sum(0)
        return out / len(tensors) if op == R.AVG else out
    if op == R.PRODUCT:
        return torch.stack(tensors).prod(0)
    if op == R.MIN:
        return torch.stack(tensors).amin(0)
    if op == R.MAX:
        return torch.stack(tensors).amax(0)
    raise NotImplementedError(
        f"twinrpc.simulator: reduce op {op} is not modelled by the simulated process group "
        "(SUM, AVG, PRODUCT, MIN and MAX are)"
    )


class SimProcessGroup(dist.ProcessGroup):
    """A process group whose members are simulated workers; see the module docstring."""

    def __init__(self, collectives: Collectives, key: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (rank, size) is the Python form
        self._collectives = collectives
        self._key = key
        self._rank = rank
        self._size = size
        self._seq = itertools.count()

    def _meet(self, op: str, payload: Any, finish: Callable[[list[Any]], None], result: Any = None) -> Any:
        """Join the group's next collective; returns its Work (see :meth:`Collectives.meet`). Called
        by the collective methods, whose caller tells whether C++ code called them."""
        key = (self._key, next(self._seq))
        caller = _caller_kind(sys._getframe(2))
        fut = self._collectives.meet(key, self._rank, self._size, op, payload, finish, result, caller)
        return _create_work_from_future(fut)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # the forms c10d and DDP call
        """``allreduce([tensors], AllreduceOptions)`` as c10d calls it, or ``allreduce(tensor, op)``,
        the overload DDP's ``join()`` calls for its unused-parameter map."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = dist.ReduceOp.SUM if opts is None else getattr(opts, "reduceOp", opts)

        def finish(members: list[list[torch.Tensor]]) -> None:
            for i in range(len(members[0])):
                if members[0][i].is_sparse:
                    raise NotImplementedError(
                        "twinrpc.simulator: allreduce of sparse tensors is not modelled by the simulated "
                        "process group"
                    )
                result = _reduce(op, [m[i] for m in members])
                for m in members:
                    m[i].copy_(result)

        return self._meet("allreduce", list(tensors), finish, tensors)

    allreduce_coalesced = allreduce

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]  # the form c10d calls
        caller = _caller_kind(sys._getframe(1))
        self.broadcast_tensors(tensors, opts.rootRank, from_cpp=caller != "python")
        return _work(tensors)

    def allgather(  # type: ignore[override]  # the form c10d calls
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        def finish(members: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]) -> None:
            for outs, _ in members:
                for i, slots in enumerate(outs):
                    for r, slot in enumerate(slots):
                        slot.copy_(members[r][1][i])

        return self._meet("allgather", (outputs, list(inputs)), finish, outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        def finish(members: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            whole = torch.cat([inp.reshape(-1) for _, inp in members])
            for out, _ in members:
                out.copy_(whole.view_as(out))

        return self._meet("allgather", (output, input), finish, [output])

    def broadcast_tensors(self, tensors: list[torch.Tensor], root: int, *, from_cpp: bool = False) -> None:
        """``torch.distributed._broadcast_coalesced`` for this group (DDP's start, its buffers)."""
        key = (self._key, next(self._seq))
        self._collectives.broadcast(key, self._rank, self._size, root, list(tensors), from_cpp)

    def verify_params(self, params: list[torch.Tensor]) -> None:
        """``torch.distributed._verify_params_across_processes`` for this group: every member's
        parameters have the same shapes (DDP's start), else each member raises."""
        mine = [(tuple(p.shape), tuple(p.stride())) for p in params]

        def finish(members: list[list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> None:
            for r, theirs in enumerate(members):
                if theirs != members[0]:
                    raise RuntimeError(
                        f"DDP expects same model across all ranks, but rank {r} has parameters of shapes "
                        f"{[s for s, _ in theirs]} where rank 0 has {[s for s, _ in members[0]]}"
                    )

        self._meet("verify params", mine, finish)

    def barrier(self, opts: Any = None) -> Any:
        return self._meet("barrier", None, lambda _members: None, [])

    def _unsupported(name: str) -> Callable[..., Any]:  # type: ignore[misc]  # a class-body helper
        def call(self: SimProcessGroup, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"twinrpc.simulator: {name} is not modelled by the simulated process group (allreduce, "
                "broadcast, allgather and barrier are); run this program in real processes"
            )

        call.__name__ = name
        return call

    gather = _unsupported("gather")
    scatter = _unsupported("scatter")
    reduce = _unsupported("reduce")
    reduce_scatter = _unsupported("reduce_scatter")
    _reduce_scatter_base = _unsupported("reduce_scatter")
    alltoall = _unsupported("alltoall")
    alltoall_base = _unsupported("alltoall")
    send = _unsupported("send")
    recv = _unsupported("recv")
    recv_anysource = _unsupported("recv")
    del _unsupported


class _ProcessGroups:
    """``init_process_group`` and ``destroy_process_group`` as the simulation serves them."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives

    def init_process_group(
        self,
        backend: Any = None,
        init_method: str | None = None,
        timeout: timedelta | None = None,
        world_size: int = -1,
        rank: int = -1,
        store: Any = None,
        group_name: str = "",
        pg_options: Any = None,
        device_id: Any = None,
        **_ignored: Any,
    ) -> None:
        task = self.collectives.sched.current_task()
        if task is None:
            raise RuntimeError("twinrpc.simulator: init_process_group outside a simulated worker")
        state = self.collectives.state_of(task)
        if state.default_pg is not None:
            raise ValueError("trying to initialize the default process group twice!")
        if world_size < 0 or rank < 0:
            raise ValueError(
                "twinrpc.simulator: init_process_group needs rank and world_size (the simulation has no "
                f"environment rendezvous for process groups); got rank={rank}, world_size={world_size}"
            )
        state.default_groups += 1
        pg = SimProcessGroup(self.collectives, ("default", state.default_groups), rank, world_size)
        name = group_name or str(state.group_count)
        state.group_count += 1
        state.default_pg = pg
        state.pg_map[pg] = (str(backend or "gloo").lower(), store)
        state.pg_names[pg] = name
        state.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        state.pg_backend_config[pg] = f"cpu:{BACKEND_NAME}"
        tag = f"ptd:{name}"
        state.tags_to_pg.setdefault(tag, []).append(pg)
        state.tags_to_pg.setdefault("", []).append(pg)
        state.pg_to_tag[pg] = tag

    def new_group(
        self,
        ranks: Any = None,
        timeout: timedelta | None = None,
        backend: Any = None,
        pg_options: Any = None,
        use_local_synchronization: bool = False,
        group_desc: str | None = None,
        device_id: Any = None,
        sort_ranks: bool = True,
    ) -> Any:
        """A simulated group of ``ranks`` of the default group (all of them when None): the k-th
        group of the same ranks that each member makes meets the others' k-th; a worker outside
        ``ranks`` gets ``GroupMember.NON_GROUP_MEMBER``, as from c10d."""
        state = self._state("new_group")
        default = state.default_pg
        if default is None:
            raise ValueError(
                "Default process group has not been initialized, please make sure to call init_process_group."
            )
        members = list(range(default.size())) if ranks is None else list(ranks)
        if sort_ranks:
            members.sort()
        for r in members:
            if not 0 <= r < default.size():
                raise ValueError(
                    "The new group's rank should be within the world_size set by init_process_group"
                )
        key = tuple(members)
        k = state.subgroups.get(key, 0)
        state.subgroups[key] = k + 1
        name = str(state.group_count)
        state.group_count += 1
        if default.rank() not in members:
            return c10d.GroupMember.NON_GROUP_MEMBER
        pg = SimProcessGroup(
            self.collectives,
            ("group", state.default_groups, key, k),
            members.index(default.rank()),
            len(members),
        )
        state.pg_map[pg] = (str(backend or state.pg_map[default][0]).lower(), None)
        state.pg_names[pg] = name
        state.pg_group_ranks[pg] = {r: i for i, r in enumerate(members)}
        state.pg_backend_config[pg] = f"cpu:{BACKEND_NAME}"
        tag = f"ptd:{name}"
        state.tags_to_pg.setdefault(tag, []).append(pg)
        state.tags_to_pg.setdefault("", []).append(pg)
        state.pg_to_tag[pg] = tag
        return pg

    def _state(self, what: str) -> _WorkerC10d:
        task = self.collectives.sched.current_task()
        if task is None:
            raise RuntimeError(f"twinrpc.simulator: {what} outside a simulated worker")
        return self.collectives.states[task.worker]

    @staticmethod
    def _broadcast_coalesced(group: Any, tensors: list[torch.Tensor], buffer_size: int, src: int = 0) -> None:
        _simulated(group, "_broadcast_coalesced").broadcast_tensors(tensors, src)

    @staticmethod
    def _verify_params_across_processes(group: Any, params: list[torch.Tensor], logger: Any = None) -> None:
        _simulated(group, "_verify_params_across_processes").verify_params(params)

    def destroy_process_group(self, group: Any = None) -> None:
        task = self.collectives.sched.current_task()
        if task is None:
            raise RuntimeError("twinrpc.simulator: destroy_process_group outside a simulated worker")
        state = self.collectives.state_of(task)
        if group is None or group is state.default_pg:
            if state.default_pg is None:
                raise ValueError(
                    "Default process group has not been initialized, please make sure to call "
                    "init_process_group."
                )
            state.clear()
            return
        for table in (state.pg_map, state.pg_names, state.pg_group_ranks, state.pg_backend_config):
            table.pop(group, None)
        state.pg_to_tag.pop(group, None)


def _simulated(group: Any, what: str) -> SimProcessGroup:
    if not isinstance(group, SimProcessGroup):
        raise RuntimeError(
            f"twinrpc.simulator: {what} on {group!r}, which is not a simulated process group; inside a "
            "simulation, make groups with torch.distributed.init_process_group"
        )
    return group


#: what the simulation serves in torch.distributed (and c10d) for a run. The two private helpers are
#: C++ functions that DDP calls to start: a task blocked inside a C++ call that another task's C++ call
#: outlives breaks pybind11's per-thread bookkeeping, so they become Python calls of the group.
_SERVED = (
    "init_process_group",
    "destroy_process_group",
    "new_group",
    "_broadcast_coalesced",
    "_verify_params_across_processes",
)


@contextmanager
def serve_process_groups(
    sched: Scheduler, owner: object, process_of: Callable[[Task], Hashable | None] | None
) -> Iterator[None]:
    """For the block, c10d's state is per simulated worker (or per process: ``process_of``) and
    process groups are simulated, for the tasks of the simulation ``owner``."""
    collectives = Collectives(sched, process_of)
    groups = _ProcessGroups(collectives)
    outside = c10d._world
    saved = {
        (module, name): getattr(module, name)
        for module in (c10d, dist)
        for name in _SERVED
        if hasattr(module, name)
    }
    c10d._world = _PerWorkerWorld(sched, owner, collectives.state_of, outside)
    for module, name in saved:
        setattr(module, name, getattr(groups, name))
    try:
        yield
    finally:
        c10d._world = outside
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
