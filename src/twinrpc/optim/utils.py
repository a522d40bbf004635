"""Which optimizers have a functional form (``torch.distributed.optim.utils``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim.functional_adadelta import _FunctionalAdadelta
from torch.distributed.optim.functional_adagrad import _FunctionalAdagrad
from torch.distributed.optim.functional_adam import _FunctionalAdam
from torch.distributed.optim.functional_adamax import _FunctionalAdamax
from torch.distributed.optim.functional_adamw import _FunctionalAdamW
from torch.distributed.optim.functional_rmsprop import _FunctionalRMSprop
from torch.distributed.optim.functional_rprop import _FunctionalRprop
from torch.distributed.optim.functional_sgd import _FunctionalSGD

#: optimizer class -> its functional form (used eagerly: twinrpc needs no TorchScript)
functional_optim_map: dict[Any, Any] = {
    torch.optim.Adagrad: _FunctionalAdagrad,
    torch.optim.Adam: _FunctionalAdam,
    torch.optim.AdamW: _FunctionalAdamW,
    torch.optim.SGD: _FunctionalSGD,
    torch.optim.Adadelta: _FunctionalAdadelta,
    torch.optim.RMSprop: _FunctionalRMSprop,
    torch.optim.Rprop: _FunctionalRprop,
    torch.optim.Adamax: _FunctionalAdamax,
}


def register_functional_optim(key: Any, optim: Any) -> None:
    """Register ``optim`` as the functional form of ``key`` (first registration wins, as PyTorch)."""
    if key not in functional_optim_map:
        functional_optim_map[key] = optim
