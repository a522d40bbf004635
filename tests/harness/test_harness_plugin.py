"""Tests of the conformance pytest plugin (tagging, selection, deviations, matrix) through pytester.

Each test builds a miniature suite: a conftest that loads the plugin exactly as conformance/conftest.py
does, a ``spec/`` folder, and test modules; then runs pytest on it in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SPEC = "# Requirements\n### RPC-1: rpc_sync returns the result\n### RPC-7: nested RPC\n"
CONFTEST = "from conformance.harness.plugin import *  # noqa: F403\n"


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """A miniature conformance suite with a spec declaring RPC-1 and RPC-7."""
    pytester.makeconftest(CONFTEST)
    pytester.mkdir("spec")
    (pytester.path / "spec" / "rpc.md").write_text(SPEC, encoding="utf-8")
    return pytester


def deviations(suite: pytest.Pytester, text: str) -> None:
    (suite.path / "spec" / "deviations.toml").write_text(text, encoding="utf-8")


def test_tagged_tests_run(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        """
        import pytest

        @pytest.mark.spec("RPC-1")
        def test_a():
            pass

        @pytest.mark.spec("RPC-1", "RPC-7")
        class TestGroup:
            def test_b(self):
                pass
        """
    )
    suite.runpytest("--strict-markers").assert_outcomes(passed=2)


def test_untagged_test_is_a_collection_error_naming_it(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_mod="""
        import pytest

        @pytest.mark.spec("RPC-1")
        def test_tagged():
            pass

        def test_untagged():
            pass
        """
    )
    result = suite.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_mod.py::test_untagged: no @pytest.mark.spec(...) marker*"])


def test_unknown_spec_id_is_a_collection_error(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        """
        import pytest

        @pytest.mark.spec("RPC-1", "RPC-99")
        def test_a():
            pass
        """
    )
    result = suite.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_a: unknown spec ID 'RPC-99'*"])


def test_without_spec_files_ids_are_not_checked_but_warned_about(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.spec("ANY-1")
        def test_a():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*no requirement headings found in*spec IDs of conformance tests are not checked*"]
    )


def test_tests_outside_the_suite_folder_are_left_alone(suite: pytest.Pytester) -> None:
    suite.mkpydir("suite")
    (suite.path / "suite" / "conftest.py").write_text(CONFTEST, encoding="utf-8")
    (suite.path / "conftest.py").unlink()
    suite.mkpydir("unit")
    (suite.path / "unit" / "test_plain.py").write_text("def test_plain():\n    pass\n", encoding="utf-8")
    (suite.path / "suite" / "test_c.py").write_text(
        "import pytest\n\n@pytest.mark.spec('RPC-1')\ndef test_c():\n    pass\n", encoding="utf-8"
    )
    suite.runpytest("unit", "suite").assert_outcomes(passed=2)


def test_other_backends_tests_are_deselected_not_skipped(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        """
        import pytest

        @pytest.mark.spec("RPC-1")
        @pytest.mark.backends("torch", "gloo")
        def test_real_processes_only():
            '''Needs real processes: it kills one.'''

        @pytest.mark.spec("RPC-1")
        @pytest.mark.backends("sim")
        def test_sim_only():
            '''Needs virtual time.'''
        """
    )
    result = suite.runpytest("--backend", "sim", "-v")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*test_sim_only PASSED*"])


def test_backends_marker_needs_a_docstring_and_known_names(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        """
        import pytest

        @pytest.mark.spec("RPC-1")
        @pytest.mark.backends("sim")
        def test_no_reason():
            pass

        @pytest.mark.spec("RPC-1")
        @pytest.mark.backends("smi")
        def test_typo():
            '''Typo in the backend name.'''
        """
    )
    result = suite.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*test_no_reason: declares @pytest.mark.backends('sim',) but has no docstring saying why*",
            "*test_typo: @pytest.mark.backends('smi',) must name backends from*",
        ]
    )


def test_deviations_become_strict_xfails_on_their_backends_only(suite: pytest.Pytester) -> None:
    deviations(
        suite,
        """
        [[deviation]]
        id = "DEV-1"
        requirement = "RPC-7"
        backends = ["sim"]
        tests = ["test_differs", "test_now_conforms"]
        reason = "twinrpc differs on purpose"
        """.replace("        ", ""),
    )
    suite.makepyfile(
        """
        import pytest

        @pytest.mark.spec("RPC-7")
        @pytest.mark.parametrize("n", [1, 2])
        def test_differs(n):
            assert False

        @pytest.mark.spec("RPC-7")
        def test_now_conforms():
            pass
        """
    )
    result = suite.runpytest("-rxX")
    result.assert_outcomes(xfailed=2, failed=1)
    result.stdout.fnmatch_lines(["*XFAIL*test_differs*DEV-1 (RPC-7): twinrpc differs on purpose*"])
    result.stdout.fnmatch_lines(["*[[]XPASS(strict)[]] DEV-1 (RPC-7)*"])


def test_deviation_naming_a_missing_test_is_an_error(suite: pytest.Pytester) -> None:
    deviations(
        suite,
        '[[deviation]]\nid = "DEV-1"\nrequirement = "RPC-7"\nbackends = ["torch"]\n'
        'tests = ["test_renamed_away"]\nreason = "r"\n',
    )
    suite.makepyfile("import pytest\n\n@pytest.mark.spec('RPC-7')\ndef test_other():\n    pass\n")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*deviation DEV-1: names test 'test_renamed_away', but no such test exists*"]
    )


def test_a_backend_that_declares_itself_unavailable_refuses_to_start(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        notyet=(
            "from conformance.harness import Backend\n\n"
            "class NotYet(Backend):\n"
            "    name = 'notyet'\n"
            "    unavailable = 'this world arrives later'\n"
        )
    )
    suite.makepyfile("import pytest\n\n@pytest.mark.spec('RPC-1')\ndef test_a():\n    pass\n")
    result = suite.runpytest("--backend", "notyet:NotYet")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*this world arrives later*"])


def test_unknown_backend_is_a_usage_error(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINRPC_BACKEND", "carrier-pigeon")
    suite.makepyfile("import pytest\n\n@pytest.mark.spec('RPC-1')\ndef test_a():\n    pass\n")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown backend 'carrier-pigeon'*"])


def test_matrix_json_records_spec_ids_backend_and_outcome(suite: pytest.Pytester) -> None:
    deviations(
        suite,
        '[[deviation]]\nid = "DEV-1"\nrequirement = "RPC-7"\nbackends = ["sim"]\n'
        'tests = ["test_deviates"]\nreason = "r"\n',
    )
    suite.makepyfile(
        test_m="""
        import pytest

        @pytest.mark.spec("RPC-1")
        def test_ok():
            pass

        @pytest.mark.spec("RPC-1", "RPC-7")
        def test_broken():
            assert False

        @pytest.mark.spec("RPC-7")
        def test_deviates():
            assert False

        @pytest.mark.spec("RPC-7")
        @pytest.mark.backends("torch")
        def test_torch_only():
            '''Real processes only.'''
        """
    )
    suite.runpytest("--matrix-json", "out/matrix.json")
    matrix = json.loads((suite.path / "out" / "matrix.json").read_text())
    assert matrix["backend"] == "sim"
    rows = {t["test"]: t for t in matrix["tests"]}
    assert {name: (row["spec"], row["backend"], row["outcome"]) for name, row in rows.items()} == {
        "test_ok": (["RPC-1"], "sim", "passed"),
        "test_broken": (["RPC-1", "RPC-7"], "sim", "failed"),
        "test_deviates": (["RPC-7"], "sim", "xfailed"),
        "test_torch_only": (["RPC-7"], "sim", "not applicable"),
    }
    assert rows["test_deviates"]["deviation"] == "DEV-1"


def test_matrix_json_under_xdist_includes_deselected_tests(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    suite.makepyfile(
        """
        import pytest

        @pytest.mark.spec("RPC-1")
        def test_ok():
            pass

        @pytest.mark.spec("RPC-1")
        @pytest.mark.backends("torch")
        def test_torch_only():
            '''Real processes only.'''
        """
    )
    suite.runpytest_subprocess("-n", "2", "--matrix-json", "matrix.json", "-p", "no:cacheprovider")
    rows = {t["test"]: t["outcome"] for t in json.loads((suite.path / "matrix.json").read_text())["tests"]}
    assert rows == {"test_ok": "passed", "test_torch_only": "not applicable"}


def test_world_runs_programs_on_the_simulator(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_sim_world="""
        import pytest

        def whoami(ctx, suffix):
            return ctx.backend, ctx.rank, ctx.world_size, ctx.name(ctx.rank) + suffix

        def fails_on_one(ctx):
            if ctx.rank == 1:
                raise KeyError("rank one")
            return ctx.rank

        @pytest.mark.spec("RPC-1")
        def test_run(world):
            assert world.backend == "sim"
            assert world.run(whoami, "!", world_size=3) == [("sim", r, 3, f"worker{r}!") for r in range(3)]
            assert world.run(whoami, "?", ranks=[1]) == [None, ("sim", 1, 2, "worker1?")]
            assert world.run_on(0, whoami, "") == ("sim", 0, 2, "worker0")

        @pytest.mark.spec("RPC-1")
        def test_error_keeps_its_type(world):
            with pytest.raises(KeyError, match="rank one"):
                world.run(fails_on_one)

        @pytest.mark.spec("RPC-1")
        def test_local_functions_are_refused_on_every_backend(world):
            def local(ctx):
                return 1
            with pytest.raises(pytest.fail.Exception, match="module-level functions"):
                world.run(local)
        """
    )
    Path(suite.path / "spec").mkdir(exist_ok=True)
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=3)
