"""Restricted unpickling: which globals a worker's unpickler may load (``RpcBackendOptions(unpickle_allow=...)``).

Unpickling runs code: a pickle names globals (functions, classes) and calls them. A worker started with
an allowlist loads only the globals it names, plus what twinrpc's own messages need (tensor records,
RRef forks, remote errors, the functions twinrpc itself calls remotely, torch's dtypes and layouts,
torch's optimizer classes and builtin exception types); any other global refuses the whole message
before anything in it runs. Without an allowlist, messages are unpickled as PyTorch does.

A pattern is matched against a global's full dotted name (``module.qualname``) with shell-style
wildcards: ``"mypkg.*"`` allows everything in ``mypkg`` and its submodules, ``"mypkg.train.step"`` one
function, and a bare module name such as ``"mypkg"`` everything defined in that module itself. Both
the name a pickle gives and the name where the loaded object is defined (its own ``__module__`` and
``__qualname__``) must match: ``mypkg.system`` after ``from os import system`` in ``mypkg`` is
``posix.system``, and ``"mypkg.*"`` does not allow it. A method or a builtin torch operator travels
as ``getattr(owner, name)``: its owner's name and the attribute are checked together, so
``"torch.add"`` allows ``torch.add`` and nothing else of torch.

twinrpc's own remote helpers that reach a value's attribute by a name they received (the RRef proxy's
``rref.rpc_sync().method()``) apply the same rule through :meth:`UnpickleAllowlist.attribute`, and the
helpers that act on an RRef's value (``backward``, the remote optimizer's step) check its type: an
always-allowed helper never opens a way to a global the list does not allow.
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
        ("twinrpc._unpickle_allow", "UnpickleRefused"),
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
        ("twinrpc.nn._remote_module", "_create_module"),
        ("twinrpc.nn._remote_module", "_param_rrefs"),
        ("twinrpc.nn._remote_module", "_remote_forward"),
        ("twinrpc.nn._remote_module", "_set_training"),
        ("twinrpc.nn._remote_module", "_remote_module_receiver"),
        ("twinrpc.nn._remote_module", "forward_async"),
        ("twinrpc.nn._remote_module", "forward"),
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
        if key == ("builtins", "getattr"):
            return self._checked_getattr
        known = key in self._allowed
        own = known or key in _TWINRPC_GLOBALS or _implied(module, name)  # twinrpc's own needs
        if not own and not self.allows_name(f"{module}.{name}", module):
            raise self.refused(f"{module}.{name}")
        obj = _load_global(module, name)
        if obj is None:  # a dotted name that leaves its module or goes through a dunder
            raise self.refused(f"{module}.{name}")
        if not own:
            self._check_defined_where_allowed(f"{module}.{name}", obj)
        if not known:
            self._allowed.add(key)  # set.add is atomic: no lock needed
        return obj

    def _check_defined_where_allowed(self, found: str, obj: Any) -> None:
        """A user pattern allowed the name ``found``; the object must be allowed where it is defined
        too (a module's ``from os import system`` is ``posix.system``, not the module's own).

        Raises:
            UnpickleRefused: saying where ``obj`` is defined and what to add to allow it.
        """
        defined = _defined_name(obj)
        if defined is None:
            if not callable(obj):
                return  # plain data (a constant): loading it calls nothing
            raise UnpickleRefused(
                f"the message names the global {found}, a {type(obj).__qualname__} that does not say "
                "where it is defined (no __module__ and __qualname__), so no pattern can allow it; "
                "nothing in the message was run. Send a function or class defined in an allowed module"
            )
        module = getattr(obj, "__module__", None)
        if defined != found and not self.allows_name(defined, module):
            raise UnpickleRefused(
                f"the message names the global {found}, which is {defined} (defined there and imported "
                f"under the name it was found by); this worker's unpickle_allow (patterns: "
                f"{list(self.patterns)}) allows the name but not where it is defined, so nothing in the "
                f"message was run. To allow it, add {defined!r} (or a pattern matching it) to "
                "RpcBackendOptions(unpickle_allow=...) on the receiving worker"
            )

    def attribute(self, value: Any, name: str) -> Any:
        """``getattr(value, name)`` for a remote helper that received ``name`` from a peer (the RRef
        proxy's ``rref.rpc_sync().name()``): allowed only for an attribute of ``value``'s type whose full
        name (``mypkg.Model.forward``) a pattern allows, never a dunder, never an attribute the type
        does not have (an instance's own attributes are not methods a peer may name).

        Raises:
            UnpickleRefused: naming the attribute and how to allow it; nothing was called.
        """
        owner = type(value)
        if not isinstance(name, str):
            raise UnpickleRefused(f"an attribute name must be a str, got {type(name).__qualname__}")
        dotted = f"{owner.__module__}.{owner.__qualname__}.{name}"
        if _is_dunder(name) or not hasattr(owner, name) or not self.allows_name(dotted, owner.__module__):
            raise self.refused(dotted, "attribute")
        return getattr(value, name)

    def check_type(self, value: Any, expected: type | tuple[type, ...], helper: str) -> None:
        """What a twinrpc helper acting on an RRef's value (``backward``, a remote optimizer's step)
        expects to find there: with an allowlist, a peer may not aim it at any other value.

        Raises:
            UnpickleRefused: naming the helper and the value's type.
        """
        if not isinstance(value, expected):
            owner = type(value)
            raise UnpickleRefused(
                f"{helper} was asked to act on a {owner.__module__}.{owner.__qualname__}, which is not what "
                f"it acts on; with unpickle_allow set (patterns: {list(self.patterns)}) this worker runs "
                "twinrpc's own helpers only on their own kinds of values, so nothing was run"
            )

    def _checked_getattr(self, owner: Any, name: str) -> Any:
        """``getattr`` as a pickle calls it (methods, builtin operators): the attribute is allowed
        only if a pattern allows its full name (``torch.add``, ``mypkg.Model.forward``); never a
        dunder (``__globals__``, ``__subclasses__``: no message needs one)."""
        dotted = f"{_owner_name(owner)}.{name}"
        if _is_dunder(name) or not self.allows_name(dotted):
            raise self.refused(dotted)
        return getattr(owner, name)

    def refused(self, dotted: str, what: str = "global") -> UnpickleRefused:
        return UnpickleRefused(
            f"the message names the {what} {dotted}, which this worker's unpickle_allow does not allow "
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


def _defined_name(obj: Any) -> str | None:
    """Where ``obj`` is defined, as a pattern names it (``module.qualname``; ``torch.add`` for one of
    torch's builtin operators), or None when it does not say."""
    if getattr(obj, "__self__", None) is _OPERATORS:
        return f"torch.{obj.__name__}"
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    return f"{module}.{qualname}"


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
