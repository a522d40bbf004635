"""The trace exports parse back and agree with the trace: Perfetto flows, ShiViz vector clocks, the
text timeline, the HTML page's embedded events; and ``python -m twinrpc.simulator trace export``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import _trace_scenarios as scenarios
import pytest
from twinrpc.simulator import Delay, Duplicate, FaultPlan, Simulation, Trace
from twinrpc.simulator._cli import _main as cli


@pytest.fixture(scope="module")
def trace() -> Trace:
    return Simulation(3, seed=2).run(scenarios.rich).trace


def _dominates(later: dict[str, int], earlier: dict[str, int]) -> bool:
    keys = set(later) | set(earlier)
    return all(later.get(k, 0) >= earlier.get(k, 0) for k in keys) and later != earlier


def test_perfetto_has_a_process_per_worker_and_a_flow_from_each_send_to_its_delivery(trace: Trace) -> None:
    doc = json.loads(trace.export("perfetto"))
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "worker0 (rank 0)", 1: "worker1 (rank 1)", 2: "worker2 (rank 2)"}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(trace)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    deliveries = [ev for ev in trace if ev.event == "deliver"]
    assert set(starts) == set(ends) and len(ends) == len(deliveries)
    for flow_id, end in ends.items():
        start = starts[flow_id]
        assert end["bp"] == "e" and start["ts"] <= end["ts"]
        # each flow phase binds to a slice with the same pid, tid and ts: its send, its delivery
        assert any(
            e["name"] == f"send {start['name']}#" + e["name"].split("#")[-1]
            for e in slices
            if (e["pid"], e["tid"], e["ts"]) == (start["pid"], start["tid"], start["ts"])
        )
        assert any(
            e["name"].startswith(f"deliver {end['name']}#")
            for e in slices
            if (e["pid"], e["tid"], e["ts"]) == (end["pid"], end["tid"], end["ts"])
        )
    for e in slices:
        if e["name"].startswith("deliver "):
            seq = e["args"]["message"]["seq"]
            send = next(
                s for s in slices if s["name"].startswith("send ") and s["args"]["message"]["seq"] == seq
            )
            later, earlier = e["args"]["vector_clock"], send["args"]["vector_clock"]
            assert all(a >= b for a, b in zip(later, earlier, strict=True)) and later != earlier
            assert send["ts"] <= e["ts"] and send["pid"] == e["args"]["message"]["src"]


_SHIVIZ_LINE = re.compile(r"(?P<event>.*)\n(?P<host>\S*) (?P<clock>{.*})")


def _parse_shiviz(text: str) -> list[tuple[str, str, dict[str, int]]]:
    lines = text.splitlines()
    regex, delimiter, body = lines[0], lines[1], lines[2:]
    # ShiViz's named groups are JS style: (?<name>...). The same expression in Python's syntax:
    assert regex == r"(?<event>.*)\n(?<host>\S*) (?<clock>{.*})" and delimiter == ""
    out = []
    for m in _SHIVIZ_LINE.finditer("\n".join(body)):
        out.append((m["event"], m["host"], json.loads(m["clock"])))
    return out


def test_shiviz_log_has_consistent_vector_clocks(trace: Trace) -> None:
    entries = _parse_shiviz(trace.export("shiviz"))
    assert len(entries) == len(trace)
    hosts = {"worker0", "worker1", "worker2"}
    seen: dict[str, list[dict[str, int]]] = {h: [] for h in hosts}
    for _event, host, clock in entries:
        assert host in hosts and set(clock) <= hosts
        # ShiViz's rules: a host's own entry counts its events 1, 2, 3...
        assert clock[host] == len(seen[host]) + 1
        # ...and a clock only names events that exist on the other hosts, earlier in the log
        for other, count in clock.items():
            if other != host:
                assert count <= len(seen[other])
        seen[host].append(clock)
    sends = {}
    for event, _host, clock in entries:
        m = re.search(r"#\d+ (send|deliver) (\w+#\d+ \d+->\d+)", event)
        if m and m[1] == "send":
            sends.setdefault(m[2], []).append(clock)
        elif m:
            assert any(_dominates(clock, s) for s in sends[m[2]]), event


def test_trace_text_is_the_text_export_on_a_run_with_rrefs_and_faults() -> None:
    plan = FaultPlan([Delay(0.002, "request", src=0, dst=1, nth=1), Duplicate(1e-3, "rref-control")])
    traced = Simulation(3, seed=5, faults=plan).run(scenarios.rich).trace
    events = {ev.event for ev in traced}
    assert {"rref-user-created", "rref-forked", "fault"} <= events, events
    assert traced.text() == traced.export("text")
    limited = traced.text(10).splitlines()
    assert limited == traced.export("text").splitlines()[:12]  # the header's two lines, then 10 events


def test_text_timeline_lists_every_event_with_its_clock_and_send_time(trace: Trace) -> None:
    text = trace.export("text")
    lines = text.splitlines()
    assert lines[0].startswith("# twinrpc trace: simulator, seed 2, 3 workers (worker0, worker1, worker2)")
    body = lines[2:]
    assert len(body) == len(trace)
    first_delivery = next(line for line in body if " deliver " in line)
    assert "<- sent by worker" in first_delivery and re.search(r"\[\d+, \d+, \d+\]$", first_delivery)


def test_html_is_self_contained_and_embeds_every_event(trace: Trace) -> None:
    page = trace.export("html")
    assert page.startswith("<!DOCTYPE html>")
    # nothing loaded from elsewhere: no external scripts, styles, images or fonts
    assert not re.search(r"""<(script|link|img|iframe)[^>]+(src|href)=""", page)
    assert "@import" not in page and "url(http" not in page
    data = re.search(r'<script id="trace-data" type="application/json">(.*?)</script>', page, re.S)
    assert data is not None
    embedded = json.loads(data[1])
    assert embedded["workers"] == ["worker0", "worker1", "worker2"]
    assert len(embedded["events"]) == len(trace)
    assert [row[2] for row in embedded["events"]] == [ev.event for ev in trace]


def test_html_escapes_text_that_would_close_its_script() -> None:
    hostile = Trace(world_size=1, workers=["w</script><script>alert(1)</script>"])
    hostile.record(0.0, 0, "exit", "</script><!-- & -->")
    page = hostile.export("html")
    assert page.count("</script>") == 2  # the data block's and the program's own
    assert (
        "alert(1)"
        in json.loads(re.search(r'type="application/json">(.*?)</script>', page, re.S)[1])["workers"][0]
    )


def test_export_to_a_file_and_unknown_formats(trace: Trace, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    text = trace.export("perfetto", out)
    assert out.read_text() == text
    with pytest.raises(ValueError, match="unknown trace export format 'svg'; choose one of perfetto, shiviz"):
        trace.export("svg")


def test_cli_exports_a_saved_trace(trace: Trace, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "run.jsonl"
    trace.save(saved)
    for fmt in ("perfetto", "shiviz", "text", "html"):
        out = tmp_path / f"run.{fmt}"
        assert cli.main(["trace", "export", "--format", fmt, str(saved), "-o", str(out)]) == 0
        assert out.read_text() == trace.export(fmt)
    capsys.readouterr()
    assert cli.main(["trace", "export", "-f", "text", str(saved)]) == 0
    assert capsys.readouterr().out == trace.export("text")
    assert cli.main(["trace", "export", "-f", "text", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: no such trace file" in capsys.readouterr().err


def test_python_dash_m_runs_the_trace_command(trace: Trace, tmp_path: Path) -> None:
    saved = tmp_path / "run.jsonl"
    trace.save(saved)
    done = subprocess.run(
        [sys.executable, "-m", "twinrpc.simulator", "trace", "export", "-f", "shiviz", str(saved)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == trace.export("shiviz")
