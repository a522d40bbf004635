"""The benchmark results page: figures as the benchmarks write them, and the page rendered from them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _results  # noqa: E402
import render_results  # noqa: E402


def _doc(figures: list[dict[str, object]], name: str = "bench_gloo") -> dict[str, object]:
    return _results.document(
        name,
        f"{name} title",
        f"python benchmarks/{name}.py --rounds 3",
        figures,
        rounds=3,
        machine_info={"cpus": 2, "cpu": "a CPU", "system": "Linux", "python": "3.11", "torch": "2.x"},
    )


def test_a_figures_ratio_is_the_median_of_its_rounds_and_is_judged_against_its_target() -> None:
    f = _results.figure(
        "udf", "tiny UDF", "us", False, {"twinrpc": 300.0, "tensorpipe": 200.0}, [1.4, 1.6, 1.5], ("<=", 1.5)
    )
    assert f["ratio"] == 1.5 and f["met"] is True
    assert (f["system"], f["against"]) == ("twinrpc", "tensorpipe")
    slow = _results.figure(
        "bw", "64 MiB", "GB/s", True, {"twinrpc": 1.0, "gloo": 2.0}, [0.4, 0.5, 0.6], (">=", 0.9)
    )
    assert slow["met"] is False
    assert _results.figure("x", "x", "us", False, {"a": 1.0, "b": 1.0}, [1.0], None)["met"] is None


def test_the_page_lists_each_figure_with_its_target_ratio_machine_date_and_command(tmp_path: Path) -> None:
    met = _results.figure(
        "udf", "tiny UDF latency", "us", False, {"twinrpc": 3.0, "tensorpipe": 2.0}, [1.4, 1.6], ("<=", 1.5)
    )
    missed = _results.figure(
        "bw 64 MiB",
        "identity round trip of 64 MiB",
        "GB/s",
        True,
        {"twinrpc": 1.0, "gloo": 2.0},
        [0.5],
        (">=", 0.9),
    )
    (tmp_path / "a.json").write_text(json.dumps(_doc([met])))
    (tmp_path / "b.json").write_text(json.dumps(_doc([missed], "bench_two_hosts")))
    page = render_results.render(render_results.load(tmp_path))
    assert "| one host | tiny UDF latency | TensorPipe | 1.50 (1.40-1.60) | ≤ 1.5 | met |" in page
    assert "| two hosts | identity round trip of 64 MiB | raw gloo | 0.50 | ≥ 0.9 | **missed** |" in page
    assert "`python benchmarks/bench_two_hosts.py --rounds 3`" in page
    assert "Machine: 2 CPUs (a CPU), Linux, Python 3.11, torch 2.x." in page
    assert page.index("## bench_gloo title") < page.index("## bench_two_hosts title")  # the page's order
    assert "```{" not in page and "```python" not in page


def test_a_figure_of_other_systems_than_the_table_s_names_its_own_and_sim_scale_runs_get_a_table(
    tmp_path: Path,
) -> None:
    rate = _results.figure(
        "rate", "rate", "messages/s", True, {"2,048 workers": 9.0, "256 workers": 10.0}, [0.9], (">=", 0.9)
    )
    memory = _results.figure(
        "memory", "peak RSS", "MB", False, {"8,192 workers": 2048.0, "limit": 4096.0}, [0.5], ("<=", 1.0)
    )
    doc = _doc([rate, memory], "bench_sim_scale")
    doc["extra"] = {
        "sim_scale": [
            {
                "workers": 256,
                "messages": 1000,
                "events": 1450,
                "messages_per_s": 10.0,
                "rss_mb": 300.0,
                "rss_mb_trace_on": 310.0,
            },
            {
                "workers": 8192,
                "messages": 4000,
                "events": 5800,
                "messages_per_s": 8.0,
                "rss_mb_trace_on": 2048.0,
            },
        ]
    }
    (tmp_path / "a.json").write_text(json.dumps(doc))
    page = render_results.render(render_results.load(tmp_path))
    assert "| rate | messages/s, higher is better | 9.00 | 10.0 | 0.90 | ≥ 0.9 | met |" in page
    assert (
        "| peak RSS | MB, lower is better | 8,192 workers: 2,048 | limit: 4,096 | 0.50 | ≤ 1.0 | met |"
        in page
    )
    assert "| 256 | 1,000 | 1.450 | 10.0 | 300 | 310 |" in page
    assert "| 8,192 | 4,000 | 1.450 | 8.00 | - | 2,048 |" in page


def test_check_fails_when_the_page_is_not_what_the_results_render_to(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(_doc([])))
    page = tmp_path / "page.md"
    assert render_results.main(["--results", str(tmp_path), "--out", str(page)]) == 0
    assert render_results.main(["--results", str(tmp_path), "--out", str(page), "--check"]) == 0
    page.write_text(page.read_text() + "edited by hand\n")
    assert render_results.main(["--results", str(tmp_path), "--out", str(page), "--check"]) == 1


def test_the_committed_results_page_is_what_the_committed_results_render_to() -> None:
    assert list(render_results.RESULTS.glob("*.json")), "benchmarks/results/ holds no results"
    assert render_results.main(["--check"]) == 0, "run python benchmarks/render_results.py"


@pytest.mark.parametrize("name", ["bench_gloo", "bench_dist_autograd", "bench_two_hosts", "bench_explore"])
def test_the_committed_results_of_each_comparison_carry_every_figure_with_a_target(name: str) -> None:
    doc = json.loads((render_results.RESULTS / f"{name}.json").read_text())
    assert doc["figures"] and all(f["ratio"] > 0 for f in doc["figures"])
    keys = {f["key"] for f in doc["figures"] if f["target"]}
    expected = {
        "bench_gloo": {
            "builtin",
            "udf",
            "udf plain",
            "remote",
            "throughput",
            "throughput builtin",
            "bw 16 MiB",
            "bw 64 MiB",
        },
        "bench_dist_autograd": {"step", "iteration"},
        "bench_two_hosts": {"bw 16 MiB", "bw 64 MiB", "bw 16 MiB keyed", "bw 64 MiB keyed"},
        # one figure per job count measured above 1
        "bench_explore": {f"jobs {e['jobs']}" for e in doc["extra"].get("explore", []) if e["jobs"] > 1},
    }[name]
    assert keys == expected
