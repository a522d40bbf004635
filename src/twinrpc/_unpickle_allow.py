"""Restricted unpickling: which globals a worker's unpickler may load (``RpcBackendOptions(unpickle_allow=...)``).

Unpickling runs code: a pickle names globals (functions, classes) and calls them. A worker started with
an allowlist loads only the globals it names, plus what twinrpc's own messages need (tensor records,
RRef forks, remote errors, the functions twinrpc itself calls remotely, torch's dtypes and layouts,
torch's optimizer classes and builtin exception types); any other global refuses the whole message
before anything in it runs. Without an allowlist, messages are unpickled as PyTorch does.

A pattern is matched against a global's full dotted name (``module.qualname``) with shell-style
wildcards: ``"mypkg.*"`` allows everything in ``mypkg`` and its submodules, ``"mypkg.train.step"`` one
function, and a bare module name such as ``"mypkg"`` everything defined in that module itself. A
method or a builtin torch operator travels as ``getattr(owner, name)``: its owner's name and the
attribute are checked together, so ``"torch.add"`` allows ``torch.add`` and nothing else of torch.
"""

from __future__ import annotations

import builtins
import fnmatch
import io
import pickle
import re
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch

from . import _errors
from ._errors import SerializationError

#: twinrpc's own globals, allowed with any allowlist: what its messages and its own remote calls name
_TWINRPC_GLOBALS = frozenset(
    {
        ("twinrpc._serialize", "_rebuild_tensor"),
        ("twinrpc._serialize", "_rebuild_sparse"),
        ("twinrpc._serialize", "_rebuild_rref"),
        ("twinrpc._rref", "ForkData"),
        ("twinrpc._rref", "GloballyUniqueId"),
        ("twinrpc._agent", "_RemoteException"),
        ("twinrpc._worker_info", "WorkerInfo"),
        ("twinrpc._shutdown", "_GatherAborted"),
        ("twinrpc._shutdown", "_PeerDied"),
        ("twinrpc._dist_autograd", "_open_envelope"),
        ("twinrpc._dist_autograd", "rref_backward_on_owner"),
        ("twinrpc._membership", "member_ready"),
        ("twinrpc._membership", "update_group_membership"),
        ("twinrpc._rref_proxy", "_local_invoke"),
        ("twinrpc._rref_proxy", "_local_invoke_async"),
        ("twinrpc.optim", "_local_optimizer_step"),
        ("twinrpc.optim", "_new_functional_local_optimizer"),
        ("twinrpc.optim", "_new_local_optimizer"),
        ("torch.serialization", "_get_layout"),
        # an nn.Parameter, as torch pickles it (Parameter.__reduce_ex__): its data, requires_grad,
        # an empty OrderedDict of hooks and maybe its attributes
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        # the owner of torch's builtin operators: loading it runs nothing, and each operator taken
        # from it goes through the checked getattr (``"torch.add"``)
        ("torch._C", "_VariableFunctionsClass"),
        # how a pickle names a method or an operator: loaded as the checked getattr below
        ("builtins", "getattr"),
    }
)
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout)
#: the class torch's builtin operators (``torch.add``) are attributes of, as a pickle names them
_OPERATORS = torch._C._VariableFunctionsClass  # type: ignore[attr-defined]
_OPTIMIZER_MODULE = re.compile(r"torch\.(distributed\.)?optim(\.|$)")


class UnpickleRefused(SerializationError):
    """A message named a global that this worker's ``unpickle_allow`` does not allow; nothing in it ran."""


class UnpickleAllowlist:
    """The globals a worker may unpickle: its patterns plus twinrpc's own needs (thread-safe)."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns: tuple[str, ...] = tuple(patterns)
        for pattern in self.patterns:
            if not isinstance(pattern, str) or not pattern:
                raise TypeError(f"unpickle_allow patterns must be non-empty strings, got {pattern!r}")
        self._regex = re.compile("|".join(fnmatch.translate(p) for p in self.patterns) or r"(?!)")
        self._modules = frozenset(p for p in self.patterns if not any(c in p for c in "*?["))
        #: the globals found allowed: a message names the same few over and over. Refusals are not
        #: kept: a hostile peer could otherwise grow this with names of its choosing
        self._allowed: set[tuple[str, str]] = set()

    def __repr__(self) -> str:
        return f"UnpickleAllowlist({list(self.patterns)!r})"

    def allows_name(self, dotted: str, module: str | None = None) -> bool:
        """Whether a user pattern allows the global ``dotted`` (defined in ``module``)."""
        return self._regex.fullmatch(dotted) is not None or (module is not None and module in self._modules)

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` if allowed (``pickle.Unpickler.find_class``'s contract).

        Raises:
            UnpickleRefused: it is not allowed (nothing was imported or looked up).
        """
        key = (module, name)
        allowed = key in self._allowed
        if not allowed:
            allowed = key in _TWINRPC_GLOBALS or self.allows_name(f"{module}.{name}", module)
            if not allowed:  # twinrpc's own needs that are kinds of values, not single names
                allowed = _implied(module, name)
            if allowed:
                self._allowed.add(key)  # set.add is atomic: no lock needed
        if not allowed:
            raise self.refused(f"{module}.{name}")
        if key == ("builtins", "getattr"):
            return self._checked_getattr
        obj = _load_global(module, name)
        if obj is None:  # a dotted name that leaves its module or goes through a dunder
            raise self.refused(f"{module}.{name}")
        return obj

    def _checked_getattr(self, owner: Any, name: str) -> Any:
        """``getattr`` as a pickle calls it (methods, builtin operators): the attribute is allowed
        only if a pattern allows its full name (``torch.add``, ``mypkg.Model.forward``); never a
        dunder (``__globals__``, ``__subclasses__``: no message needs one)."""
        dotted = f"{_owner_name(owner)}.{name}"
        if _is_dunder(name) or not self.allows_name(dotted):
            raise self.refused(dotted)
        return getattr(owner, name)

    def refused(self, dotted: str) -> UnpickleRefused:
        return UnpickleRefused(
            f"the message names the global {dotted}, which this worker's unpickle_allow does not allow "
            f"(patterns: {list(self.patterns)}); nothing in the message was run. To allow it, add "
            f"{dotted!r} (or a pattern matching it) to RpcBackendOptions(unpickle_allow=...) on the "
            "receiving worker"
        )

    def loads(self, payload: bytes) -> Any:
        """Unpickle ``payload``, loading only allowed globals."""
        return _Unpickler(io.BytesIO(payload), self).load()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, allow: UnpickleAllowlist) -> None:
        super().__init__(file)
        self._allow = allow

    def find_class(self, module: str, name: str) -> Any:
        return self._allow.find_class(module, name)


def _implied(module: str, name: str) -> bool:
    """twinrpc's needs that are kinds of values: torch's dtypes and layouts, builtin
    exception types and twinrpc's own errors (a remote error's type), torch's optimizer classes
    (DistributedOptimizer builds one on each parameter's owner)."""
    if module == "torch":
        return isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES)
    if module == "builtins":
        value = getattr(builtins, name, None)
        return isinstance(value, type) and issubclass(value, BaseException)
    if module == "twinrpc._errors":
        value = getattr(_errors, name, None)
        return isinstance(value, type) and issubclass(value, BaseException)
    if _OPTIMIZER_MODULE.match(module):
        value = _load_global(module, name)
        return isinstance(value, type) and (
            issubclass(value, torch.optim.Optimizer) or name.startswith("_Functional")
        )
    return False


def _load_global(module: str, name: str) -> Any:
    """What ``pickle`` itself would load for ``module.name``, or None for a dotted name that reaches
    through another module (``mypkg.os.system``: a pattern for ``mypkg`` must not allow ``os``) or
    through a dunder attribute."""
    __import__(module)
    obj: Any = sys.modules[module]
    for part in name.split("."):
        if _is_dunder(part):
            return None
        obj = getattr(obj, part)
        if isinstance(obj, types.ModuleType):
            return None
    return obj


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _owner_name(owner: Any) -> str:
    """The dotted name a pattern sees for ``getattr(owner, ...)``: ``torch`` for the owner of torch's
    builtin operators, a class's ``module.qualname``, a module's name."""
    if owner is _OPERATORS:
        return "torch"
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    name = getattr(owner, "__name__", None)
    if isinstance(name, str) and type(owner).__name__ == "module":
        return name
    return f"{type(owner).__module__}.{type(owner).__qualname__}"
