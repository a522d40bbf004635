"""One scan for both boundary tests (tests/architecture/test_core_boundaries.py, tests/architecture/test_sim_boundaries.py):
``obj._name`` where ``obj`` is another object, i.e. a shortcut across a seam."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib


def _names_defined(tree: ast.Module, *, listed: bool) -> set[str]:
    """Names the module itself defines: its own privates are its to use (Python's module privacy).
    ``listed``: names it lists as strings (``__slots__``, dataclass fields) count too."""
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif listed and isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
        elif listed and isinstance(node, ast.Constant) and str(node.value).startswith("_"):
            defined.add(str(node.value))
    return defined


def _module_aliases(tree: ast.Module, package: str) -> set[str]:
    """Names the module binds to modules (``import x``, ``import x.y as z``, ``from p import m`` of a
    module m): a private attribute of a module, e.g. ``sys._getframe``, is that library's API."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                try:
                    value = getattr(importlib.import_module(base), a.name, None)
                except ImportError:
                    value = None
                if inspect.ismodule(value):
                    aliases.add(a.asname or a.name)
    return aliases


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def private_reaches(
    path: pathlib.Path, *, base: pathlib.Path, allowed: frozenset[str] | set[str], package: str | None = None
) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self``/``cls``, ``_name`` is not in ``allowed`` and nothing in
    the module defines it, each as ``"path:line: source"`` with the path relative to ``base``.

    ``package`` (the dotted package ``path`` is in, to resolve relative imports) makes the scan lenient
    the simulator's way: a private reached through an imported module is that library's API, and names
    the module lists as strings are its own. ``None``: the core's strict scan.
    """
    tree = ast.parse(path.read_text())
    defined = _names_defined(tree, listed=package is not None)
    aliases = _module_aliases(tree, package) if package is not None else set()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in defined or name in allowed:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        root = _root(node.value)
        if isinstance(root, ast.Name) and root.id in aliases:
            continue
        found.append(f"{path.relative_to(base)}:{node.lineno}: {ast.unparse(node)}")
    return found
