"""Byte views of tensors' memory that leave the tensors as they were.

``Tensor.numpy()`` marks the tensor's storage non-resizable for good (a NumPy array cannot follow a
storage that moves), so a tensor a program sent, or received, would then raise "Trying to resize
storage that is not resizable" on ``resize_`` or on an ``out=`` that must grow it, which it does not
in PyTorch. Copies to and from the wire, and the job key's MACs, go through these views instead.
"""

from __future__ import annotations

import ctypes

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory. It does not keep ``t`` alive: use it
    while ``t`` is referenced."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
