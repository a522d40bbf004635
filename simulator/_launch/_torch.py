"""Serve ``torch.distributed.rpc``, ``.autograd``, ``DistributedOptimizer`` and ``RemoteModule`` from
twinrpc for one run.

A program written for PyTorch imports them in any of the usual ways (``import torch.distributed.rpc as
rpc``, ``from torch.distributed import rpc``, ``torch.distributed.rpc.rpc_sync``, ``from
torch.distributed.optim import DistributedOptimizer``, ``from torch.distributed.nn import RemoteModule``,
``from torch.distributed.nn.api.remote_module import RemoteModule``); all of them go through
``sys.modules`` or the attributes of the parent package, so both are pointed at twinrpc for the run and
put back afterwards. ``torch.distributed.optim``, ``torch.distributed.nn`` and
``torch.distributed.nn.api.remote_module`` become copies of the real modules with only
``DistributedOptimizer`` or ``RemoteModule`` replaced: their other names (``ZeroRedundancyOptimizer``,
the functional optimizers, ``torch.distributed.nn.functional``) keep working.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed
import torch.distributed.nn as real_nn
import torch.distributed.nn.api as real_nn_api
import torch.distributed.nn.api.remote_module as real_remote_module
import torch.distributed.optim as real_optim

import twinrpc.autograd
import twinrpc.nn
import twinrpc.optim
import twinrpc.rpc
import twinrpc.rpc.api
import twinrpc.rpc.functions
import twinrpc.rpc.options

_MISSING = object()


def _copy_with(real: types.ModuleType, **replaced: Any) -> types.ModuleType:
    """A copy of the module ``real`` with only the names in ``replaced`` changed."""
    copy = types.ModuleType(real.__name__, real.__doc__)
    copy.__dict__.update({k: v for k, v in real.__dict__.items() if k not in ("__name__", "__doc__")})
    copy.__dict__.update(replaced)
    return copy


@contextmanager
def serve_torch_rpc() -> Iterator[None]:
    """For the block, ``torch.distributed.rpc``/``autograd``/``optim``/``nn.RemoteModule`` are twinrpc's."""
    optim = _copy_with(real_optim, DistributedOptimizer=twinrpc.optim.DistributedOptimizer)
    nn = _copy_with(real_nn, RemoteModule=twinrpc.nn.RemoteModule)
    remote_module = _copy_with(real_remote_module, RemoteModule=twinrpc.nn.RemoteModule)
    served: dict[str, types.ModuleType] = {
        "torch.distributed.rpc": twinrpc.rpc,
        "torch.distributed.rpc.api": twinrpc.rpc.api,
        "torch.distributed.rpc.functions": twinrpc.rpc.functions,
        "torch.distributed.rpc.options": twinrpc.rpc.options,
        "torch.distributed.autograd": twinrpc.autograd,
        "torch.distributed.optim": optim,
        "torch.distributed.nn": nn,
        "torch.distributed.nn.api.remote_module": remote_module,
    }
    package = torch.distributed
    #: (package, attribute, module): how ``torch.distributed.rpc`` or ``import a.b.c as m`` reach them
    attributes = [
        (package, "rpc", twinrpc.rpc),
        (package, "autograd", twinrpc.autograd),
        (package, "optim", optim),
        (package, "nn", nn),
        (real_nn_api, "remote_module", remote_module),
    ]
    saved_modules = {name: sys.modules.get(name, _MISSING) for name in served}
    saved_attributes = [(owner, name, owner.__dict__.get(name, _MISSING)) for owner, name, _ in attributes]
    sys.modules.update(served)
    for owner, name, module in attributes:
        setattr(owner, name, module)
    try:
        yield
    finally:
        for name, saved in saved_modules.items():
            if saved is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved  # type: ignore[assignment]
        for owner, name, saved in saved_attributes:
            if saved is _MISSING:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, saved)
