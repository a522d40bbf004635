"""Unit tests of the harness's spec reading (conformance/harness/spec.py): no pytest plugin involved."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness.spec import (
    Deviation,
    SpecError,
    find_test_definitions,
    load_deviations,
    parse_requirement_ids,
    validate_deviations,
)

DEVIATION = """
[[deviation]]
id = "DEV-1"
requirement = "RPC-7"
backends = ["torch"]
tests = ["test_nested"]
reason = "because"
"""


def test_requirement_ids_come_from_level_three_headings_only(tmp_path: Path) -> None:
    (tmp_path / "rpc.md").write_text(
        "# RPC\n### RPC-1: rpc_sync returns the result\ntext ### RPC-99: not a heading\n"
        "## RPC-2: wrong level\n### RREF-F1: fork\n### bad heading\n",
        encoding="utf-8",
    )
    (tmp_path / "notes.txt").write_text("### RPC-3: not markdown\n", encoding="utf-8")
    assert parse_requirement_ids(tmp_path) == {"RPC-1": "rpc_sync returns the result", "RREF-F1": "fork"}


def test_missing_spec_folder_yields_no_ids(tmp_path: Path) -> None:
    assert parse_requirement_ids(tmp_path / "absent") == {}


def test_deviations_parse_into_frozen_records(tmp_path: Path) -> None:
    path = tmp_path / "deviations.toml"
    path.write_text(DEVIATION, encoding="utf-8")
    (dev,) = load_deviations(path)
    assert dev == Deviation("DEV-1", "RPC-7", ("torch",), ("test_nested",), "because")
    assert dev.applies_to("test_nested", "torch")
    assert not dev.applies_to("test_nested", "sim")


def test_missing_deviations_file_means_no_deviations(tmp_path: Path) -> None:
    assert load_deviations(tmp_path / "deviations.toml") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (DEVIATION.replace("tests =", "test ="), "unknown keys \\['test'\\]"),
        (DEVIATION.replace('reason = "because"', ""), "'reason' must be a non-empty string"),
        (DEVIATION.replace('["torch"]', "[]"), "'backends' must be a non-empty list"),
        (DEVIATION + DEVIATION, "DEV-1: duplicate id"),
        ("[[deviation]\n", "not valid TOML"),
        ('[deviations]\nid = "x"\n', "unknown top-level keys"),
    ],
)
def test_malformed_deviations_are_rejected_with_the_reason(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "deviations.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError, match=message):
        load_deviations(path)


def test_test_definitions_are_found_in_test_modules_only(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_a.py").write_text(
        "def test_one():\n    pass\nasync def test_two(x):\n    pass\n"
    )
    (tmp_path / "helpers.py").write_text("def test_not_a_test_module():\n    pass\n")
    assert find_test_definitions([tmp_path]) == {"test_one", "test_two"}


def test_deviation_problems_name_unknown_requirements_and_tests() -> None:
    dev = Deviation("DEV-1", "RPC-7", ("torch",), ("test_nested", "test_gone"), "because")
    problems = validate_deviations([dev], known_ids={"RPC-1": "x"}, known_tests={"test_nested"})
    assert problems == [
        "deviation DEV-1: requirement 'RPC-7' is not a heading in spec/*.md",
        "deviation DEV-1: names test 'test_gone', but no such test exists in the suite",
    ]
    # Without a spec yet, only the tests are checked.
    assert len(validate_deviations([dev], known_ids={}, known_tests={"test_nested"})) == 1


def test_validation_checks_the_backends_a_file_may_name() -> None:
    dev = Deviation("MINE-1", "RPC-7", ("mine", "torch"), ("test_nested",), "because")
    known = {"known_ids": {"RPC-7": "nested"}, "known_tests": {"test_nested"}}
    assert validate_deviations([dev], **known) == []  # type: ignore[arg-type]
    assert validate_deviations([dev], known_backends={"mine"}, **known) == [  # type: ignore[arg-type]
        "deviation MINE-1: names backend 'torch'; this file may name only ['mine']"
    ]
