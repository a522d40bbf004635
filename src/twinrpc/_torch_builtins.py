"""Whether a function is one of torch's builtin operators, as TorchScript's table says.

PyTorch treats an RPC of a builtin differently from one of a Python function (its arguments are
checked against the operator's schemas on the caller, its Parameters travel as tensors, its errors
come back as RuntimeError, and it joins an autograd context only with tensors that require grad):
the API, the agent and distributed autograd all ask here.
"""

from __future__ import annotations

from typing import Any

import torch

#: torch's table of builtin operators by ``id`` of the Python callable (torch.jit._builtins), fetched
#: once: it is built on first use and only grows in place, and every call looks its function up
_table: dict[int, Any] | None = None


def builtin_name(func: Any) -> str | None:
    """The qualified name of the builtin operator ``func`` (``aten::add``), or None if it is none."""
    global _table
    table = _table
    if table is None:
        table = _table = torch.jit._builtins._get_builtin_table()  # type: ignore[no-untyped-call]
    name = table.get(id(func))
    return name if isinstance(name, str) else None


def is_builtin(func: Any) -> bool:
    return builtin_name(func) is not None
