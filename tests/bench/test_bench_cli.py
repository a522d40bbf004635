"""Every benchmark's ``--help`` shows each option's default (benchmarks/_cli.py)."""

from __future__ import annotations

import sys

from _launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import _cli

SCRIPTS = sorted([*ROOT.glob("benchmarks/bench_*.py"), ROOT / "benchmarks" / "render_results.py"])


def test_an_option_shows_its_default_with_or_without_help_text() -> None:
    parser = _cli.parser("A benchmark.\n\nMore text.")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="where to write the figures")
    parser.add_argument("--quick", action="store_true")
    text = parser.format_help()
    assert "A benchmark." in text and "More text" not in text
    assert "--rounds ROUNDS  (default: 5)" in text
    assert "where to write the figures (default: None)" in text
    assert "--quick          (default: False)" in text


def test_every_benchmark_builds_its_command_line_with_the_shared_parser() -> None:
    assert len(SCRIPTS) >= 10
    for script in SCRIPTS:
        source = script.read_text()
        assert "_cli.parser(__doc__)" in source and "argparse.ArgumentParser(" not in source, script.name
