"""``diff_traces`` and ``trace diff`` point at the first divergence of two traces."""

from __future__ import annotations

from pathlib import Path

import _trace_scenarios as scenarios
import pytest
from twinrpc.simulator import Divergence, Simulation, Trace, diff_traces
from twinrpc.simulator._cli import _main as cli


def _trace(seed: int, calls: int = 3) -> Trace:
    return Simulation(2, seed=seed).run(scenarios.rpc_calls, 2, calls).trace


def test_identical_runs_have_no_divergence() -> None:
    assert diff_traces(_trace(4), _trace(4)) is None


def test_two_seeds_diverge_at_the_first_differing_event_with_context() -> None:
    a, b = _trace(4), _trace(5)
    div = diff_traces(a, b, context=2)
    assert isinstance(div, Divergence)
    ea, eb = a.events(), b.events()
    i = div.index
    # everything before the divergence is the same, the event at it is not
    assert [e.line() for e in ea[:i]] == [e.line() for e in eb[:i]]
    assert div.a == ea[i] and div.b == eb[i] and div.a.line() != div.b.line()
    assert div.time == ea[i].time and div.worker == ea[i].worker
    assert div.context_a == tuple(ea[max(0, i - 2) : i + 3])
    assert div.context_b == tuple(eb[max(0, i - 2) : i + 3])
    text = div.describe()
    assert f"traces diverge at event #{i}" in text
    assert f"  A: #{i} {ea[i].line()}" in text and f"  B: #{i} {eb[i].line()}" in text
    assert f"  > #{i:<6} {ea[i].line()}" in text


def test_a_trace_that_ends_early_diverges_where_it_ends() -> None:
    longer = _trace(4)
    shorter = Trace(seed=4, world_size=2, workers=list(longer.workers))
    for ev in longer.events()[:10]:
        shorter.record(ev.time, ev.worker, ev.event, ev.detail)
    div = diff_traces(shorter, longer)
    assert div is not None and div.index == 10 and div.a is None and div.b == longer.events()[10]
    assert "(no event: trace A ended)" in div.describe()


def test_structural_mode_ignores_times_and_compares_each_workers_messages() -> None:
    a, b = _trace(4), _trace(5)  # other seed: other times, same messages per worker
    assert diff_traces(a, b) is not None
    assert diff_traces(a, b, structural=True) is None
    more = _trace(4, calls=4)
    div = diff_traces(a, more, structural=True, kinds={"CALL", "RESPONSE"})
    assert div is not None and div.structural
    assert div.worker == 0 and div.a is None  # worker0's fourth call exists only in B
    assert div.b is not None and div.b.event == "send" and div.b.detail.startswith("CALL#3 0->1")
    assert div.index == 6  # 3 x (send CALL, deliver RESPONSE) before it
    assert "position 6 of worker 0's sends and deliveries" in div.describe()


def test_bad_arguments_are_refused() -> None:
    a = _trace(4)
    with pytest.raises(ValueError, match="context must be >= 0"):
        diff_traces(a, a, context=-1)
    with pytest.raises(ValueError, match="pass structural=True"):
        diff_traces(a, a, kinds={"CALL"})


def test_cli_diff_exit_status_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = {}
    for name, seed in (("a", 4), ("a2", 4), ("b", 5)):
        paths[name] = str(tmp_path / f"{name}.jsonl")
        _trace(seed).save(paths[name])
    assert cli.main(["trace", "diff", paths["a"], paths["a2"]]) == 0
    assert "identical" in capsys.readouterr().out
    assert cli.main(["trace", "diff", paths["a"], paths["b"]]) == 1
    out = capsys.readouterr().out
    assert "traces diverge at event #" in out and f"A ({paths['a']})" in out
    assert (
        cli.main(["trace", "diff", "--structural", "--kinds", "call,response", paths["a"], paths["b"]]) == 0
    )
    capsys.readouterr()
    assert cli.main(["trace", "diff", "--kinds", "CALL", paths["a"], paths["b"]]) == 2
    assert "add --structural" in capsys.readouterr().err
    assert cli.main(["trace", "diff", "--structural", "--kinds", "CALLS", paths["a"], paths["b"]]) == 2
    assert "unknown message kind(s) CALLS" in capsys.readouterr().err
