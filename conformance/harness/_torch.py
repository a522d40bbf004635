"""The ``torch`` backend: upstream torch.distributed.rpc (TensorPipe) in real processes, the oracle."""

from __future__ import annotations

from .child import ProcessContext
from .processes import ProcessBackend

__all__ = ["TorchBackend", "TorchContext"]


class TorchContext(ProcessContext):
    """``ctx`` in a torch worker: PyTorch's modules, TensorPipe options on file:// rendezvous."""

    MODULES = {
        "rpc": "torch.distributed.rpc",
        "dist_autograd": "torch.distributed.autograd",
        "optim": "torch.distributed.optim",
        "futures": "torch.futures",
        "nn": "torch.distributed.nn",
    }


class TorchBackend(ProcessBackend):
    """Runs programs on real torch.distributed.rpc processes (see :mod:`conformance.harness.processes`)."""

    name = "torch"
    context = TorchContext
