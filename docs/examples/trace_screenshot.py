"""Render a trace's HTML space-time diagram in headless Chromium and save it as a PNG.

The race tutorial's figure was made with::

    python docs/examples/trace_screenshot.py race.html docs/tutorials/ps-race-diagram.png \\
        --window 240 330 --select 44 --hide rref

It uses Debian's ``chromium`` (``$TWINRPC_CHROMIUM``, default ``/usr/bin/chromium``) through Playwright
(the test extra), with a fresh profile and nothing that reaches for the network. Exit status 1 when
the page logs a console error.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

#: headless, and nothing that reaches for the network
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def screenshot(
    html: Path,
    png: Path,
    *,
    window: tuple[int, int] | None = None,
    select: int | None = None,
    hide: tuple[str, ...] = (),
    size: tuple[int, int] = (1400, 560),
) -> list[str]:
    """Save ``html``'s diagram to ``png``: events ``window`` (first, last) shown, the arrow of message
    number ``select`` clicked (its details on the right), the categories ``hide`` unchecked. Returns
    the console errors."""
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("TWINRPC_CHROMIUM", "/usr/bin/chromium")
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile,
            executable_path=chromium,
            headless=True,
            args=FLAGS,
            viewport={"width": size[0], "height": size[1]},
        )
        try:
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(html.resolve().as_uri())
            page.wait_for_selector("line.lane", state="attached", timeout=30_000)
            for category in hide:
                page.locator(f"#show-{category}").uncheck()
            if window is not None:
                page.fill("#win-from", str(window[0]))
                page.fill("#win-to", str(window[1]))
                page.locator("#win-apply").click()
            if select is not None:
                # dispatched on the arrow itself: a click at its midpoint can land on an event drawn there
                page.locator(f"line.msg-hit[data-seq='{select}']").first.dispatch_event("click")
            page.screenshot(path=str(png))
        finally:
            context.close()
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path, help="a diagram from `trace export --format html`")
    parser.add_argument("png", type=Path)
    parser.add_argument("--window", type=int, nargs=2, metavar=("FIRST", "LAST"), help="event numbers")
    parser.add_argument("--select", type=int, metavar="SEQ", help="click this message number's arrow")
    parser.add_argument("--hide", action="append", default=[], help="rref, autograd, lifecycle, messages")
    args = parser.parse_args(argv)
    errors = screenshot(args.html, args.png, window=args.window, select=args.select, hide=tuple(args.hide))
    for error in errors:
        print(f"console error: {error}", file=sys.stderr)
    print(f"wrote {args.png} ({args.png.stat().st_size // 1024} KB)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
