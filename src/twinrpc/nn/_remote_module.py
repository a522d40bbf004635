"""``RemoteModule``: a module built on another worker whose ``forward`` runs there over RPC (RMOD-1..RMOD-9).

As PyTorch's ``torch.distributed.nn.api.remote_module``: the module lives on its owner behind an RRef
(``module_rref``); ``forward``/``forward_async`` are one ``rpc_async`` to the owner each, so distributed
autograd records them like any other RPC and ``remote_parameters()`` feeds a ``DistributedOptimizer``.
PyTorch generates the two forward methods from TorchScript templates; for a Python module its generated
methods take ``(*args, **kwargs)``, as these plain Python ones do. Sent inside an RPC, a RemoteModule
arrives as a RemoteModule sharing the same ``module_rref``; the Python pickler refuses it, as PyTorch's.
twinrpc is CPU-only: a non-CPU device is refused when the RemoteModule is made. Importing this module
also lets TorchScript modules travel over RPC, as importing PyTorch's does.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar

import torch
from torch import Tensor, nn
from torch.distributed.remote_device import _remote_device
from torch.nn.parameter import Parameter

from .. import rpc
from .._current import maybe_current_agent
from .._future import Future
from .._rref import owner_value
from .._serialize import register_reducer

__all__ = ["RemoteModule"]

T = TypeVar("T", bound="RemoteModule")

#: what a RemoteModule sent over RPC carries, in this order (PyTorch's ``_REMOTE_MODULE_PICKLED_ATTRIBUTES``)
_REMOTE_MODULE_PICKLED_ATTRIBUTES = (
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "generated_methods",
    "module_rref",
)

#: nn.Module's own bookkeeping and the installed forward methods: never sent (rebuilt or not needed)
_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING = (
    "training",
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_modules",
    "forward_async",
    "forward",
)


# -- what runs on the module's owner --------------------------------------------------------------------
def _create_module(
    module_cls: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> Any:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    module.to(device)
    return module


def _module(module_rref: rpc.RRef[nn.Module]) -> nn.Module:
    """The module a RemoteModule's helper acts on: with ``unpickle_allow``, only an ``nn.Module``."""
    return owner_value(module_rref, nn.Module, "RemoteModule")  # type: ignore[no-any-return]


def _param_rrefs(module_rref: rpc.RRef[nn.Module], recurse: bool) -> list[rpc.RRef[Parameter]]:
    return [rpc.RRef(param) for param in _module(module_rref).parameters(recurse)]


def _remote_forward(
    module_rref: rpc.RRef[nn.Module], device: str, is_device_map_set: bool, *args: Any, **kwargs: Any
) -> Any:
    return _module(module_rref).forward(*args, **kwargs)


def _set_training(module_rref: rpc.RRef[nn.Module], mode: bool) -> nn.Module:
    return _module(module_rref).train(mode)


# -- the forward methods every RemoteModule gets (PyTorch's ``_generated_methods``) ---------------------
def forward_async(self: RemoteModule, *args: Any, **kwargs: Any) -> Future[Any]:
    """``forward(*args, **kwargs)`` of the remote module, on its owner; a Future of its result."""
    return rpc.rpc_async(
        self.module_rref.owner(),
        _remote_forward,
        (self.module_rref, self.device, self.is_device_map_set, *args),
        kwargs,
    )


def forward(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` of the remote module, on its owner; blocks for its result."""
    return forward_async(self, *args, **kwargs).wait()


_GENERATED_METHODS = (forward_async, forward)


def _raise_not_supported(name: str) -> NoReturn:
    raise ValueError(f"Method ``{name}`` not supported for RemoteModule")


class RemoteModule(nn.Module):
    """A module created on ``remote_device`` by ``module_cls(*args, **kwargs)``, run there over RPC.

    ``remote_device`` is ``"<workername>/<device>"`` or ``"rank:<rank>/<device>"``; the device part is
    optional and defaults to ``"cpu"`` (twinrpc runs on the CPU only). ``forward`` and ``forward_async``
    take the module's own ``forward`` arguments; only they, :meth:`remote_parameters`,
    :meth:`get_module_rref`, ``train`` and ``eval`` are supported, every other ``nn.Module`` method
    raises ``ValueError``. Needs an initialised RPC worker.
    """

    on: str | int
    device: str
    is_device_map_set: bool
    is_scriptable: bool
    generated_methods: tuple[Callable[..., Any], ...]
    module_rref: rpc.RRef[nn.Module]

    def __init__(
        self,
        remote_device: str,
        module_cls: type[nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._prepare_init(remote_device)
        args = args if args is not None else ()
        kwargs = kwargs if kwargs is not None else {}
        self.is_scriptable = False
        self.generated_methods = _GENERATED_METHODS
        self.module_rref = rpc.remote(self.on, _create_module, (module_cls, args, kwargs, self.device))
        self._install_generated_methods()
        self._check_attribute_picklability()

    @staticmethod
    def init_from_module_rref(
        remote_device: str, module_rref: rpc.RRef[nn.Module], _module_interface_cls: Any = None
    ) -> RemoteModule:
        """A RemoteModule over an existing module RRef: several RemoteModules share one remote module."""
        if _module_interface_cls is not None:
            raise NotImplementedError(
                "twinrpc's RemoteModule is not TorchScript-able: _module_interface_cls is not supported; "
                "leave it None"
            )
        remote_module = object.__new__(RemoteModule)
        remote_module._prepare_init(remote_device)
        remote_module.is_scriptable = False
        remote_module.generated_methods = _GENERATED_METHODS
        remote_module.module_rref = module_rref
        remote_module._install_generated_methods()
        remote_module._check_attribute_picklability()
        return remote_module

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef[Parameter]]:
        """RRefs to the remote module's parameters (for ``DistributedOptimizer``); ``recurse`` as
        ``nn.Module.parameters``. One RPC to the owner."""
        return rpc.rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> rpc.RRef[nn.Module]:
        """The RRef to the remote module."""
        return self.module_rref

    def train(self: T, mode: bool = True) -> T:
        """Set the remote module's training mode; returns a copy of the remote module, as PyTorch."""
        owner = self.module_rref.owner()  # as PyTorch's RRef proxy: the module's owner, whatever ``on`` says
        return rpc.rpc_sync(owner, _set_training, (self.module_rref, mode))  # type: ignore[return-value]

    def eval(self: T) -> T:
        """``train(False)`` on the remote module."""
        return self.train(False)

    # -- pickling: over RPC only (see _remote_module_reducer) ---------------------------------------------
    def __getstate__(self) -> NoReturn:
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC"
        )

    def __setstate__(self, state: Any) -> NoReturn:
        raise RuntimeError(
            "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC"
        )

    # -- nn.Module methods a RemoteModule refuses, as PyTorch's ----------------------------------------------
    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> NoReturn:
        _raise_not_supported("register_buffer")

    def register_parameter(self, name: str, param: Parameter | None) -> NoReturn:
        _raise_not_supported("register_parameter")

    def add_module(self, name: str, module: nn.Module | None) -> NoReturn:
        _raise_not_supported("add_module")

    def apply(self, fn: Callable[[nn.Module], None]) -> NoReturn:
        _raise_not_supported("apply")

    def cuda(self, device: int | torch.device | None = None) -> NoReturn:
        _raise_not_supported("cuda")

    def ipu(self, device: int | torch.device | None = None) -> NoReturn:
        _raise_not_supported("ipu")

    def xpu(self, device: int | torch.device | None = None) -> NoReturn:
        _raise_not_supported("xpu")

    def cpu(self) -> NoReturn:
        _raise_not_supported("cpu")

    def type(self, dst_type: torch.dtype | str) -> NoReturn:
        _raise_not_supported("type")

    def float(self) -> NoReturn:
        _raise_not_supported("float")

    def double(self) -> NoReturn:
        _raise_not_supported("double")

    def half(self) -> NoReturn:
        _raise_not_supported("half")

    def bfloat16(self) -> NoReturn:
        _raise_not_supported("bfloat16")

    def to(self, *args: Any, **kwargs: Any) -> NoReturn:
        _raise_not_supported("to")

    def register_backward_hook(self, hook: Callable[..., Any]) -> NoReturn:
        _raise_not_supported("register_backward_hook")

    def register_forward_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False, with_kwargs: bool = False
    ) -> NoReturn:
        _raise_not_supported("register_forward_pre_hook")

    def register_forward_hook(  # type: ignore[override]
        self, hook: Callable[..., Any], prepend: bool = False, with_kwargs: bool = False
    ) -> NoReturn:
        _raise_not_supported("register_forward_hook")

    def state_dict(self, *args: Any, **kwargs: Any) -> NoReturn:
        _raise_not_supported("state_dict")

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> NoReturn:
        _raise_not_supported("load_state_dict")

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. Please use ``remote_parameters`` instead."
        )

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> NoReturn:
        _raise_not_supported("named_parameters")

    def buffers(self, recurse: bool = True) -> NoReturn:
        _raise_not_supported("buffers")

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> NoReturn:
        _raise_not_supported("named_buffers")

    def children(self) -> NoReturn:
        _raise_not_supported("children")

    def named_children(self) -> NoReturn:
        _raise_not_supported("named_children")

    def modules(self) -> NoReturn:  # type: ignore[override]
        _raise_not_supported("modules")

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> NoReturn:
        _raise_not_supported("named_modules")

    def requires_grad_(self, requires_grad: bool = True) -> NoReturn:
        _raise_not_supported("requires_grad_")

    def zero_grad(self, set_to_none: bool = True) -> NoReturn:
        _raise_not_supported("zero_grad")

    def share_memory(self) -> NoReturn:
        _raise_not_supported("share_memory")

    def extra_repr(self) -> NoReturn:
        _raise_not_supported("extra_repr")

    # -- construction helpers -------------------------------------------------------------------------------
    def _prepare_init(self, remote_device_str: str) -> None:
        """Parse ``remote_device`` as PyTorch does (its parser, its errors) and check the worker exists."""
        agent = maybe_current_agent()
        if agent is None:
            raise AssertionError("RemoteModule only works in RPC.")
        remote_device = _remote_device(remote_device_str)
        worker_name = remote_device.worker_name()
        self.on = worker_name if worker_name is not None else remote_device.rank()  # type: ignore[assignment]
        self.device = str(remote_device.device())
        agent.resolve(self.on)  # an unknown worker fails here, as in PyTorch
        if torch.device(self.device).type != "cpu":
            raise ValueError(
                f"RemoteModule device {self.device!r} (from remote_device {remote_device_str!r}) is not "
                "supported: twinrpc runs on the CPU only. Use '<workername>/cpu' or leave the device out"
            )
        self.is_device_map_set = False  # twinrpc has no device maps to a CPU-only module

    def _install_generated_methods(self) -> None:
        for method in self.generated_methods:
            setattr(self, method.__name__, method.__get__(self))

    def _check_attribute_picklability(self) -> None:
        """Every attribute must be declared sent or not sent over RPC (as PyTorch checks)."""
        for k in self.__dict__:
            if (
                k not in _REMOTE_MODULE_PICKLED_ATTRIBUTES
                and k not in _REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING
            ):
                raise AttributeError(
                    f"Attribute {k} must be either in ``_REMOTE_MODULE_PICKLED_ATTRIBUTES`` or "
                    "``_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING``."
                )


# -- sending a RemoteModule over RPC ---------------------------------------------------------------------
def _remote_module_receiver(*remote_module_pickled_attrs: Any) -> RemoteModule:
    """The receiving worker's RemoteModule: the sent attributes (its ``module_rref`` a fork of the
    sender's) and the forward methods, without ``nn.Module.__init__``, as PyTorch's receiver."""
    m = object.__new__(RemoteModule)
    m.__dict__.update(zip(_REMOTE_MODULE_PICKLED_ATTRIBUTES, remote_module_pickled_attrs, strict=True))
    m._install_generated_methods()
    return m


def _remote_module_reducer(remote_module: RemoteModule) -> tuple[Any, tuple[Any, ...]]:
    """Send only the declared attributes: an attribute set after construction stays behind (as PyTorch,
    which prints a warning about it)."""
    attrs = remote_module.__dict__
    return _remote_module_receiver, tuple(attrs[k] for k in _REMOTE_MODULE_PICKLED_ATTRIBUTES)


# -- sending a TorchScript module over RPC (PyTorch registers this beside RemoteModule's reducer) -------------
def _script_module_receiver(serialized: bytes) -> torch.jit.ScriptModule:
    return torch.jit.load(io.BytesIO(serialized))  # type: ignore[no-untyped-call,no-any-return]


def _script_module_reducer(module: torch.jit.ScriptModule) -> tuple[Any, tuple[bytes]]:
    """A scripted module travels as its ``torch.jit.save`` bytes (the Python pickler refuses it)."""
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    return _script_module_receiver, (buffer.getvalue(),)


register_reducer(RemoteModule, _remote_module_reducer)
register_reducer(torch.jit.RecursiveScriptModule, _script_module_reducer)  # type: ignore[attr-defined]
