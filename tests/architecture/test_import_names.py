"""The folders impl/ and simulator/ are installed as twinrpc.impl and twinrpc.simulator (setuptools
package-dir), and spec/ is documentation. Importing one of them by its bare folder name works only from
the repository root, and then loads a second copy of every module in it (its own locks, registries and
module constants), so the tree must always use the namespaced name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BARE = {"impl", "simulator", "spec"}
SKIP = {".nox", ".git", "build", "docs/_build", ".hypothesis"}


def _python_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not any(rel == s or rel.startswith(s + "/") for s in SKIP):
            files.append(path)
    return files


def bare_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import whose top-level name is one of the bare folders."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in BARE]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] in BARE
        ):
            found.append((node.lineno, node.module))
    return found


def test_bare_imports_are_detected_and_relative_ones_are_not() -> None:
    source = (
        "from impl._link import _TAG\nimport simulator.strategies\nfrom . import impl\nfrom ._x import y\n"
    )
    assert bare_imports(source) == [(1, "impl._link"), (2, "simulator.strategies")]


def test_no_module_in_the_tree_imports_a_folder_by_its_bare_name() -> None:
    files = _python_files()
    assert any(p.name == "_link.py" for p in files)  # the scan reaches impl/
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in files
        for line, module in bare_imports(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "use twinrpc.<name>, not the bare folder name:\n" + "\n".join(offenders)
