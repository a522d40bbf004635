"""The differential twin test: one RPC program, two worlds, the same outcome.

``programs`` draws small RPC programs as data, ``interpreter`` runs one unchanged in the simulator
and in gloo processes, ``outcome`` says what a run observed, ``runners`` runs both worlds and gives
the verdict. ``tests/twin/test_twin_differential.py`` is the bounded CI run; ``nox -s twin`` the long one.

Imported as ``twin`` (``tests/`` is on ``sys.path`` under pytest and in the harness's processes).
"""

from __future__ import annotations

from .outcome import Outcome
from .programs import (
    Builtin,
    Chain,
    Fail,
    FanOut,
    Kill,
    Leave,
    PassOn,
    Program,
    Remote,
    RemoteOf,
    Slow,
    Start,
    Sync,
    ToHere,
    Train,
    Wait,
    programs,
)
from .runners import GlooRunner, SimRunner, Verdict, check

__all__ = [
    "Builtin",
    "Chain",
    "Fail",
    "FanOut",
    "GlooRunner",
    "Kill",
    "Leave",
    "Outcome",
    "PassOn",
    "Program",
    "Remote",
    "RemoteOf",
    "SimRunner",
    "Slow",
    "Start",
    "Sync",
    "ToHere",
    "Train",
    "Verdict",
    "Wait",
    "check",
    "programs",
]
