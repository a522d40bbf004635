"""The protocol core keeps to its seams (docs/explanation/architecture.md, "The seam").

The core's objects (agent, shutdown protocol, control channel, RRef context, distributed autograd)
talk to each other through public methods only, and to their world only through what
``twinrpc._world.World`` declares: no object reaches into another's private state, and nothing probes
a world for undeclared attributes with ``getattr``/``hasattr``. These tests read the core's source, so
a shortcut across a seam fails here before it turns into a difference between the worlds.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
from collections.abc import Iterator

from _private_reaches import private_reaches

import twinrpc
from twinrpc._world import NO_OBSERVERS, World

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
    "_find_builtin",
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
    membership = None

    def __init__(self) -> None:
        self.spawned: list[object] = []

    def spawn(self, fn: object, *args: object) -> None:
        self.spawned.append(fn)


def test_a_world_that_defines_no_hooks_gets_the_real_worlds_defaults() -> None:
    world = _MinimalWorld()
    assert world.observers() is NO_OBSERVERS
    assert NO_OBSERVERS.rrefs is None and NO_OBSERVERS.autograd is None

    def delete() -> None:
        pass

    world.schedule_rref_delete(delete)  # deferred to a task, never run inside __del__
    assert world.spawned == [delete]


def test_both_worlds_implement_every_required_method_of_the_seam() -> None:
    """Subclassing the protocol inherits its stubs: a world that forgot ``send`` would silently send
    nothing. Every method of ``World`` but the optional hooks must be the world's own."""
    from twinrpc.impl._world import GlooWorld
    from twinrpc.simulator._world import SimWorld

    optional = {"observers", "schedule_rref_delete"}
    required = {
        name
        for name, member in vars(World).items()
        if inspect.isfunction(member) and not name.startswith("_") and name not in optional
    }
    assert required >= {"now", "send", "spawn", "submit", "call_later", "start", "stop"}
    for cls in (SimWorld, GlooWorld):
        assert World in cls.__mro__
        inherited = sorted(name for name in required if getattr(cls, name) is getattr(World, name))
        assert not inherited, f"{cls.__name__} does not implement {inherited}"
