"""What :func:`~twinrpc.simulator.explore` reports: the shrunk :class:`Failure`, or an
:class:`Exploration` that found none."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._simulation import RunResult
from ._case import Case, _Outcome
from ._reproduce import export_test
from ._signature import _faults_text, _head, _Signature


class Failure(AssertionError):
    """A failure :func:`explore` found, shrunk to a minimal case that still fails the same way.

    Attributes:
        seed: the minimal case's simulation seed.
        faults: the minimal fault plan (``faults.describe()`` reads it; :attr:`faults_data` is its
            plain-data form).
        network: the minimal case's network model (``None``: the default).
        compute: the minimal case's compute model (``None``: computing is free).
        error: the error of the first failing run, as it was raised.
        minimal_error: the error the minimal case raises (same type, same message pattern).
        rank: the worker whose program raised ``minimal_error`` (``None``: the simulation or the check).
        original: the first failing case, before shrinking.
        runs: how many runs it took to find the failure (the failing run included).
        shrink_runs: how many more runs shrinking made.
        exception_type: the qualified name of the error's type.
        pattern: the regex the message of "the same failure" matches (``re.match``).
        replay_command: one line that replays the minimal case.
    """

    def __init__(
        self,
        *,
        case: Case,
        original: Case,
        error: BaseException,
        minimal: _Outcome,
        signature: _Signature,
        runs: int,
        shrink_runs: int,
        world_size: int,
        program: Callable[..., Any] | None,
        args: Sequence[Any],
        check: Callable[[RunResult], object] | None,
        command: Callable[[Case], str],
        exporter: Callable[[Failure, str, str], str] | None = None,
    ) -> None:
        self.case = case
        self.seed = case.seed
        self.faults = case.faults
        self.network = case.network
        self.compute = case.compute
        self.original = original
        self.error = error
        assert minimal.error is not None
        self.minimal_error = minimal.error
        self.rank = minimal.rank
        self._where = minimal.where()
        self.runs = runs
        self.shrink_runs = shrink_runs
        self.exception_type = signature.type_name
        self.pattern = signature.pattern
        self.world_size = world_size
        self.program = program
        self.program_args = tuple(args)
        self.check = check
        self.replay_command = command(case)
        self._exporter = exporter
        super().__init__(self.describe())

    @property
    def faults_data(self) -> dict[str, Any]:
        """The minimal fault plan as plain data (JSON-ready)."""
        return self.faults.to_dict()

    def describe(self) -> str:
        """What failed, the minimal case, and how to replay it; several lines."""
        message = _head(str(self.minimal_error)).replace("\n", " ")
        lines = [
            f"twinrpc.simulator.explore: run {self.runs} failed; shrunk in {self.shrink_runs} more runs "
            f"to seed {self.seed} and {_faults_text(len(self.faults))}",
            f"  error: {self._where}",
            f"         {message}",
            f"  minimal faults: {self.faults.describe()}",
        ]
        if self.network is not None:
            lines.append(f"  network: {self.network!r}")
        if self.compute is not None:
            lines.append(f"  compute: {self.compute!r}")
        lines.append(f"  replay: {self.replay_command}")
        if self.original != self.case:
            lines.append(
                f"  first failing run: seed {self.original.seed}, "
                f"{_faults_text(len(self.original.faults))}: {self.original.faults.describe()}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The failure as plain data: the minimal case, what failed, and how long it took."""
        return {
            "case": self.case.to_dict(),
            "original": self.original.to_dict(),
            "exception_type": self.exception_type,
            "pattern": self.pattern,
            "message": str(self.minimal_error),
            "rank": self.rank,
            "runs": self.runs,
            "shrink_runs": self.shrink_runs,
            "replay": self.replay_command,
        }

    def to_pytest(self, name: str = "test_regression", *, expect: Literal["pass", "fail"] = "pass") -> str:
        """The source of a pytest file that replays exactly the minimal case.

        With ``expect="pass"`` (the default) the test asserts the run now passes: commit it with the
        fix. With ``expect="fail"`` it asserts the run still fails the known way (same exception type,
        same message pattern): commit it to pin a known bug until it is fixed.

        Raises:
            ValueError: ``name`` is not a test function name, or the program (or ``check``, or an
                argument) cannot be named from another module (a lambda, a local function, a
                function of ``__main__``).
        """
        if not re.fullmatch(r"test_?\w*", name) or not name.isidentifier():
            raise ValueError(f"to_pytest(name={name!r}): a pytest test function name starts with 'test'")
        if expect not in ("pass", "fail"):
            raise ValueError(f"to_pytest(expect={expect!r}): expected 'pass' or 'fail'")
        if self._exporter is not None:
            return self._exporter(self, name, expect)
        return export_test(self, name, expect)


Failure.__module__ = "twinrpc.simulator"  # what pytest prints as the failing test's error: the public name


@dataclass(frozen=True, slots=True)
class Exploration:
    """What :func:`explore` did.

    Attributes:
        runs: runs made, shrinking included.
        seed: the exploration's own seed (the same seed explores the same cases).
        failure: the shrunk failure, or ``None`` when every run passed.
    """

    runs: int
    seed: int
    failure: Failure | None = None
