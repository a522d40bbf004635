"""The benchmarks' command lines: every option's ``--help`` line shows its default."""

from __future__ import annotations

import argparse


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """argparse shows a default only beside help text; an option without any gets the default alone."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and action.default is not argparse.SUPPRESS:
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser described by the first line of the benchmark's docstring."""
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0], formatter_class=_DefaultsShown)
