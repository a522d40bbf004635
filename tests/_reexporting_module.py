"""A module that imports globals defined elsewhere, as a trainer script does (tests/security/test_unpickle_allow.py):
a pattern for this module must not allow them."""

from __future__ import annotations

import functools
from os import system  # re-exported on purpose: what a pattern must not allow

from twinrpc._errors import SerializationError  # noqa: F401

#: a callable that does not say where it is defined
quiet_system = functools.partial(system, "true")
#: plain data: loading it calls nothing
LEARNING_RATE = 0.1


def step(x: int) -> int:
    return x + 1
