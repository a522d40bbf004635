"""Reading the spec: requirement IDs from ``spec/*.md`` and deviation files.

A deviation file lists where an implementation deliberately differs from PyTorch; twinrpc's own is
``spec/deviations.toml``, a third-party backend keeps its own (see conformance/CONTRACT.md for the
format). Kept free of pytest so it can be unit-tested directly and reused by the docs' matrix generator.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import tomllib

__all__ = [
    "HEADING_RE",
    "Deviation",
    "SpecError",
    "find_test_definitions",
    "load_deviations",
    "parse_requirement_ids",
    "validate_deviations",
]

#: A requirement heading in the spec, e.g. ``### RPC-1: rpc_sync returns the callee's value``.
HEADING_RE = re.compile(r"^### ([A-Z]+-[A-Z]?\d+): (.+)$", re.MULTILINE)

_DEVIATION_KEYS = frozenset({"id", "requirement", "backends", "tests", "reason"})


class SpecError(Exception):
    """The spec or the deviation list is malformed or inconsistent with the suite."""


@dataclass(frozen=True, slots=True)
class Deviation:
    """One ``[[deviation]]`` entry: where an implementation deliberately differs from PyTorch.

    Attributes:
        id: The deviation's own ID, e.g. ``"DEV-1"``.
        requirement: The requirement ID the deviation is about.
        backends: Backends on which the listed tests are expected to FAIL.
        tests: Test function names (without parametrization suffix).
        reason: Why the implementation differs and what PyTorch does instead.
    """

    id: str
    requirement: str
    backends: tuple[str, ...]
    tests: tuple[str, ...]
    reason: str

    def applies_to(self, test_name: str, backend: str) -> bool:
        """Whether the test ``test_name`` is expected to fail on ``backend`` because of this deviation."""
        return backend in self.backends and test_name in self.tests


def parse_requirement_ids(spec_dir: Path) -> dict[str, str]:
    """Map every requirement ID found in ``spec_dir/*.md`` headings to its title.

    Returns an empty dict when the folder is missing or holds no markdown; callers treat that as
    "spec not written yet" rather than "every ID is unknown".
    """
    ids: dict[str, str] = {}
    if not spec_dir.is_dir():
        return ids
    for md in sorted(spec_dir.glob("*.md")):
        for match in HEADING_RE.finditer(md.read_text(encoding="utf-8")):
            ids.setdefault(match.group(1), match.group(2).strip())
    return ids


def _str_list(entry: Mapping[str, object], key: str, where: str) -> tuple[str, ...]:
    value = entry.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise SpecError(f"{where}: {key!r} must be a non-empty list of strings, got {value!r}")
    return tuple(value)


def _str(entry: Mapping[str, object], key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return value.strip()


def load_deviations(path: Path) -> tuple[Deviation, ...]:
    """Parse ``deviations.toml`` (format in conformance/CONTRACT.md); a missing file means none.

    Raises:
        SpecError: on TOML syntax errors, missing or unknown keys, wrong types or duplicate IDs, so a
            typo (``test = [...]``) can never silently disable an xfail.
    """
    if not path.is_file():
        return ()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from exc
    unknown_tables = set(data) - {"deviation"}
    if unknown_tables:
        raise SpecError(f"{path}: unknown top-level keys {sorted(unknown_tables)}; use [[deviation]] tables")
    entries = data.get("deviation", [])
    if not isinstance(entries, list):
        raise SpecError(f"{path}: 'deviation' must be an array of tables ([[deviation]])")
    deviations: list[Deviation] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        where = f"{path}: [[deviation]] #{index + 1}"
        if not isinstance(entry, dict):
            raise SpecError(f"{where}: must be a table")
        unknown = set(entry) - _DEVIATION_KEYS
        if unknown:
            raise SpecError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_DEVIATION_KEYS)}")
        dev_id = _str(entry, "id", where)
        where = f"{path}: deviation {dev_id}"
        if dev_id in seen:
            raise SpecError(f"{where}: duplicate id")
        seen.add(dev_id)
        deviations.append(
            Deviation(
                id=dev_id,
                requirement=_str(entry, "requirement", where),
                backends=_str_list(entry, "backends", where),
                tests=_str_list(entry, "tests", where),
                reason=_str(entry, "reason", where),
            )
        )
    return tuple(deviations)


def find_test_definitions(roots: Iterable[Path]) -> set[str]:
    """Names of every ``def test_*`` in the test modules under ``roots``.

    Deviations are checked against the source rather than the collected items so that running a
    subset of the suite (one file, ``-k``) does not report the other files' tests as missing.
    """
    pattern = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(test\w*)[ \t]*\(", re.MULTILINE)
    names: set[str] = set()
    for root in roots:
        for file in (*root.rglob("test_*.py"), *root.rglob("*_test.py")):
            names.update(pattern.findall(file.read_text(encoding="utf-8")))
    return names


def validate_deviations(
    deviations: Iterable[Deviation],
    *,
    known_ids: Mapping[str, str],
    known_tests: set[str],
    known_backends: Collection[str] | None = None,
) -> list[str]:
    """Problems that make the deviation list inconsistent with the spec or the suite (empty if none).

    ``known_ids`` may be empty (spec not written yet): the requirement check is then skipped.
    ``known_backends``, when given, are the backend names the file may name (a file belongs to the
    built-in backends or to one third-party backend).
    """
    problems: list[str] = []
    for dev in deviations:
        if known_backends is not None:
            for backend in dev.backends:
                if backend not in known_backends:
                    problems.append(
                        f"deviation {dev.id}: names backend {backend!r}; this file may name only "
                        f"{sorted(known_backends)}"
                    )
        if known_ids and dev.requirement not in known_ids:
            problems.append(
                f"deviation {dev.id}: requirement {dev.requirement!r} is not a heading in spec/*.md"
            )
        for test in dev.tests:
            if test not in known_tests:
                problems.append(
                    f"deviation {dev.id}: names test {test!r}, but no such test exists in the suite"
                )
    return problems
