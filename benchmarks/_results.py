"""The benchmarks' figures as plain data: what ``--json`` writes and ``render_results.py`` reads.

A *figure* is one number a benchmark compares: its value for twinrpc and for what it is measured
against (TensorPipe in the same invocation, or the raw gloo floor between two namespaces), the ratio
(the median over the invocation's alternating rounds of the ratio within a round, so that both systems
saw the same load), and the target that ratio should meet. A *document* is one benchmark invocation:
its figures, the command, the date, the commit and the machine.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def figure(
    key: str,
    label: str,
    unit: str,
    higher_is_better: bool,
    values: dict[str, float],
    round_ratios: list[float],
    target: tuple[str, float] | None,
) -> dict[str, Any]:
    """One figure; ``values`` names the measured system first, then what it is measured against."""
    ratio = statistics.median(round_ratios) if round_ratios else float("nan")
    met = None
    if target is not None:
        op, bound = target
        met = ratio <= bound if op == "<=" else ratio >= bound
    system, against = list(values)[:2]
    return {
        "key": key,
        "label": label,
        "system": system,
        "against": against,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "values": values,
        "ratio": ratio,
        "round_ratios": round_ratios,
        "target": None if target is None else {"op": target[0], "bound": target[1]},
        "met": met,
    }


def describe(f: dict[str, Any]) -> str:
    """A figure on one line, for the benchmark's own output."""
    system, against = f["system"], f["against"]
    value, theirs = f["values"][system], f["values"][against]
    target = ""
    if f["target"]:
        target = f"  target {f['target']['op']} {f['target']['bound']}: {'met' if f['met'] else 'MISSED'}"
    spread = ""
    if len(f["round_ratios"]) > 1:
        spread = f" (rounds {min(f['round_ratios']):.2f}-{max(f['round_ratios']):.2f})"
    return (
        f"{f['label']}: {system} {value:,.4g} {f['unit']}, {against} {theirs:,.4g} {f['unit']}, "
        f"ratio {f['ratio']:.2f}{spread}{target}"
    )


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    import torch

    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_1min_at_start": load,
    }


def commit() -> str:
    """The checkout's commit, with ``+changes`` when its tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short=7", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + ("+changes" if dirty else "")


def document(
    benchmark: str,
    title: str,
    command: str,
    figures: list[dict[str, Any]],
    *,
    rounds: int,
    extra: dict[str, Any] | None = None,
    machine_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "benchmark": benchmark,
        "title": title,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": machine_info or machine(),
        "rounds": rounds,
        "figures": figures,
        "extra": extra or {},
    }


def write(path: str | Path, doc: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
