"""What "the same failure" means: the error's type and a pattern of its message.

The first failing run fixes both; a later run fails the same way when its error has that type and
its message matches the pattern (numbers, addresses and times may differ).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: characters of the first failure's message that its pattern keeps (the head says what went wrong)
_PATTERN_CHARS = 300
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_NUMBER_PATTERN = r"\d[\d.eE+-]*"


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _head(message: str) -> str:
    """The part of a message that says what went wrong: up to its first traceback or stack."""
    lines = []
    for line in message.splitlines():
        if line.startswith(("Traceback (most recent call last)", "  File ")):
            break
        lines.append(line)
    return "\n".join(lines).strip()[:_PATTERN_CHARS]


def message_pattern(message: str) -> str:
    """A regex matching ``message`` with its numbers and addresses free: the same failure in another
    run has other times, ids and tensor versions. It matches from the start (``re.match``)."""
    head = _head(message)
    out: list[str] = []
    pos = 0
    for m in re.finditer(f"{_HEX.pattern}|{_NUMBER.pattern}", head):
        out.append(re.escape(head[pos : m.start()]))
        out.append("0x[0-9a-fA-F]+" if m.group().startswith("0x") else _NUMBER_PATTERN)
        pos = m.end()
    out.append(re.escape(head[pos:]))
    return "".join(out)


def _type_name(exc: BaseException) -> str:
    # by name, not identity: a program run with per-worker module copies raises per-worker classes;
    # an error known only by its printed traceback (a simulated process's) carries its type's name
    named = getattr(exc, "type_name", None)
    if isinstance(named, str):
        return named
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def _short_type(exc: BaseException) -> str:
    return _type_name(exc).rpartition(".")[2]


@dataclass(frozen=True, slots=True)
class _Signature:
    type_name: str
    pattern: str

    @classmethod
    def of(cls, exc: BaseException, match: str | None) -> _Signature:
        return cls(_type_name(exc), match if match is not None else message_pattern(str(exc)))

    def matches(self, exc: BaseException) -> bool:
        return _type_name(exc) == self.type_name and re.match(self.pattern, str(exc), re.DOTALL) is not None


def _faults_text(n: int) -> str:
    return f"{n} fault{'' if n == 1 else 's'}"
