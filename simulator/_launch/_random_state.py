"""Each simulated process's global random generators: torch's, Python's ``random`` and NumPy's.

Real processes each have their own: ``torch.manual_seed(rank)`` in one worker does not change what
another draws. The simulator runs every process in one interpreter, so it keeps a
:class:`ProcessRandom` per process and swaps it in with the rest of the process's image
(``ProcessImages.activate``). torch's generator is swapped by its state (a few bytes, about a
microsecond); ``random`` and NumPy's legacy functions are module attributes bound to one hidden
generator each, so the module attributes are pointed at the process's own generator instead of
copying states (copying NumPy's costs hundreds of microseconds).

A fresh process starts from the run's seed, as every real process starts torch from the same
default seed (Python's and NumPy's get the seed mixed with the process's pid: real processes seed
those from entropy, so they differ between processes); a forked child starts from a copy of its
parent's generators, as ``fork`` copies them.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch

#: ``random``'s module functions: methods of its hidden ``random._inst``
_RANDOM_NAMES = tuple(
    sorted(n for n in dir(random) if getattr(getattr(random, n), "__self__", None) is random._inst)  # type: ignore[attr-defined]
)
#: NumPy's legacy module functions (``np.random.rand``...): methods of ``np.random.mtrand._rand``
_NUMPY_NAMES = tuple(
    sorted(
        n
        for n in dir(np.random)
        if getattr(getattr(np.random, n), "__self__", None) is np.random.mtrand._rand
    )
)


class ProcessRandom:
    """One process's generators while another process runs."""

    __slots__ = ("numpy", "python", "torch_state")

    def __init__(
        self, torch_state: torch.Tensor, python: random.Random, numpy: np.random.RandomState
    ) -> None:
        self.torch_state = torch_state
        self.python = python
        self.numpy = numpy

    @classmethod
    def fresh(cls, seed: int, pid: int) -> ProcessRandom:
        """A new process's generators: torch's from ``seed``; Python's and NumPy's from ``seed`` and
        ``pid``."""
        generator = torch.Generator().manual_seed(seed)
        mixed = (seed * 1_000_003 + pid) % 2**32
        return cls(generator.get_state(), random.Random(mixed), np.random.RandomState(mixed))

    @classmethod
    def capture(cls) -> ProcessRandom:
        """A copy of the generators in place now (a forked child's, from its running parent)."""
        return cls(
            torch.default_generator.get_state(),
            copy.deepcopy(random._inst),  # type: ignore[attr-defined]
            copy.deepcopy(np.random.mtrand._rand),
        )

    @classmethod
    def installed(cls) -> ProcessRandom:
        """The generators in place now, themselves (the interpreter's own, outside the run)."""
        return cls(torch.default_generator.get_state(), random._inst, np.random.mtrand._rand)  # type: ignore[attr-defined]

    def save_torch(self) -> None:
        """Keep torch's state as this process leaves it (the only generator shared by state)."""
        self.torch_state = torch.default_generator.get_state()

    def install(self) -> None:
        """Put these generators in place of the ones in use."""
        torch.default_generator.set_state(self.torch_state)
        python, numpy = self.python, self.numpy
        random._inst = python  # type: ignore[attr-defined]
        for name in _RANDOM_NAMES:
            setattr(random, name, getattr(python, name))
        np.random.mtrand._rand = numpy
        for name in _NUMPY_NAMES:
            setattr(np.random, name, getattr(numpy, name))


def _check_names() -> Any:
    """The lists above are non-empty on this interpreter (else the swap would silently do nothing)."""
    assert "random" in _RANDOM_NAMES and "seed" in _RANDOM_NAMES, _RANDOM_NAMES
    assert "rand" in _NUMPY_NAMES, _NUMPY_NAMES


_check_names()
