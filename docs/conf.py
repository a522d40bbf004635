"""Sphinx configuration for twinrpc's documentation (built by ``nox -s docs``).

Offline by design: nothing is fetched at build time. There is no intersphinx: references to Python's
and PyTorch's own types (``torch.Tensor``, ``collections.abc.Callable``...) are left unlinked and
listed in ``nitpick_ignore_regex`` below, so ``nitpicky`` still catches every broken reference to
twinrpc's own API. Prose links to PyTorch's documentation are plain URLs (``extlinks``), which need no
inventory. twinrpc's public classes live in private modules (``twinrpc._future.Future`` is
``twinrpc.futures.Future``); :func:`_public_names` maps those paths to the documented public names.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

DOCS = Path(__file__).parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "twinrpc"
author = "the twinrpc authors"
copyright = "the twinrpc authors; BSD-3-Clause"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.extlinks",
    "myst_parser",
    "twinrpc_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "README.md", "examples/README.md"]
templates_path: list[str] = []

# -- strictness: every reference must resolve (run with -W --keep-going) ------------------------------
nitpicky = True
nitpick_ignore_regex = [
    # Python's standard library and third-party types: not linked (no intersphinx, see above).
    (
        r"py:.*",
        r"(torch|collections|typing|pickle|_pickle|enum|datetime|random|hypothesis|threading|contextlib|pathlib)(\..*)?",
    ),
    (r"py:.*", r"(Tensor|Callable|Iterator|Sequence|Mapping|timedelta|SearchStrategy)"),
    (r"py:class", r"(PicklingError|TimeoutError|RuntimeError|Exception|BaseException|Enum)"),
    # twinrpc's private internals named in docstrings (message kinds, agent): not public API.
    (r"py:.*", r"twinrpc\.(simulator\.|impl\.)?_[a-z_]+\..*"),
    # the simulator's scheduler (simulator/_kernel/), private, in the signature of the public RRefMonitor
    # (built by the simulation from the parts it uses: the scheduler and the trace)
    (r"py:class", r"Scheduler"),
    # Type variables of generic signatures (Future[T], RRef[T]).
    (r"py:(class|obj)", r"(.*\.)?[TSF]"),
]

# -- autodoc -------------------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"undoc-members": False, "show-inheritance": False}
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
add_module_names = False

# -- MyST ----------------------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

extlinks = {
    "torchdoc": ("https://docs.pytorch.org/docs/2.13/%s", "%s"),
}

# -- the generated reference pages (docs/_ext/twinrpc_docs.py) ---------------------------------------
twinrpc_root = str(ROOT)
twinrpc_matrix_dir = os.environ.get("TWINRPC_MATRIX_DIR", str(ROOT / "build" / "conformance"))
twinrpc_require_matrix = os.environ.get("TWINRPC_DOCS_REQUIRE_MATRIX", "") not in ("", "0")

# -- HTML ----------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = "twinrpc"
html_static_path: list[str] = []
html_theme_options = {"navigation_with_keys": True}


# -- private module paths -> public names ---------------------------------------------------------------
PUBLIC_MODULES = (
    "twinrpc.rpc",
    "twinrpc.rpc.functions",
    "twinrpc.futures",
    "twinrpc.autograd",
    "twinrpc.optim",
    "twinrpc.simulator",
    "twinrpc.simulator.strategies",
    "twinrpc.simulator.calibration",
)


def _public_names() -> dict[str, str]:
    """``"twinrpc._future.Future" -> "twinrpc.futures.Future"`` for every public class and function."""
    import importlib

    names: dict[str, str] = {}
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            real = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
            if real != f"{modname}.{name}":
                names.setdefault(real, f"{modname}.{name}")
            names.setdefault(f"twinrpc.{name}", f"{modname}.{name}")  # a docstring's short form
    return names


_PUBLIC = _public_names()


def _resolve_public(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.reference | None:
    target = node.get("reftarget", "")
    public = _PUBLIC.get(target)
    if public is None or node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], public, node, contnode)


def _check_public_names_documented(app: Sphinx, env: BuildEnvironment) -> None:
    """Every name in a public module's ``__all__`` has a directive in docs/reference/api/."""
    import importlib
    import inspect

    from sphinx.util import logging

    documented = set(env.get_domain("py").objects)  # type: ignore[attr-defined]
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        for name in getattr(module, "__all__", ()):
            if inspect.ismodule(getattr(module, name)):
                continue
            if f"{modname}.{name}" not in documented:
                logging.getLogger(__name__).warning(
                    "public name %s.%s is not documented: add it to docs/reference/api/", modname, name
                )


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", _resolve_public)
    app.connect("env-check-consistency", _check_public_names_documented)
    return {"parallel_read_safe": True}
