"""The protocol core keeps to its seams (docs/explanation/architecture.md, "The seam").

The core's objects (agent, shutdown protocol, control channel, RRef context, distributed autograd)
talk to each other through public methods only, and to their world only through what
``twinrpc._world.World`` declares: no object reaches into another's private state, and nothing probes
a world for undeclared attributes with ``getattr``/``hasattr``. The seam file itself stands on the
core's plain data only, the core imports no world (it finds the real one by its entry point), and a
world's join is told its options rather than reading ``twinrpc.rpc``. These tests read the source, so
a shortcut across a seam fails here before it turns into a difference between the worlds.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _private_reaches import private_reaches

import twinrpc
from twinrpc._message import Message
from twinrpc._world import NO_OBSERVERS, JoinOptions, TimerHandle, World, WorldEvents, installed_world

CORE = pathlib.Path(twinrpc.__file__).parent

#: private names the core may use on objects it does not define: PyTorch's own (the core mirrors
#: PyTorch's API, whose public functions have private helpers users call, e.g.
#: ``dist_autograd._current_context()._context_id()``, and it uses torch internals on tensors and
#: autograd nodes)
TORCH_PRIVATE = {
    "_context_id",
    "_current_context",
    "_is_valid_context",
    "_indices",
    "_values",
    "_backward_hooks",
    "_backward_cls",
    "_builtins",
    "_get_builtin_table",
    "_C",
    "_jit_resolve_packet",
    "_VariableFunctionsClass",  # what a pickle names as the owner of torch.add (twinrpc._unpickle_allow)
    # how PyTorch's PyRRef decides whether RRef(value) is fetched through TorchScript (twinrpc._rref)
    "_jit_internal",
    "_state",
    "_get_script_class",
    "_jit_try_infer_type",
}


def _core_modules() -> Iterator[pathlib.Path]:
    yield from sorted(p for p in CORE.rglob("*.py") if "simulator" not in p.parts and "impl" not in p.parts)


def _private_reaches(path: pathlib.Path) -> list[str]:
    """The shared scan (tests/_private_reaches.py), strict: a module's privates are its own only."""
    return private_reaches(path, base=CORE.parent, allowed=TORCH_PRIVATE)


def test_no_core_object_reaches_into_another_objects_private_state() -> None:
    reaches = [r for path in _core_modules() for r in _private_reaches(path)]
    assert not reaches, "private attributes used across objects:\n" + "\n".join(reaches)


def test_the_core_does_not_probe_its_world_for_undeclared_hooks() -> None:
    probes = []
    for path in _core_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and "world" in ast.unparse(node.args[0])
            ):
                probes.append(f"{path.relative_to(CORE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, "\n".join(probes)


class _MinimalWorld(World):
    """A world that implements only the required methods, to see what the optional hooks default to."""

    clock_name = "test"

    def __init__(self) -> None:
        self.spawned: list[object] = []

    def now(self) -> float:
        return 0.0

    def send(self, msg: Message) -> None:
        pass

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        self.spawned.append(fn)

    def submit(self, fn: Callable[..., Any], *args: Any, brief: bool = False) -> None:
        fn(*args)

    def call_later(self, delay: float, fn: Callable[[], Any]) -> TimerHandle:
        return TimerHandle()

    def start(self, agent: WorldEvents) -> None:
        pass

    def stop(self, graceful: bool = False) -> None:
        pass


def test_a_world_that_defines_no_hooks_gets_the_real_worlds_defaults() -> None:
    world = _MinimalWorld()
    assert world.observers() is NO_OBSERVERS
    assert NO_OBSERVERS.rrefs is None and NO_OBSERVERS.autograd is None

    def delete() -> None:
        pass

    world.schedule_rref_delete(delete)  # deferred to a task, never run inside __del__
    assert world.spawned == [delete]
    assert world.threaded  # its tasks are threads of this process, as the gloo world's


def test_a_world_that_lacks_a_required_method_cannot_be_made() -> None:
    """``World`` is an ABC: a world that forgot ``send`` fails when it is made, rather than sending
    nothing."""
    members = {k: v for k, v in vars(_MinimalWorld).items() if k != "send" and not k.startswith("__")}
    without_send = type("WorldWithoutSend", (World,), {**members, "__init__": _MinimalWorld.__init__})
    with pytest.raises(TypeError, match="send"):
        without_send()
    members.pop("clock_name")
    without_clock = type("WorldWithoutClock", (World,), {**members, "__init__": _MinimalWorld.__init__})
    with pytest.raises(TypeError, match="clock_name"):
        without_clock()
    assert _MinimalWorld().membership is None  # the hook's default: a static group


def test_both_worlds_are_complete_worlds() -> None:
    from twinrpc.impl._world import GlooWorld
    from twinrpc.simulator._world import SimWorld

    for cls in (SimWorld, GlooWorld):
        assert issubclass(cls, World)
        assert not cls.__abstractmethods__, (
            f"{cls.__name__} does not implement {sorted(cls.__abstractmethods__)}"
        )


def _imports(
    path: pathlib.Path, root: pathlib.Path = CORE, package: str = "twinrpc"
) -> Iterator[tuple[str, bool, int]]:
    """Every twinrpc module ``path`` (in ``package``, whose folder is ``root``) imports: (its absolute
    name, whether only for typing, line)."""
    module = ".".join((package, *path.relative_to(root).with_suffix("").parts))
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "twinrpc" or name.startswith("twinrpc."):
                yield name, id(node) in typing_only, node.lineno


#: what the seam may name: the core's plain data (and, for typing only, the RRef states its observers
#: are told about)
SEAM_GROUND = {"twinrpc._message", "twinrpc._departure", "twinrpc._errors", "twinrpc._worker_info"}
SEAM_TYPES_ONLY = {"twinrpc._rref"}


def test_the_seam_imports_nothing_of_the_core_above_it() -> None:
    seam = CORE / "_world.py"
    wrong = [
        f"_world.py:{line}: {name}{' (typing)' if typing else ''}"
        for name, typing, line in _imports(seam)
        if not (typing and name in SEAM_GROUND | SEAM_TYPES_ONLY)
    ]
    assert not wrong, "the seam (src/twinrpc/_world.py) imports the core above it:\n" + "\n".join(wrong)


def test_the_core_does_not_import_a_world() -> None:
    """The core finds the real world by its entry point (``twinrpc._world.installed_world``)."""
    wrong = [
        f"{path.relative_to(CORE.parent)}:{line}: {name}"
        for path in _core_modules()
        for name, _typing, line in _imports(path)
        if name == "twinrpc.impl" or name.startswith("twinrpc.impl.")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_default_world_is_the_installed_gloo_world() -> None:
    import twinrpc.impl

    assert installed_world() is twinrpc.impl.connect


def test_the_worlds_join_reads_no_public_options() -> None:
    """A world is told its options by ``init_rpc`` (``JoinOptions``), never reads ``twinrpc.rpc``."""
    import twinrpc.impl
    import twinrpc.simulator

    impl = pathlib.Path(twinrpc.impl.__file__).parent
    sim = pathlib.Path(twinrpc.simulator.__file__).parent
    joins = [(p, impl, "twinrpc.impl") for p in sorted(impl.glob("*.py"))]
    joins += [(sim / name, sim, "twinrpc.simulator") for name in ("_world.py", "_rendezvous.py")]
    wrong = [
        f"{path.name}:{line}: {name}"
        for path, root, package in joins
        for name, _typing, line in _imports(path, root, package)
        if name == "twinrpc.rpc" or name.startswith("twinrpc.rpc.")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_join_options_never_show_the_job_key() -> None:
    options = JoinOptions(
        rpc_timeout=1.0,
        init_method="env://",
        num_worker_threads=1,
        heartbeat_interval=1.0,
        heartbeat_misses=3,
        unpickle_allow=None,
        auth_key=b"secret",
    )
    assert "secret" not in repr(options)
