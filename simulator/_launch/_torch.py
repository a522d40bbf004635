"""Serve ``torch.distributed.rpc``, ``.autograd`` and ``DistributedOptimizer`` from twinrpc for one run.

A program written for PyTorch imports them in any of the usual ways (``import torch.distributed.rpc as
rpc``, ``from torch.distributed import rpc``, ``torch.distributed.rpc.rpc_sync``, ``from
torch.distributed.optim import DistributedOptimizer``); all of them go through ``sys.modules`` or the
attributes of the ``torch.distributed`` package, so both are pointed at twinrpc for the run and put
back afterwards. ``torch.distributed.optim`` becomes a copy of the real package with only
``DistributedOptimizer`` replaced: its other names (``ZeroRedundancyOptimizer``, the functional
optimizers) keep working.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

_MISSING = object()


@contextmanager
def serve_torch_rpc() -> Iterator[None]:
    """For the duration of the block, ``torch.distributed.rpc``/``autograd``/``optim`` are twinrpc's."""
    import torch.distributed
    import torch.distributed.optim as real_optim

    import twinrpc.autograd
    import twinrpc.optim
    import twinrpc.rpc
    import twinrpc.rpc.api
    import twinrpc.rpc.functions
    import twinrpc.rpc.options

    optim = types.ModuleType(real_optim.__name__, real_optim.__doc__)
    optim.__dict__.update({k: v for k, v in real_optim.__dict__.items() if k not in ("__name__", "__doc__")})
    optim.DistributedOptimizer = twinrpc.optim.DistributedOptimizer  # type: ignore[attr-defined]
    served: dict[str, types.ModuleType] = {
        "torch.distributed.rpc": twinrpc.rpc,
        "torch.distributed.rpc.api": twinrpc.rpc.api,
        "torch.distributed.rpc.functions": twinrpc.rpc.functions,
        "torch.distributed.rpc.options": twinrpc.rpc.options,
        "torch.distributed.autograd": twinrpc.autograd,
        "torch.distributed.optim": optim,
    }
    attributes = {"rpc": twinrpc.rpc, "autograd": twinrpc.autograd, "optim": optim}
    saved_modules = {name: sys.modules.get(name, _MISSING) for name in served}
    package = torch.distributed
    saved_attributes = {name: package.__dict__.get(name, _MISSING) for name in attributes}
    sys.modules.update(served)
    for name, module in attributes.items():
        setattr(package, name, module)
    try:
        yield
    finally:
        for name, saved in saved_modules.items():
            if saved is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved  # type: ignore[assignment]
        for name, saved in saved_attributes.items():
            if saved is _MISSING:
                package.__dict__.pop(name, None)
            else:
                setattr(package, name, saved)
