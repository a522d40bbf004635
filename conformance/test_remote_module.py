"""RemoteModule (RMOD-1..RMOD-9), after PyTorch's remote_module_test.py: construction and remote devices,
forward and forward_async, remote parameters and the module RRef, training with distributed autograd and
DistributedOptimizer (which also holds distributed autograd and the optimizer to local training: DAG-9,
OPT-5), train/eval, sending an instance over RPC, the nn.Module methods it refuses, CPU-only devices and
TorchScript modules."""

from __future__ import annotations

import inspect
import io
import pickle
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.nn.api.remote_module import _REMOTE_MODULE_PICKLED_ATTRIBUTES

from conformance._support import outcome


class _EchoModule(nn.Module):
    """PyTorch's test module: ``forward`` returns its arguments reversed; one parameter of ones."""

    def __init__(self, first_arg: int, first_kwarg: int = -1) -> None:
        super().__init__()
        self.param1 = nn.Parameter(torch.ones(1))
        self.calls = 0
        self.made_with = (first_arg, first_kwarg)

    def forward(self, tensor: Tensor, number: int, word: str = "default") -> tuple[str, int, Tensor]:
        self.calls += 1
        return word, number, tensor


class _NotAModule:
    def __init__(self, first_arg: int, first_kwarg: int = -1) -> None:
        pass


class _Nested(nn.Module):
    """Parameters of its own and of a submodule (``remote_parameters(recurse=...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.own = nn.Parameter(torch.full((2,), 3.0))
        self.inner = nn.Linear(2, 1)
        with torch.no_grad():
            self.inner.weight.fill_(0.5)
            self.inner.bias.fill_(-1.0)


class _SeededLinear(nn.Linear):
    """A linear layer whose initial weights depend only on ``seed``: built alike on any worker."""

    def __init__(self, seed: int) -> None:
        super().__init__(3, 2)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(2, 3, generator=g))
            self.bias.copy_(torch.randn(2, generator=g))


def _echo(ctx: Any, remote_device: str = "worker1/cpu") -> Any:
    return ctx.nn.RemoteModule(remote_device, _EchoModule, (1,), {"first_kwarg": 2})


# -- RMOD-1, RMOD-2 -----------------------------------------------------------------------------------------
def _calls(owner_rref: Any) -> int:
    return owner_rref.local_value().calls


def _made_with(owner_rref: Any) -> tuple[int, int]:
    return owner_rref.local_value().made_with


def _forward_forms(ctx: Any, remote_device: str) -> dict[str, Any]:
    rm = _echo(ctx, remote_device)
    args = (torch.ones(1), 2, "3")
    rref = rm.get_module_rref()
    fut = rm.forward_async(*args)
    return {
        "future": (all(callable(getattr(fut, m, None)) for m in ("wait", "then", "done")), fut.wait()),
        "on": rm.on,
        "device": rm.device,
        "flags": (rm.is_scriptable, rm.is_device_map_set),
        "owner": rref.owner().name,
        "made_with": ctx.rpc.rpc_sync(rref.owner(), _made_with, (rref,)),
        "forward": rm.forward(*args),
        "forward_async": rm.forward_async(*args).wait(),
        "kwargs": (
            rm.forward(torch.ones(1), 2, word="w"),
            rm.forward_async(torch.ones(1), 2, word="w").wait(),
        ),
        "call": rm(torch.zeros(2), 5),
        "calls": ctx.rpc.rpc_sync(rref.owner(), _calls, (rref,)),
    }


@pytest.mark.spec("RMOD-1", "RMOD-2")
@pytest.mark.parametrize(
    ("remote_device", "on"), [("worker1/cpu", "worker1"), ("rank:1/cpu", 1), ("worker1", "worker1")]
)
def test_forward_and_forward_async_run_the_modules_forward_on_the_remote_device(
    world: Any, remote_device: str, on: Any
) -> None:
    got = world.run_on(0, _forward_forms, remote_device)
    expected = ("3", 2, torch.ones(1))
    assert (got["on"], got["device"], got["flags"], got["owner"]) == (on, "cpu", (False, False), "worker1")
    assert got["made_with"] == (1, 2)
    assert got["forward"] == expected and got["forward_async"] == expected
    assert got["kwargs"] == (("w", 2, torch.ones(1)), ("w", 2, torch.ones(1)))
    assert got["call"][:2] == ("default", 5) and torch.equal(got["call"][2], torch.zeros(2))
    assert got["future"] == (True, expected)
    assert got["calls"] == 6


def _remote_raise(ctx: Any) -> Any:
    return outcome(lambda: ctx.nn.RemoteModule("worker1/cpu", _EchoModule, (1,)).forward(torch.ones(1)))


def _bad_module(ctx: Any) -> Any:
    rm = ctx.nn.RemoteModule("worker1/cpu", _NotAModule, (1,), {"first_kwarg": 2})  # returns at once
    return outcome(rm.forward)


@pytest.mark.spec("RMOD-1", "RMOD-2")
def test_a_module_cls_that_makes_no_module_and_a_failing_forward_raise_at_the_caller(world: Any) -> None:
    kinds, message = world.run_on(0, _bad_module)
    assert kinds == ("ValueError",)
    assert "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>," in message
    kinds, message = world.run_on(0, _remote_raise)  # the remote forward misses its `number` argument
    assert kinds == ("TypeError",)
    assert "number" in message


def _before_and_after_init(ctx: Any) -> dict[str, Any]:
    def make(device: str) -> Any:
        try:
            ctx.nn.RemoteModule(device, _EchoModule, (1,))
            return "made"
        except Exception as exc:
            return type(exc).__name__, str(exc)

    got = {"before_init": make("worker1/cpu")}
    ctx.init_rpc()
    if ctx.rank == 0:
        for device in ("worker1/cuda:0/cuda:1", "/cpu", "worker1/cpu2", "worker1/foo", "nosuch/cpu"):
            got[device] = make(device)
    ctx.rpc.shutdown()
    return got


@pytest.mark.spec("RMOD-1")
def test_a_remote_module_needs_rpc_and_a_valid_remote_device(world: Any) -> None:
    got = world.spawn(_before_and_after_init)
    assert got[1] == {"before_init": ("AssertionError", "RemoteModule only works in RPC.")}
    g = got[0]
    assert g["before_init"] == ("AssertionError", "RemoteModule only works in RPC.")
    assert g["worker1/cuda:0/cuda:1"][0] == "ValueError"
    assert g["worker1/cuda:0/cuda:1"][1].startswith(
        "Could not parse remote_device: worker1/cuda:0/cuda:1. The valid format is '<workername>/<device>'"
    )
    assert g["/cpu"][0] == "ValueError" and "Could not parse remote_device: /cpu." in g["/cpu"][1]
    assert g["worker1/cpu2"][0] == "RuntimeError" and "Invalid device string: 'cpu2'" in g["worker1/cpu2"][1]
    assert (
        g["worker1/foo"][0] == "RuntimeError"
        and "device type at start of device string" in g["worker1/foo"][1]
    )
    assert g["nosuch/cpu"][0] == "RuntimeError" and "nosuch" in g["nosuch/cpu"][1]


# -- RMOD-3 -----------------------------------------------------------------------------------------------
def _parameters(ctx: Any) -> dict[str, Any]:
    rm = ctx.nn.RemoteModule("worker1/cpu", _Nested)
    deep, shallow = rm.remote_parameters(), rm.remote_parameters(recurse=False)
    rref = rm.get_module_rref()
    module_copy = rref.to_here()
    return {
        "same_rref": rref is rm.module_rref,
        "module": type(module_copy).__name__,
        "deep": [(p.owner().name, p.is_owner(), p.to_here()) for p in deep],
        "shallow": [p.to_here() for p in shallow],
        "copy": [p.detach() for p in module_copy.parameters()],
    }


@pytest.mark.spec("RMOD-3")
def test_remote_parameters_are_rrefs_on_the_owner_and_the_module_rref_is_the_module(world: Any) -> None:
    got = world.run_on(0, _parameters)
    assert got["same_rref"] is True and got["module"] == "_Nested"
    expected = [torch.full((2,), 3.0), torch.full((1, 2), 0.5), torch.full((1,), -1.0)]
    assert [(owner, is_owner) for owner, is_owner, _ in got["deep"]] == [("worker1", False)] * 3
    assert all(torch.equal(a, b) for (_, _, a), b in zip(got["deep"], expected, strict=True))
    assert len(got["shallow"]) == 1 and torch.equal(got["shallow"][0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got["copy"], expected, strict=True))


# -- RMOD-4 -----------------------------------------------------------------------------------------------
_STEPS = 3


def _inputs() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(_STEPS)]


def _train_remotely(ctx: Any) -> dict[str, Any]:
    rm = ctx.nn.RemoteModule("worker1/cpu", _SeededLinear, (5,))
    local = nn.Linear(2, 1)  # a hybrid model: a local layer after the remote one
    with torch.no_grad():
        local.weight.fill_(0.25)
        local.bias.zero_()
    opt = ctx.optim.DistributedOptimizer(
        torch.optim.SGD, [*rm.remote_parameters(), *(ctx.rpc.RRef(p) for p in local.parameters())], lr=0.1
    )
    grads = []
    for x, target in _inputs():
        with ctx.dist_autograd.context() as cid:
            loss = ((local(rm(x)) - target[:, :1]) ** 2).mean()
            ctx.dist_autograd.backward(cid, [loss])
            grads.append(ctx.dist_autograd.get_gradients(cid)[local.weight].clone())
            opt.step(cid)
    return {
        "remote": [p.to_here() for p in rm.remote_parameters()],
        "local": [p.detach().clone() for p in local.parameters()],
        "local_grads": grads,
    }


@pytest.mark.spec("RMOD-4", "DAG-9", "OPT-5")
def test_training_a_remote_module_with_distributed_optimizer_equals_local_training(world: Any) -> None:
    got = world.run_on(0, _train_remotely)
    remote_part, local = _SeededLinear(5), nn.Linear(2, 1)
    with torch.no_grad():
        local.weight.fill_(0.25)
        local.bias.zero_()
    opt = torch.optim.SGD([*remote_part.parameters(), *local.parameters()], lr=0.1)
    grads = []
    for x, target in _inputs():
        opt.zero_grad()
        ((local(remote_part(x)) - target[:, :1]) ** 2).mean().backward()
        grads.append(local.weight.grad.clone())
        opt.step()
    for got_t, want in zip(got["remote"], remote_part.parameters(), strict=True):
        torch.testing.assert_close(got_t, want.detach())
    for got_t, want in zip(got["local"], local.parameters(), strict=True):
        torch.testing.assert_close(got_t, want.detach())
    for got_t, want in zip(got["local_grads"], grads, strict=True):
        torch.testing.assert_close(got_t, want)
    assert not torch.equal(got["remote"][0], _SeededLinear(5).weight.detach())  # it did train


# -- RMOD-5 -----------------------------------------------------------------------------------------------
def _training(owner_rref: Any) -> bool:
    return owner_rref.local_value().training


def _train_eval(ctx: Any) -> list[Any]:
    rm = _echo(ctx)
    rref = rm.get_module_rref()
    seen = []
    for switch in (rm.train, rm.eval, rm.train):
        copy = switch()
        seen.append((type(copy).__name__, copy.training, ctx.rpc.rpc_sync("worker1", _training, (rref,))))
    return seen


@pytest.mark.spec("RMOD-5")
def test_train_and_eval_set_the_remote_modules_mode_and_return_a_copy_of_it(world: Any) -> None:
    assert world.run_on(0, _train_eval) == [
        ("_EchoModule", True, True),
        ("_EchoModule", False, False),
        ("_EchoModule", True, True),
    ]


def _train_false(ctx: Any) -> bool:
    rm = _echo(ctx)
    rm.train(False)
    return ctx.rpc.rpc_sync("worker1", _training, (rm.get_module_rref(),))


@pytest.mark.spec("RMOD-5")
def test_train_false_puts_the_remote_module_in_eval_mode(world: Any) -> None:
    assert world.run_on(0, _train_false) is False


# -- RMOD-6 -----------------------------------------------------------------------------------------------
def _received(remote_module: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    attrs = remote_module.__dict__
    return {
        "type": type(remote_module).__name__,
        "keys": list(attrs),
        "values": (attrs["on"], attrs["device"], attrs["is_device_map_set"], attrs["is_scriptable"]),
        "owner": remote_module.get_module_rref().owner().name,
        "forward": remote_module.forward(*args),
        "forward_async": remote_module.forward_async(*args).wait(),
    }


def _echo_back(remote_module: Any) -> Any:
    return remote_module


def _send(ctx: Any) -> dict[str, Any]:
    rm = _echo(ctx)
    rm.new_attr = 1  # set after construction: stays behind
    args = (torch.ones(1), 2, "3")
    got = ctx.rpc.rpc_sync("worker2", _received, (rm, args))
    back = ctx.rpc.rpc_sync("worker2", _echo_back, (rm,))
    got["back"] = (type(back).__name__, back.forward(*args), hasattr(back, "new_attr"))
    rref = rm.get_module_rref()
    got["calls"] = ctx.rpc.rpc_sync("worker1", _calls, (rref,))  # one module served every forward
    return got


@pytest.mark.spec("RMOD-6")
def test_a_remote_module_sent_over_rpc_arrives_sharing_the_same_remote_module(world: Any) -> None:
    got = world.run_on(0, _send, world_size=3)
    assert got["type"] == "RemoteModule"
    # PyTorch's own list, as its remote_module_test.py expects: the sent attributes, then the methods
    assert got["keys"] == [*_REMOTE_MODULE_PICKLED_ATTRIBUTES, "forward_async", "forward"]
    assert _REMOTE_MODULE_PICKLED_ATTRIBUTES[-1] == "module_rref"
    assert got["values"] == ("worker1", "cpu", False, False)
    assert got["owner"] == "worker1"
    assert got["forward"] == got["forward_async"] == ("3", 2, torch.ones(1))
    assert got["back"] == ("RemoteModule", ("3", 2, torch.ones(1)), False)
    assert got["calls"] == 3


def _from_module_rref(ctx: Any) -> Any:
    rm = _echo(ctx)
    args = (torch.ones(1), 2, "3")
    twin = ctx.rpc.rpc_sync(
        "worker2", ctx.nn.RemoteModule.init_from_module_rref, ("worker2", rm.get_module_rref())
    )
    local_twin = ctx.nn.RemoteModule.init_from_module_rref("worker1/cpu", rm.get_module_rref())
    return (
        type(twin).__name__,
        twin.on,
        twin.get_module_rref().owner().name,
        local_twin.forward(*args),
        ctx.rpc.rpc_sync("worker2", _received, (twin, args))["forward"],
        ctx.rpc.rpc_sync("worker1", _calls, (rm.get_module_rref(),)),
    )


@pytest.mark.spec("RMOD-6")
def test_init_from_module_rref_makes_a_remote_module_over_the_same_module(world: Any) -> None:
    expected = ("3", 2, torch.ones(1))
    assert world.run_on(0, _from_module_rref, world_size=3) == (
        "RemoteModule",
        "worker2",
        "worker1",
        expected,
        expected,
        3,  # both forwards of _received and the local twin's ran on the one module
    )


def _python_pickle(ctx: Any) -> list[Any]:
    rm = _echo(ctx)
    return [outcome(lambda: pickle.dumps(rm)), outcome(lambda: torch.save(rm, io.BytesIO()))]


@pytest.mark.spec("RMOD-6")
def test_the_python_pickler_refuses_a_remote_module(world: Any) -> None:
    message = "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC"
    assert world.run_on(0, _python_pickle) == [(("RuntimeError",), message)] * 2


# -- RMOD-7 -----------------------------------------------------------------------------------------------
def _hook(*args: Any) -> None:
    return None


_REFUSED: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("register_buffer", ("buffer", torch.ones(5)), {}),
    ("register_parameter", ("param", nn.Parameter(torch.ones(1))), {}),
    ("add_module", ("empty", None), {}),
    ("apply", (_hook,), {}),
    ("cuda", (), {}),
    ("ipu", (), {}),
    ("xpu", (), {}),
    ("cpu", (), {}),
    ("type", (torch.FloatTensor,), {}),
    ("float", (), {}),
    ("double", (), {}),
    ("half", (), {}),
    ("bfloat16", (), {}),
    ("to", ("cpu",), {"dtype": torch.int32}),
    ("register_backward_hook", (_hook,), {}),
    ("register_forward_pre_hook", (_hook,), {}),
    ("register_forward_hook", (_hook,), {}),
    ("state_dict", (), {}),
    ("load_state_dict", ({},), {}),
    ("named_parameters", (), {}),
    ("buffers", (), {}),
    ("named_buffers", (), {}),
    ("children", (), {}),
    ("named_children", (), {}),
    ("modules", (), {}),
    ("named_modules", (), {}),
    ("requires_grad_", (), {}),
    ("zero_grad", (), {}),
    ("share_memory", (), {}),
    ("extra_repr", (), {}),
]


def _refused(ctx: Any) -> dict[str, Any]:
    rm = _echo(ctx)
    got = {name: outcome(lambda n=name, a=a, k=k: getattr(rm, n)(*a, **k)) for name, a, k in _REFUSED}
    got["parameters"] = outcome(rm.parameters)
    got["still works"] = rm.forward(torch.ones(1), 2)
    return got


@pytest.mark.spec("RMOD-7")
def test_nn_module_methods_a_remote_module_refuses_raise_value_error(world: Any) -> None:
    got = world.run_on(0, _refused)
    for name, _, _ in _REFUSED:
        assert got[name] == (("ValueError",), f"Method ``{name}`` not supported for RemoteModule"), name
    assert got["parameters"] == (
        ("ValueError",),
        "Method ``parameters`` not supported for RemoteModule. Please use ``remote_parameters`` instead.",
    )
    assert got["still works"] == ("default", 2, torch.ones(1))


@pytest.mark.spec("RMOD-7")
@pytest.mark.backends("sim")
def test_remote_module_methods_have_pytorchs_signatures() -> None:
    """Compares twinrpc.nn.RemoteModule with torch's class directly in the pytest process: needs no
    world, so it runs once (on torch it would compare torch with itself)."""
    from torch.distributed.nn.api.remote_module import RemoteModule as TorchRemoteModule
    from torch.distributed.nn.api.remote_module import _RemoteModule

    from twinrpc.nn import RemoteModule

    def params(fn: Any) -> list[tuple[str, str, Any]]:
        sig = inspect.signature(fn)
        return [(p.name, p.kind.name, p.default) for p in sig.parameters.values() if p.name != "self"]

    names = sorted(
        n
        for cls in (_RemoteModule, TorchRemoteModule)
        for n in vars(cls)
        if not n.startswith("_") or n == "__init__"
    )
    assert "remote_parameters" in names and "init_from_module_rref" in names and "train" in names
    for name in names:
        theirs = getattr(TorchRemoteModule, name)
        if name == "__init__":
            theirs = TorchRemoteModule.__init__
        assert params(getattr(RemoteModule, name)) == params(theirs), name


# -- RMOD-8 -----------------------------------------------------------------------------------------------
def _cuda(ctx: Any) -> Any:
    return outcome(lambda: _echo(ctx, "worker1/cuda:0"))


@pytest.mark.spec("RMOD-8")
@pytest.mark.backends("sim", "gloo")
def test_a_non_cpu_remote_device_is_refused_when_the_remote_module_is_made(world: Any) -> None:
    """twinrpc runs on the CPU only; PyTorch would place the module on the GPU (or, on a CPU-only
    build, fail at the first forward), so this twinrpc requirement has no torch counterpart."""
    kinds, message = world.run_on(0, _cuda)
    assert kinds == ("ValueError",)
    assert "'cuda:0'" in message and "CPU only" in message


# -- RMOD-9 -----------------------------------------------------------------------------------------------
def _run_script_module(module: Any, x: Tensor) -> tuple[str, Tensor, Any]:
    return type(module).__name__, module(x), torch.jit.script(nn.Linear(3, 1))


def _script_modules(ctx: Any) -> dict[str, Any]:
    assert ctx.nn.RemoteModule  # torch.distributed.nn imported, as the requirement asks
    scripted = torch.jit.script(_SeededLinear(5))
    x = torch.ones(2, 3)
    name, y, returned = ctx.rpc.rpc_sync("worker1", _run_script_module, (scripted, x))
    return {
        "arrived": name,
        "output": torch.equal(y, scripted(x)),
        "returned": (type(returned).__name__, [p.shape for p in returned.parameters()]),
        "python pickler": outcome(lambda: pickle.dumps(scripted))[0],
    }


@pytest.mark.spec("RMOD-9")
def test_a_scripted_module_travels_over_rpc_as_its_torchscript(world: Any) -> None:
    assert world.run_on(0, _script_modules) == {
        "arrived": "RecursiveScriptModule",
        "output": True,
        "returned": ("RecursiveScriptModule", [torch.Size([1, 3]), torch.Size([1])]),
        "python pickler": ("RuntimeError",),
    }
