"""Port a ``torch.distributed.rpc`` program to twinrpc by rewriting its import lines, nothing else.

``python examples/port_imports.py SOURCE DEST`` writes DEST: SOURCE with every import of
``torch.distributed.rpc`` / ``.autograd`` / ``.optim`` / ``.nn`` turned into the same import of
``twinrpc.rpc`` / ``.autograd`` / ``.optim`` / ``.nn``. Every other line is kept
byte for byte, so a diff of the two files shows only imports.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_MODULES = {
    "torch.distributed.rpc": "twinrpc.rpc",
    "torch.distributed.autograd": "twinrpc.autograd",
    "torch.distributed.optim": "twinrpc.optim",
    "torch.distributed.nn": "twinrpc.nn",
}
_IMPORT = re.compile(
    r"^(\s*)(import|from)\s+(torch\.distributed\.(?:rpc|autograd|optim|nn))\b(.*)$", re.DOTALL
)


def port_line(line: str) -> str:
    """The line with its torch RPC module renamed, if it is an import line; else the line unchanged."""
    m = _IMPORT.match(line)
    if m is None:
        return line
    indent, keyword, module, rest = m.groups()
    return f"{indent}{keyword} {_MODULES[module]}{rest}"


def port_source(text: str) -> str:
    return "".join(port_line(line) for line in text.splitlines(keepends=True))


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python examples/port_imports.py SOURCE DEST")
    source, dest = map(Path, argv)
    dest.write_text(port_source(source.read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
