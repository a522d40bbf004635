"""Reproduction one copy-paste away: the replay command a failure prints, and the regression test
:meth:`Failure.to_pytest` writes."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import pprint
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._simulation import RunResult
from ._case import Case
from ._signature import _faults_text, _head

if TYPE_CHECKING:
    from ._failure import Failure

    pass


def importable_name(obj: Any) -> str | None:
    """``"package.module:qualname"`` when ``obj`` can be imported by that name from another process
    (a module-level function or class of an importable module), else ``None``."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module == "__main__":
        module = _main_module_name()
    if not module or not qualname or "<" in qualname:
        return None
    if getattr(obj, "__module__", None) == "__main__":
        return f"{module}:{qualname}"  # found by its file: importing it would run the script again
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is obj else None


def _main_module_name() -> str | None:
    """The name under which the running script (``__main__``) imports, if it does: its file's stem,
    when that name finds that very file on ``sys.path``."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main_file or not main_file.endswith(".py"):
        return None
    name = os.path.splitext(os.path.basename(main_file))[0]
    if not name.isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not os.path.samefile(spec.origin, main_file):
        return None
    return str(name)


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=False)


def replay_command(
    program: Callable[..., Any],
    world_size: int,
    case: Case,
    *,
    args: Sequence[Any] = (),
    check: Callable[[RunResult], object] | None = None,
) -> str:
    """One line that replays ``case``: ``python -m twinrpc.simulator replay module:function ...`` for
    a program importable by name, else the :func:`replay` call to make where the program lives."""
    target = importable_name(program)
    if getattr(program, "__module__", None) == "__main__":
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        qualname = getattr(program, "__qualname__", "")
        target = None
        if main_file and "<" not in qualname:
            target = f"{os.path.relpath(main_file)}:{qualname}"
    check_name = None if check is None else importable_name(check)
    if target is not None and (check is None or check_name is not None) and _is_json(list(args)):
        parts = [
            "python -m twinrpc.simulator replay",
            shlex.quote(target),
            f"--world-size {world_size}",
            f"--seed {case.seed}",
            f"--faults {shlex.quote(_json(case.faults.to_dict()))}",
        ]
        if case.network is not None:
            parts.append(f"--network {shlex.quote(_json(case.network.to_dict()))}")
        if case.compute is not None:
            parts.append(f"--compute {shlex.quote(_json(case.compute.to_dict()))}")
        if args:
            parts.append(f"--args {shlex.quote(_json(list(args)))}")
        if check_name is not None:
            parts.append(f"--check {shlex.quote(check_name)}")
        return " ".join(parts)
    name = getattr(program, "__qualname__", "program")
    call = f"replay({name}, {world_size}, seed={case.seed}, faults={_json(case.faults.to_dict())}"
    if case.network is not None:
        call += f", network={case.network.to_dict()!r}"
    if case.compute is not None:
        call += f", compute={case.compute.to_dict()!r}"
    if args:
        call += f", args={tuple(args)!r}"
    if check is not None:
        call += f", check={getattr(check, '__qualname__', 'check')}"
    return "twinrpc.simulator." + call + ")"


def _is_json(value: Any) -> bool:
    try:
        return bool(json.loads(json.dumps(value)) == value)
    except (TypeError, ValueError):
        return False


def _is_literal(value: Any) -> bool:
    """Whether ``repr(value)`` reads back as an equal value (so an exported test can write it)."""
    try:
        return bool(ast.literal_eval(repr(value)) == value)
    except (ValueError, SyntaxError):
        return False


def _import_line(name: str, alias: str) -> str:
    module, _, qualname = name.partition(":")
    top, _, rest = qualname.partition(".")
    if rest:
        return f"from {module} import {top} as _{alias}_owner\n{alias} = _{alias}_owner.{rest}"
    return f"from {module} import {top} as {alias}" if top != alias else f"from {module} import {top}"


def exception_reference(type_name: str) -> tuple[str | None, str]:
    """(import line or None, expression) naming an exception type by its qualified name, or
    (None, "") when it cannot be imported."""
    module, _, qualname = type_name.rpartition(".")
    if module == "builtins":
        return None, qualname
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError):
        return None, ""
    if "." in qualname:
        return None, ""
    return f"from {module} import {qualname}", qualname


def raises_block(type_name: str, pattern: str, indent: str, body: list[str]) -> tuple[list[str], list[str]]:
    """(imports, lines) of a ``pytest.raises`` block asserting the known failure around ``body``."""
    imports: list[str] = []
    line, expr = exception_reference(type_name)
    if line is not None:
        imports.append(line)
    lines = []
    if expr:
        lines.append(f"{indent}with pytest.raises({expr}, match=PATTERN):")
        lines.extend(f"{indent}    {b}" for b in body)
    else:
        lines.append(f"{indent}with pytest.raises(BaseException, match=PATTERN) as info:")
        lines.extend(f"{indent}    {b}" for b in body)
        module, _, qualname = type_name.rpartition(".")
        lines.append(
            f"{indent}assert (type(info.value).__module__, type(info.value).__qualname__) == "
            f"({module!r}, {qualname!r})"
        )
    return imports, lines


def regression_header(failure: Failure) -> list[str]:
    """The docstring lines of an exported regression test: what failed, and how it was found."""
    message = _head(str(failure.minimal_error)).replace("\n", " ")[:200]
    return [
        '"""Regression test exported by twinrpc.simulator (explore, then shrink).',
        "",
        f"Found by run {failure.runs}, shrunk in {failure.shrink_runs} more runs to seed {failure.seed} and "
        f"{_faults_text(len(failure.faults))}:",
        f"{failure.faults.describe()}",
        "",
        f"It failed with {failure.exception_type}: {message}",
        '"""',
    ]


def export_test(failure: Failure, name: str, expect: str) -> str:
    program = failure.program
    target = None if program is None else importable_name(program)
    if target is None:
        raise ValueError(
            f"to_pytest: the program {program!r} cannot be imported by name from a test module; "
            "define it at module level in an importable module (not __main__, not a lambda)"
        )
    check_name = None
    if failure.check is not None:
        check_name = importable_name(failure.check)
        if check_name is None:
            raise ValueError(
                f"to_pytest: check={failure.check!r} cannot be imported by name; define it at module level"
            )
    if not _is_literal(failure.program_args):
        raise ValueError(f"to_pytest: args={failure.program_args!r} are not Python literals")
    models = [
        name
        for name, model in (("ComputeModel", failure.compute), ("NetworkModel", failure.network))
        if model is not None
    ]
    imports = [f"from twinrpc.simulator import {', '.join([*models, 'replay'])}"]
    imports.append(_import_line(target, "program"))
    if check_name is not None:
        imports.append(_import_line(check_name, "check"))
    compute_arg = "compute=COMPUTE, " if failure.compute is not None else ""
    call = (
        f"replay(program, {failure.world_size}, seed=SEED, faults=FAULTS, network=NETWORK, "
        f"{compute_arg}args=ARGS{', check=check' if check_name else ''})"
    )
    if expect == "pass":
        doc = "The run that failed now passes."
        body = [f"    {call}"]
    else:
        doc = "The run still fails the known way (remove this test, or switch it to passing, once fixed)."
        more, body = raises_block(failure.exception_type, failure.pattern, "    ", [call])
        imports = ["import pytest", *imports, *more]
    network = "None" if failure.network is None else repr(failure.network)
    lines = [
        *regression_header(failure),
        "",
        "from __future__ import annotations",
        "",
        *imports,
        "",
        f"SEED = {failure.seed}",
        "FAULTS = " + pprint.pformat(failure.faults.to_dict(), width=100, sort_dicts=False),
        f"NETWORK = {network}",
        *([f"COMPUTE = {failure.compute!r}"] if failure.compute is not None else []),
        f"ARGS = {failure.program_args!r}",
        f"PATTERN = {failure.pattern!r}",
        "",
        "",
        f"def {name}() -> None:",
        f'    """{doc}"""',
        *body,
        "",
    ]
    return "\n".join(lines)
