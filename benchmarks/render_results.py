"""Render the benchmark results page from the figures the benchmarks wrote (``--json``).

``nox -s bench`` runs the benchmarks with ``--json benchmarks/results/<name>.json`` and then this script,
which writes ``docs/explanation/benchmark-results.md``: every figure with its target, the measured
ratio, the machine, the date, the commit and the command. The page is never edited by hand;
``tests/bench/test_bench_results.py`` checks that the committed page is what the committed JSON renders to.

Run: ``python benchmarks/render_results.py [--results DIR] [--out FILE] [--check]``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import _cli  # benchmarks/_cli.py (the script's directory is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "explanation" / "benchmark-results.md"
#: the order of the page's sections (a benchmark not listed comes after, by name)
ORDER = (
    "bench_gloo",
    "bench_dist_autograd",
    "bench_wakeups",
    "bench_two_hosts",
    "bench_auth",
    "bench_calibration",
    "bench_scale",
)
#: how the page names a system
NAMES = {
    "twinrpc": "twinrpc",
    "twinrpc-keyed": "twinrpc with a job key",
    "tensorpipe": "TensorPipe",
    "gloo": "raw gloo",
    "linear": "linear (jobs x one job)",
}
#: where a benchmark's two workers run (the summary's first column)
WHERE = {"bench_two_hosts": "two hosts", "bench_auth": "two hosts"}


def _num(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def _target(f: dict[str, Any]) -> str:
    t = f.get("target")
    if not t:
        return "none (reported)"
    return f"{t['op'].replace('<=', '≤').replace('>=', '≥')} {t['bound']}"


def _met(f: dict[str, Any]) -> str:
    if f.get("met") is None:
        return "-"
    return "met" if f["met"] else "**missed**"


def _ratio(f: dict[str, Any]) -> str:
    rounds = f.get("round_ratios") or []
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{f['ratio']:.2f}{spread}"


def _machine(m: dict[str, Any]) -> str:
    load = m.get("load_average_1min_at_start")
    load_text = "" if load is None or math.isnan(load) else f"; load average {load:.2f} at the start"
    return (
        f"{m.get('cpus')} CPUs ({m.get('cpu')}), {m.get('system')}, Python {m.get('python')}, "
        f"torch {m.get('torch')}{load_text}"
    )


def load(results: Path) -> list[dict[str, Any]]:
    """The documents in ``results``, in the page's order."""
    docs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(results.glob("*.json"))]

    def key(doc: dict[str, Any]) -> tuple[int, str]:
        name = doc["benchmark"]
        return (ORDER.index(name) if name in ORDER else len(ORDER), name)

    return sorted(docs, key=key)


def _extra(doc: dict[str, Any]) -> list[str]:
    """Lines for what a benchmark reports besides its figures."""
    extra, lines = doc.get("extra") or {}, []
    shm = extra.get("shared_memory", "absent")
    if shm != "absent":
        if shm is None:
            lines.append("- twinrpc's link: the tree had no same-host (shared-memory) path.")
        else:
            ways = "both ways" if all(shm) else "one way" if any(shm) else "neither way"
            lines.append(f"- twinrpc's link moved data through shared memory: {ways}.")
    frames = extra.get("frames")
    if frames:
        lines.append(
            f"- With 64 calls in flight, messages per header frame: requests "
            f"{frames['requests_per_frame']:.2f}, replies {frames['replies_per_frame']:.2f}."
        )
    reference = extra.get("tensorpipe")
    if reference:
        cells = ", ".join(f"{name} {_num(v)}" for name, v in reference.items())
        lines.append(f"- TensorPipe between the same namespaces, for reference (same units): {cells}.")
    model = extra.get("model")
    if model:
        lines.append(f"- Fitted model: {model}.")
    if extra.get("wakeups"):
        lines += _wakeups(extra["wakeups"])
    if extra.get("scale"):
        lines += _scale(extra["scale"])
    if extra.get("sim_scale"):
        lines += _sim_scale(extra["sim_scale"])
    for failure in extra.get("failed") or []:
        lines.append(f"- Failed: {failure}.")
    if extra.get("explore"):
        lines += _explore(extra)
    return lines


def _explore(extra: dict[str, Any]) -> list[str]:
    """bench_explore.py's start-up and whole-exploration figures, beside the search's."""
    runs = extra["explore"]
    if "search_runs_per_s" not in runs[0]:  # results written before the search was measured apart
        cells = "; ".join(
            f"{e['jobs']} job{'s' if e['jobs'] > 1 else ''}: {_num(e['runs_per_s'])} runs/s, "
            f"{_num(e['wall_s'])} s, the first run done after {_num(e['first_run_s'])} s"
            for e in runs
        )
        return [f"- Medians over the rounds (worker start-up included in the time): {cells}."]
    searching = "; ".join(
        f"{e['jobs']} job{'s' if e['jobs'] > 1 else ''}: {_num(e['search_runs_per_s'])} runs/s" for e in runs
    )
    start = "; ".join(
        f"{e['jobs']} job{'s' if e['jobs'] > 1 else ''}: every job searching after "
        f"{_num(e['all_searching_s'])} s, {_num(e['runs_per_s'])} runs/s over the whole "
        f"{_num(e['wall_s'])} s"
        for e in runs
    )
    return [
        f"- The search while every job searches (medians over the rounds): {searching}.",
        f"- Start-up: the server the jobs fork from was ready after {_num(extra['explore_server_s'])} s "
        f"(once per exploration, beside its calibration run); then, per exploration: {start}.",
    ]


def _sim_scale(runs: list[dict[str, Any]]) -> list[str]:
    """bench_sim_scale.py's runs: per world size, messages, events and memory."""
    lines = [
        "| simulated workers | messages | scheduler events per message | messages/s (trace off) | "
        "peak RSS, trace off (MB) | peak RSS, trace on (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['workers']:,} | {r['messages']:,} | {r['events'] / r['messages']:.3f} | "
            f"{_num(r['messages_per_s'])} | {_num(r.get('rss_mb'))} | {_num(r['rss_mb_trace_on'])} |"
        )
    return lines


def _per_op(worker: dict[str, Any], key: str) -> str:
    return f"{worker[key]:.2f}" if key in worker else "-"


def _wakeups(profile: dict[str, Any]) -> list[str]:
    """bench_wakeups.py's tables: per loop, system and worker, what one operation costs."""
    lines: list[str] = []
    for got in profile["loops"]:
        if lines:
            lines.append("")
        lines += [
            f"**{got['loop']}**: {got['label']}; {got['ops']:,} operations after {got['warmup']:,} "
            f"warm-up ones in each launch, medians of {got['launches']} launches of each system.",
            "",
            "| system | worker | wall per op (us) | CPU per op (us) | wake-ups per op | "
            "wake-ups per op by thread role (CPU per op) | threads started / exited | "
            "header frames per op | messages per op |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for s in got["systems"]:
            for worker, w in s["workers"].items():
                roles = ", ".join(
                    f"{v['role']} {v['wakeups']:.2f} ({v['cpu_us']:,.0f} us)"
                    for v in w["roles"]
                    if v["wakeups"] >= 0.01 or v["cpu_us"] >= 1
                )
                lines.append(
                    f"| {NAMES.get(s['system'], s['system'])} | {worker} | {_num(s['wall_us'])} | "
                    f"{_num(w['cpu_us'])} | {w['wakeups']:.2f} | {roles or '-'} | "
                    f"{w['threads_started']:g} / {w['threads_exited']:g} | {_per_op(w, 'frames')} | {_per_op(w, 'messages')} |"
                )
    return lines


def _scale(rows: list[dict[str, Any]]) -> list[str]:
    """bench_scale.py's table: per job size, peers called and system, what a worker costs (the
    slowest worker's times, the largest counts of any worker; medians over the rounds)."""
    lines = [
        "Per job: the slowest worker's times and the largest counts of any worker (threads also right "
        "after the calls, and after shutdown), medians over the rounds; threads by role of the busiest "
        "worker.",
        "",
        "| workers | each calls | system | init (s) | first calls (s) | a call (us) | shutdown (s) | "
        "threads after the calls | threads settled | descriptors | RSS (MB) | threads / descriptors "
        "after shutdown | threads by role |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        roles = ", ".join(f"{name} {n}" for name, n in sorted(r["roles"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {r['workers']} | {r['peers']} | {NAMES.get(r['system'], r['system'])} | {_num(r['init_s'])} | "
            f"{_num(r['first_calls_s'])} | {_num(r['call_us'])} | {_num(r['shutdown_s'])} | "
            f"{r['threads_after_calls']:.0f} | {r['threads']:.0f} | {r['fds']:.0f} | {_num(r['rss_mb'])} | "
            f"{r['threads_after_shutdown']:.0f} / {r['fds_after_shutdown']:.0f} | {roles} |"
        )
    return lines


def render(docs: list[dict[str, Any]]) -> str:
    out = [
        "# Benchmark results",
        "",
        "<!-- Generated by benchmarks/render_results.py from benchmarks/results/*.json: do not edit. -->",
        "",
        "The latest figures of `nox -s bench`, as the session wrote them on the machine named with each.",
        "Each benchmark writes its figures to `benchmarks/results/` and `benchmarks/render_results.py`",
        "renders this page from them. A ratio is twinrpc's value over that of what it is measured against",
        "(TensorPipe in the same invocation, or the raw gloo floor between two network namespaces): the",
        "median over the invocation's alternating rounds of the ratio within one round, with the lowest",
        "and highest round in brackets. How the benchmarks measure and how to read them: {doc}`benchmarks`.",
        "",
    ]
    if not docs:
        out += ["No results yet: run `nox -s bench`.", ""]
        return "\n".join(out)
    out += [
        "## Summary",
        "",
        "| where | figure | against | ratio | target | |",
        "|---|---|---|---|---|---|",
    ]
    for doc in docs:
        where = WHERE.get(doc["benchmark"], "one host")
        for f in doc["figures"]:
            against = NAMES.get(f["against"], f["against"])
            out.append(f"| {where} | {f['label']} | {against} | {_ratio(f)} | {_target(f)} | {_met(f)} |")
    out.append("")
    for doc in docs:
        out += [
            f"## {doc['title']}",
            "",
            f"`{doc['command']}`, {doc['date']}, commit `{doc['commit']}`"
            + (f", {doc['rounds']} alternating rounds." if doc["figures"] else "."),
            f"Machine: {_machine(doc['machine'])}.",
            "",
        ]
        if doc["figures"]:
            first = doc["figures"][0]
            systems = [first["system"], first["against"]]
            heads = " | ".join(NAMES.get(s, s) for s in systems)
            out += [
                f"| figure | unit | {heads} | ratio | target | |",
                "|---|---|" + "---|" * len(systems) + "---|---|---|",
            ]
            for f in doc["figures"]:
                if [f["system"], f["against"]] == systems:
                    cells = " | ".join(_num(f["values"].get(s, float("nan"))) for s in systems)
                else:  # a figure of other systems than the table's columns: each value names its own
                    cells = " | ".join(
                        f"{NAMES.get(s, s)}: {_num(f['values'][s])}" for s in (f["system"], f["against"])
                    )
                better = "higher is better" if f["higher_is_better"] else "lower is better"
                out.append(
                    f"| {f['label']} | {f['unit']}, {better} | {cells} | {_ratio(f)} | {_target(f)} | {_met(f)} |"
                )
            out.append("")
        extra = _extra(doc)
        if extra:
            out += [*extra, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--results", default=str(RESULTS), help="the directory of the benchmarks' JSON")
    parser.add_argument("--out", default=str(PAGE), help="the page to write")
    parser.add_argument(
        "--check", action="store_true", help="fail if the page differs from what it renders to"
    )
    args = parser.parse_args(argv)
    text = render(load(Path(args.results)))
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"{out} is not what {args.results} renders to: run python benchmarks/render_results.py")
            return 1
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
