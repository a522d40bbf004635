"""Sphinx extension: the spec, the deviations and the conformance matrix, generated at build time.

Nothing on the reference pages it writes is typed by hand. When the builder starts it reads

- ``spec/*.md`` (the ``### ID: title`` requirements, parsed with the conformance harness's own
  heading regex),
- ``spec/deviations.toml`` (through the harness's own parser),
- the ``pytest.mark.spec(...)`` tags of every test in ``conformance/`` (read statically, so the gate
  below does not depend on a run), and
- the latest conformance runs ``build/conformance/{sim,gloo,torch}.json`` (written by
  ``nox -s conformance -- <backend>``, or by ``pytest conformance --matrix-json``),

and writes MyST pages under ``docs/reference/generated/`` (ignored by git) before Sphinx reads its
sources. The build fails (``ExtensionError``) when

- a requirement ID of ``spec/`` is cited by no conformance test and is not listed in
  ``docs/untested.toml`` (the short, shrinking list of requirements without a test yet, each with
  the reason; an entry whose ID a test now cites stops applying and is only logged, so a commit that
  adds a test never breaks the docs), or
- ``twinrpc_require_matrix`` is true (``TWINRPC_DOCS_REQUIRE_MATRIX=1``, set by ``nox -s tests``) and
  a backend's JSON is missing. Otherwise a missing backend renders as "not run" and the matrix page
  says so at the top.
"""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import tomllib
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging

logger = logging.getLogger(__name__)

BACKENDS = ("sim", "gloo", "torch")
GENERATED = Path("reference") / "generated"

# What each spec file is about, in reading order (a file missing here goes last, by name).
AREA_ORDER = ("rpc", "errors", "lifecycle", "shutdown", "rref", "autograd", "optim", "simulator")


# -- reading -----------------------------------------------------------------------------------------
def _load_harness_spec(root: Path) -> ModuleType:
    """``conformance/harness/spec.py`` loaded by path (it is pytest-free; its package is not)."""
    path = root / "conformance" / "harness" / "spec.py"
    spec = importlib.util.spec_from_file_location("_twinrpc_docs_harness_spec", path)
    if spec is None or spec.loader is None:
        raise ExtensionError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@dataclass
class Requirement:
    id: str
    title: str
    area: str
    body: list[str] = field(default_factory=list)
    source: str = ""
    backends: tuple[str, ...] = BACKENDS
    notes: list[str] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return self.id.lower()


@dataclass
class SpecFile:
    stem: str
    title: str
    intro: list[str]
    requirements: list[Requirement]


def read_spec(spec_dir: Path, heading_re: re.Pattern[str]) -> list[SpecFile]:
    """Every ``spec/*.md`` but the README, split into an introduction and its requirements."""
    line_re = re.compile(heading_re.pattern.lstrip("^").rstrip("$"))
    files = []
    paths = [p for p in spec_dir.glob("*.md") if p.name != "README.md"]
    order = {name: i for i, name in enumerate(AREA_ORDER)}
    for path in sorted(paths, key=lambda p: (order.get(p.stem, len(order)), p.stem)):
        title, intro, reqs = path.stem, [], []
        current: Requirement | None = None
        field_name: str | None = None
        for line in path.read_text(encoding="utf-8").splitlines():
            match = line_re.fullmatch(line)
            if match:
                current = Requirement(match.group(1), match.group(2).strip(), path.stem)
                reqs.append(current)
                field_name = None
                continue
            if line.startswith("# ") and current is None and title == path.stem:
                title = line[2:].strip()
                continue
            if line.startswith(("## ", "### ")):  # any other heading ends the requirement
                current = None
                intro.append(line.replace("### ", "## ", 1) if line.startswith("### ") else line)
                continue
            if current is None:
                intro.append(line)
                continue
            if line.startswith("Source: "):
                current.source, field_name = line[len("Source: ") :].strip(), "source"
            elif line.startswith("Backends: "):
                names = [b.strip() for b in line[len("Backends: ") :].split(",")]
                current.backends, field_name = tuple(b for b in names if b), None
            elif line.startswith("Notes: "):
                current.notes, field_name = [line[len("Notes: ") :]], "notes"
            elif field_name is not None and line.strip():  # a continuation line of Source/Notes
                if field_name == "notes":
                    current.notes.append(line)
                else:
                    current.source += " " + line.strip()
            else:
                field_name = None
                current.body.append(line)
        files.append(SpecFile(path.stem, title, intro, reqs))
    return files


def cited_ids(conformance_dir: Path) -> dict[str, set[str]]:
    """Requirement ID -> names of the conformance tests tagged with it (``@pytest.mark.spec(...)``)."""
    cited: dict[str, set[str]] = {}
    for path in sorted(conformance_dir.rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if not node.name.startswith("test"):
                continue
            for deco in node.decorator_list:
                if (
                    isinstance(deco, ast.Call)
                    and isinstance(deco.func, ast.Attribute)
                    and deco.func.attr == "spec"
                ):
                    for arg in deco.args:
                        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                            cited.setdefault(arg.value, set()).add(node.name)
    return cited


@dataclass
class Run:
    backend: str
    path: Path
    tests: list[dict[str, Any]]
    sim_seed: Any
    written: datetime.datetime


def read_runs(matrix_dir: Path) -> dict[str, Run | None]:
    runs: dict[str, Run | None] = {}
    for backend in BACKENDS:
        path = matrix_dir / f"{backend}.json"
        if not path.is_file():
            runs[backend] = None
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ExtensionError(f"{path} is not valid JSON ({exc}); re-run nox -s conformance -- {backend}")
        if data.get("backend") != backend:
            raise ExtensionError(f"{path} holds a run of backend {data.get('backend')!r}, not {backend!r}")
        written = datetime.datetime.fromtimestamp(path.stat().st_mtime, tz=datetime.UTC)
        runs[backend] = Run(backend, path, list(data.get("tests", [])), data.get("sim_seed"), written)
    return runs


# -- the status of one requirement on one backend -------------------------------------------------
@dataclass
class Cell:
    text: str  # short label for the table
    kind: str  # pass | xfail | na | fail | notrun | untested | skipped
    deviations: tuple[str, ...] = ()
    counts: Counter[str] = field(default_factory=Counter)


def cell_for(req: Requirement, run: Run | None, untested: bool) -> Cell:
    if untested:
        return Cell("no test yet", "untested")
    if run is None:
        return Cell("not run", "notrun")
    records = [t for t in run.tests if req.id in t.get("spec", ())]
    counts = Counter(t["outcome"] for t in records)
    devs = tuple(sorted({t["deviation"] for t in records if t.get("deviation")}))
    if not records:
        if run.backend not in req.backends:
            return Cell("not applicable", "na")
        return Cell("not in this run", "notrun")
    bad = counts["failed"] + counts["error"] + counts["xpassed"]
    ran = sum(n for o, n in counts.items() if o != "not applicable")
    if bad:
        return Cell(f"FAIL ({bad} of {ran})", "fail", devs, counts)
    if ran == 0:
        return Cell("not applicable", "na", devs, counts)
    if counts["skipped"] == ran:
        return Cell(f"skipped ({ran})", "skipped", devs, counts)
    parts = []
    if counts["passed"]:
        parts.append(f"pass ({counts['passed']})")
    if counts["xfailed"]:
        parts.append(f"strict xfail ({counts['xfailed']})")
    if counts["skipped"]:
        parts.append(f"skipped ({counts['skipped']})")
    return Cell(", ".join(parts), "xfail" if counts["xfailed"] else "pass", devs, counts)


_ICON = {
    "pass": "✅",
    "xfail": "🟨",
    "na": "\u2796",
    "fail": "❌",
    "notrun": "⚪",
    "untested": "⬜",
    "skipped": "⚠️",
}


def _cell_md(cell: Cell) -> str:
    text = f"{_ICON[cell.kind]} {cell.text}"
    if cell.deviations:
        text += " " + ", ".join(f"{{ref}}`{d} <{d.lower()}>`" for d in cell.deviations)
    return text


# -- writing -------------------------------------------------------------------------------------------
def _escape_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _write(path: Path, text: str) -> None:
    """Write only when the text changed, so incremental builds stay incremental."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


HEADER = (
    "<!-- GENERATED by docs/_ext/twinrpc_docs.py at build time from {src}: do not edit, "
    "edit the source instead. -->\n\n"
)


def _status_line(req: Requirement, cells: dict[str, Cell]) -> str:
    return " · ".join(f"**{b}** {_cell_md(cells[b])}" for b in BACKENDS)


def render_spec_file(spec: SpecFile, statuses: dict[str, dict[str, Cell]]) -> str:
    out = [HEADER.format(src=f"spec/{spec.stem}.md"), f"# {spec.title}\n"]
    intro = "\n".join(spec.intro).strip()
    if intro:
        out.append(intro + "\n")
    for req in spec.requirements:
        out.append(f"({req.anchor})=\n## {req.id}: {req.title}\n")
        out.append("\n".join(req.body).strip() + "\n")
        meta = []
        if req.source:
            meta.append(f"Source\n: {req.source}\n")
        if req.backends != BACKENDS:
            meta.append(f"Backends\n: {', '.join(req.backends)} (observable only there)\n")
        if req.notes:
            meta.append("Notes\n: " + " ".join(n.strip() for n in req.notes) + "\n")
        meta.append(f"Conformance (latest run)\n: {_status_line(req, statuses[req.id])}\n")
        out.append("\n".join(meta))
    return "\n".join(out)


def render_spec_index(files: list[SpecFile]) -> str:
    rows = "\n".join(
        f"| {{doc}}`{f.title} <{f.stem}>` | {f.requirements[0].id} … {f.requirements[-1].id} "
        f"| {len(f.requirements)} |"
        for f in files
        if f.requirements
    )
    toc = "\n".join(f.stem for f in files)
    total = sum(len(f.requirements) for f in files)
    return (
        HEADER.format(src="spec/*.md") + "# The specification\n\n"
        "The normative requirements twinrpc is built and tested against, rendered from `spec/*.md` at "
        "build time. Every requirement has a stable anchor named after its ID in lower case "
        "(for example `rpc.html#rpc-1` for RPC-1), and ends with its conformance status from the "
        "latest run on each backend (see {doc}`../matrix`).\n\n"
        "Keywords: **MUST**/**MUST NOT** are required and checked by conformance tests; "
        "**SHOULD** is expected (a departure is documented but is not a conformance failure); "
        "**MAY** is allowed, and programs must not rely on it either way. A quoted message fragment is a "
        'substring the message must contain. "Blocks" means the calling thread (on the simulator, the '
        "calling simulated task) does not return until the stated condition holds. Timeouts are float "
        "seconds: `-1` means the default current when the call is made, `0` means never.\n\n"
        f"{total} requirements:\n\n"
        "| area | IDs | count |\n|---|---|---|\n" + rows + "\n\n"
        "```{toctree}\n:maxdepth: 1\n:hidden:\n\n" + toc + "\n```\n"
    )


def render_deviations(deviations: list[Any], req_area: dict[str, str]) -> str:
    out = [
        HEADER.format(src="spec/deviations.toml"),
        "# Deviations from PyTorch\n",
        "Where twinrpc deliberately behaves differently from PyTorch 2.13, rendered from "
        "`spec/deviations.toml`. The spec states twinrpc's behaviour, so a deviation's tests are "
        "expected to fail on the backends listed (usually `torch`): the conformance plugin marks them "
        "`xfail(strict=True)` there, and a deviation whose test starts passing fails the run and must be "
        "removed. A deviation is never used to hide a twinrpc bug.\n",
    ]
    if not deviations:
        out.append("There are no deviations.\n")
    for dev in deviations:
        area = req_area.get(dev.requirement)
        req = f"{{ref}}`{dev.requirement} <{dev.requirement.lower()}>`" if area else dev.requirement
        tests = ", ".join(f"`{t}`" for t in dev.tests)
        out.append(
            f"({dev.id.lower()})=\n## {dev.id} ({dev.requirement})\n\n"
            f"Requirement\n: {req}\n\n"
            f"Expected to fail on\n: {', '.join(dev.backends)}\n\n"
            f"Tests\n: {tests}\n\n"
            f"{dev.reason}\n"
        )
    return "\n".join(out)


def render_matrix(
    files: list[SpecFile],
    statuses: dict[str, dict[str, Cell]],
    runs: dict[str, Run | None],
    deviations: list[Any],
    untested: dict[str, str],
    suite_tests: set[str],
) -> str:
    out = [
        HEADER.format(src="build/conformance/{sim,gloo,torch}.json, spec/ and conformance/"),
        "# Conformance matrix\n",
        "Every requirement of the {doc}`specification <spec/index>` against the three backends, from the "
        "latest conformance run of each (`nox -s conformance -- sim|gloo|torch` writes "
        "`build/conformance/<backend>.json`; `nox -s tests` runs all three). `torch` is upstream PyTorch "
        "2.13, the oracle: a test that passes there encodes real PyTorch behaviour.\n",
        "Legend: ✅ pass (number of tests) · 🟨 strict xfail: a documented "
        "{doc}`deviation <deviations>`, expected to fail there, and the run fails if it starts passing · "
        "\u2796 not applicable (the requirement is observable only on other backends; its tests are "
        "deselected here) · ❌ failed in that run · ⚪ not run · ⬜ no conformance test yet "
        "(listed in `docs/untested.toml` with the reason).\n",
    ]
    missing = [b for b in BACKENDS if runs[b] is None]
    if missing:
        out.append(
            "```{warning}\nNo run of "
            + ", ".join(f"`{b}`" for b in missing)
            + " was found when these pages were built (`build/conformance/<backend>.json` missing), so "
            'those columns say "not run". Run `nox -s conformance -- <backend>` (or `nox -s docs`, '
            "which runs the missing ones first) and rebuild.\n```\n"
        )
    out.append("## The runs\n\n| backend | tests | outcomes | written (UTC) |\n|---|---|---|---|")
    for b in BACKENDS:
        run = runs[b]
        if run is None:
            out.append(f"| `{b}` | - | not run | - |")
            continue
        counts = Counter(t["outcome"] for t in run.tests)
        outcomes = ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
        stale = suite_tests - {t["test"] for t in run.tests}
        if stale:
            outcomes += (
                f" (**{len(stale)} test(s) of the suite are not in this run: it is older than the suite**)"
            )
        out.append(f"| `{b}` | {len(run.tests)} | {outcomes} | {run.written:%Y-%m-%d %H:%M} |")
    out.append("")
    for f in files:
        if not f.requirements:
            continue
        out.append(f"## {f.title}\n")
        out.append("| requirement | " + " | ".join(BACKENDS) + " |")
        out.append("|---|" + "---|" * len(BACKENDS))
        for req in f.requirements:
            name = _escape_cell(f"{{ref}}`{req.id} <{req.anchor}>` {req.title}")
            cells = " | ".join(_escape_cell(_cell_md(statuses[req.id][b])) for b in BACKENDS)
            out.append(f"| {name} | {cells} |")
        out.append("")
    xfails: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}  # parametrized cases counted once
    for b in BACKENDS:
        run = runs[b]
        for t in run.tests if run else ():
            if t["outcome"] == "xfailed":
                first, n = xfails.get((b, t["test"]), (t, 0))
                xfails[(b, t["test"])] = (first, n + 1)
    out.append("## Strict xfails in these runs\n")
    if not xfails:
        out.append("None.\n")
    by_id = {d.id: d for d in deviations}
    for (b, _), (t, n) in xfails.items():
        dev = by_id.get(t.get("deviation") or "")
        reason = dev.reason if dev else "(no deviation recorded)"
        dev_ref = f"{{ref}}`{dev.id} <{dev.id.lower()}>`" if dev else "?"
        specs = ", ".join(f"{{ref}}`{s} <{s.lower()}>`" for s in t.get("spec", ()))
        cases = f" ({n} cases)" if n > 1 else ""
        out.append(f"- **{b}**, `{t['test']}`{cases} ({specs}), {dev_ref}: {reason}")
    out.append("")
    if untested:
        out.append("## Requirements without a conformance test yet\n")
        out.append(
            "These IDs are cited by no test in `conformance/`. The build accepts that only for the IDs "
            "listed in `docs/untested.toml`, each with the reason it has no test yet; any other "
            "uncited ID fails the build.\n"
        )
        for rid, why in sorted(untested.items(), key=lambda kv: _id_key(kv[0])):
            out.append(f"- {{ref}}`{rid} <{rid.lower()}>`: {why}")
        out.append("")
    return "\n".join(out)


def _id_key(rid: str) -> tuple[str, str, int]:
    m = re.fullmatch(r"([A-Z]+)-([A-Z]?)(\d+)", rid)
    return (m.group(1), m.group(2), int(m.group(3))) if m else (rid, "", 0)


def read_untested(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    untested: dict[str, str] = {}
    for entry in data.get("pending", []):
        for rid in entry["ids"]:
            if rid in untested:
                raise ExtensionError(f"{path}: {rid} is listed twice")
            untested[rid] = str(entry["why"]).strip()
    return untested


# -- the event handler ---------------------------------------------------------------------------------
def generate(app: Sphinx) -> None:
    root = Path(app.config.twinrpc_root).resolve()
    srcdir = Path(app.srcdir)
    harness = _load_harness_spec(root)
    files = read_spec(root / "spec", harness.HEADING_RE)
    ids = {r.id: r for f in files for r in f.requirements}
    if not ids:
        raise ExtensionError(f"no requirement headings found in {root / 'spec'}")
    deviations = list(harness.load_deviations(root / "spec" / "deviations.toml"))
    cited = cited_ids(root / "conformance")
    untested = read_untested(srcdir / "untested.toml")

    problems = []
    uncited = sorted(set(ids) - set(cited) - set(untested), key=_id_key)
    if uncited:
        problems.append(
            "spec/ has requirement IDs that no conformance test cites: "
            + ", ".join(uncited)
            + ". Tag a test with @pytest.mark.spec(...) for each (or, only for a requirement not implemented "
            "yet, list it in docs/untested.toml with the reason)."
        )
    stale = sorted(set(untested) & set(cited), key=_id_key)
    if stale:
        # Not an error: tests land in other people's commits, and the entry simply stops applying.
        logger.info("twinrpc_docs: docs/untested.toml lists IDs that tests now cite (delete them): %s", stale)
        untested = {rid: v for rid, v in untested.items() if rid not in cited}
    unknown = sorted(set(untested) - set(ids), key=_id_key)
    if unknown:
        problems.append("docs/untested.toml lists IDs that spec/ does not define: " + ", ".join(unknown))
    unknown_tags = sorted(set(cited) - set(ids), key=_id_key)
    if unknown_tags:
        problems.append("conformance tests cite IDs that spec/ does not define: " + ", ".join(unknown_tags))
    if problems:
        raise ExtensionError("\n".join(problems))

    matrix_dir = Path(app.config.twinrpc_matrix_dir)
    if not matrix_dir.is_absolute():
        matrix_dir = root / matrix_dir
    runs = read_runs(matrix_dir)
    missing = [b for b in BACKENDS if runs[b] is None]
    if missing:
        msg = "no conformance run for " + ", ".join(missing) + f" in {matrix_dir}"
        if app.config.twinrpc_require_matrix:
            raise ExtensionError(msg + " (TWINRPC_DOCS_REQUIRE_MATRIX is set)")
        logger.info("twinrpc_docs: %s; the matrix says 'not run' for them", msg)

    statuses = {
        rid: {b: cell_for(req, runs[b], rid in untested) for b in BACKENDS} for rid, req in ids.items()
    }
    suite_tests = {name for names in cited.values() for name in names}
    out = srcdir / GENERATED
    for f in files:
        _write(out / "spec" / f"{f.stem}.md", render_spec_file(f, statuses))
    _write(out / "spec" / "index.md", render_spec_index(files))
    _write(out / "deviations.md", render_deviations(deviations, {r: ids[r].area for r in ids}))
    _write(out / "matrix.md", render_matrix(files, statuses, runs, deviations, untested, suite_tests))
    fails = sorted(rid for rid, cells in statuses.items() for c in cells.values() if c.kind == "fail")
    if fails:
        logger.info("twinrpc_docs: the latest runs have failures for %s", ", ".join(fails))


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("twinrpc_root", "..", "env")
    app.add_config_value("twinrpc_matrix_dir", "build/conformance", "env")
    app.add_config_value("twinrpc_require_matrix", False, "env")
    app.connect("builder-inited", generate)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
