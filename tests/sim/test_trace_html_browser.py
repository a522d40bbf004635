"""The HTML space-time diagram in a real browser: headless Chromium (Debian's ``chromium`` package)
driven by Playwright. It must draw one lane per worker and an arrow per message, show details on a
click, zoom, and log no console errors, all from the file alone (no network).

``nox -s browser`` (and ``nox -s tests``) installs chromium when it is missing; run by hand this test
fails, with the command to run, when there is no Chromium at ``$TWINRPC_CHROMIUM`` (default
``/usr/bin/chromium``).
"""

from __future__ import annotations

import os
import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _trace_scenarios as scenarios
import pytest
from twinrpc.simulator import Simulation, Trace

CHROMIUM = Path(os.environ.get("TWINRPC_CHROMIUM", "/usr/bin/chromium"))
#: headless, and nothing that reaches for the network (this machine has none): the flags of the docs'
#: screenshot script, which renders the race tutorial's diagram the same way
FLAGS: list[str] = runpy.run_path(
    str(Path(__file__).resolve().parents[2] / "docs/examples/trace_screenshot.py")
)["FLAGS"]


class Page:
    """A page with its console errors and the URLs it requested."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.errors: list[str] = []
        self.requests: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("request", lambda r: self.requests.append(r.url))

    def open(self, path: Path) -> None:
        self.page.goto(path.as_uri())
        self.page.wait_for_selector("line.lane", state="attached", timeout=30_000)

    def count(self, selector: str) -> int:
        return int(self.page.locator(selector).count())

    def details(self) -> str:
        return str(self.page.locator("#details").inner_text())


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: install Debian's package (apt-get install -y chromium) or run "
            "`nox -s browser`, which installs it; TWINRPC_CHROMIUM=/path/to/chromium names another binary"
        )
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh --user-data-dir
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=str(CHROMIUM),
            headless=True,
            args=FLAGS,
            viewport={"width": 1400, "height": 700},
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = browser.new_page()
    try:
        yield Page(p)
    finally:
        p.close()


def _arrows_expected(trace: Trace) -> int:
    ends = [
        ev for ev in trace if ev.event in ("deliver", "lost", "bounce", "drop") and ev.message is not None
    ]
    finished = {ev.message.seq for ev in ends}
    in_flight = [ev for ev in trace if ev.event == "send" and ev.message.seq not in finished]
    return len(ends) + len(in_flight)


def test_the_diagram_draws_lanes_and_arrows_and_shows_details_on_click(page: Page, tmp_path: Path) -> None:
    trace = Simulation(3, seed=2).run(scenarios.rich).trace
    html = tmp_path / "rich.html"
    trace.export("html", html)
    page.open(html)
    assert page.count("line.lane[data-rank]") == 3
    labels = page.page.locator(".lane-label").all_text_contents()
    assert labels == ["worker0", "worker1", "worker2"]
    assert page.count("line.msg") == _arrows_expected(trace) > 20
    legend = page.page.locator("#legend").inner_text()
    for kind in ("CALL", "REMOTE_CALL", "RESPONSE", "GRADIENT"):
        assert kind in legend
    # arrows are coloured by kind: all CALL arrows share one colour, other kinds another
    colours = page.page.eval_on_selector_all(
        "line.msg", "ls => ls.map(l => [l.getAttribute('data-kind'), l.getAttribute('stroke')])"
    )
    by_kind: dict[str, set[str]] = {}
    for kind, colour in colours:
        by_kind.setdefault(kind, set()).add(colour)
    assert all(len(c) == 1 for c in by_kind.values()) and by_kind["CALL"] != by_kind["RESPONSE"]

    page.page.locator("line.msg-hit[data-seq]").first.click(force=True)
    details = page.details()
    assert details.startswith("Message ") and "from: worker" in details and "latency:" in details
    assert page.count("line.msg.sel") == 1

    page.page.locator("circle.event").nth(3).click(force=True)
    details = page.details()
    assert details.startswith("Event ") and "vector clock: {worker0:" in details
    assert page.count(".event.sel") == 1 and page.count(".event.past") + page.count(".event.future") > 0

    shown = page.count("line.msg")
    for _ in range(4):
        page.page.locator("#zoom-in").click()
    assert 0 < page.count("line.msg") < shown  # zoomed in: only what is in the window is drawn
    page.page.locator("#fit").click()
    assert page.count("line.msg") == shown
    page.page.select_option("#axis", "time")
    assert page.count("line.msg") == shown
    page.page.locator("#show-tasks").check()
    assert page.count("rect.ev.switch") == len([ev for ev in trace if ev.event == "switch"])

    assert page.errors == []
    assert page.requests == [html.as_uri()]  # self-contained: nothing else was fetched


def test_crashes_and_lost_messages_are_marked(page: Page, tmp_path: Path) -> None:
    def program(rank: int) -> None:
        scenarios.rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        if rank == 0:
            scenarios.rpc.rpc_sync("worker1", scenarios.add1, args=(scenarios.torch.ones(1),))  # the link
            sim.crash(1, at=sim.now + 20e-6)
            fut = scenarios.rpc.rpc_async("worker1", scenarios.add1, args=(scenarios.torch.ones(1),))
            with pytest.raises(RuntimeError):
                fut.wait()
        scenarios.sleep(1.0)

    sim = Simulation(2, seed=1)
    trace = sim.run(program).trace
    html = tmp_path / "crash.html"
    trace.export("html", html)
    page.open(html)
    assert page.count("circle.ev.crash") == 1
    assert page.count("line.lane.dead") == 1
    assert page.count("line.marker-x") >= 4  # the crash's cross and the lost message's
    assert page.errors == []


def test_a_few_thousand_events_stay_navigable(page: Page, tmp_path: Path) -> None:
    trace = Simulation(2, seed=0).run(scenarios.rpc_calls, 2, 500).trace
    assert len(trace) > 3000
    html = tmp_path / "big.html"
    trace.export("html", html)
    page.open(html)
    assert page.count("line.msg") == _arrows_expected(trace)
    page.page.fill("#win-from", "100")
    page.page.fill("#win-to", "160")
    page.page.locator("#win-apply").click()
    status = page.page.locator("#status").inner_text()
    assert 0 < page.count("circle.event") < 120, status
    page.page.fill("#find", "CALL#7 ")
    assert page.count(".event.found") == 0  # outside the window
    page.page.locator("#fit").click()
    assert page.count(".event.found") == 2  # the send and the delivery of CALL#7
    assert page.errors == []
