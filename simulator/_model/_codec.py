"""The file forms of the simulator's plain data: one reader and one writer per format (dicts,
JSON and TOML files), checked against a dataclass's fields. Every model's ``to_dict``/``from_dict``/
``load``/``dump`` (``simulator/_model/``) goes through them.

The dict form is what :meth:`FaultPlan.to_dict` returns and what a file holds::

    gc_delay = 0.001                 # optional
    actions = [{type = "delay", extra = 0.5}, {type = "drop", kind = "rref-control"}]

    [[faults]]
    type = "drop"                    # delay, drop, duplicate, hold, partition, crash, pause
    kind = "response"
    src = 1
    dst = 0
    nth = 3

A swarm file holds one ``[swarm]`` table of :class:`~twinrpc.simulator.Swarm`'s fields; a network file
holds :class:`~twinrpc.simulator.NetworkModel`'s fields at the top level, and a compute file
:class:`~twinrpc.simulator.ComputeModel`'s (``op_cost``, ``flop_cost``). Fields left out take their
defaults (``None`` fields are left out, TOML has no null; ``count = "all"`` stands for
``count=None``, every matching message). Reading is strict: an unknown field, a
wrong type or a bad value raises :class:`FaultPlanError` naming it (``faults[2] (drop).nth: ...``).
Writing then reading gives back an equal object. TOML is read with :mod:`tomllib` and written by
:func:`to_toml` (the few value types these files hold).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import tomllib

from ._errors import FaultPlanError

#: how a file says ``count=None`` (every matching message from the nth on)
ALL = "all"


# -- values ------------------------------------------------------------------------------------------
def convert(value: Any, annotation: str, where: str) -> Any:
    """``value`` read from a file, checked against a field's annotation (a string: the modules use
    ``from __future__ import annotations``)."""
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    if value is None or (value == ALL and annotation == "int | None"):
        if optional:
            return None
        raise FaultPlanError(f"{where}: must not be null")
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FaultPlanError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise FaultPlanError(f"{where}: expected an integer, got {value!r}")
        return value
    if base == "str":
        if not isinstance(value, str):
            raise FaultPlanError(f"{where}: expected a string, got {value!r}")
        return value
    if base == "bool":
        if not isinstance(value, bool):
            raise FaultPlanError(f"{where}: expected true or false, got {value!r}")
        return value
    if base in ("tuple[int, ...]", "tuple[str, ...]"):
        item = base[6:9]
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            raise FaultPlanError(f"{where}: expected a list, got {value!r}")
        return tuple(convert(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    raise AssertionError(f"no converter for {annotation!r}")  # pragma: no cover


def build(cls: type, data: Any, where: str, skip: tuple[str, ...] = ()) -> Any:
    if not isinstance(data, dict):
        raise FaultPlanError(f"{where}: expected a table/object, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in skip:
            continue
        f = fields.get(key)
        if f is None:
            raise FaultPlanError(f"{where}: unknown field {key!r}; expected one of {', '.join(fields)}")
        kwargs[key] = convert(value, str(f.type), f"{where}.{key}")
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise FaultPlanError(f"{where}: missing field(s) {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except FaultPlanError as exc:
        raise FaultPlanError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:  # pragma: no cover - the converters catch these first
        raise FaultPlanError(f"{where}: {exc}") from None


def plain(obj: Any, include_defaults: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.default is not None:
            out[f.name] = ALL  # count=None: every message (TOML has no null)
            continue
        if value is None or (
            not include_defaults and f.default is not dataclasses.MISSING and value == f.default
        ):
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# -- files-------------------------------------------------------------------------------------------
def read_data(path: str | Path) -> Any:
    """The content of a ``.json`` or ``.toml`` file (OSError if it cannot be read)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise FaultPlanError(f"{path}: not valid JSON: {exc}") from None
    if suffix == ".toml":
        try:
            return tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise FaultPlanError(f"{path}: not valid TOML: {exc}") from None
    raise FaultPlanError(f"{path}: unknown file type {suffix!r}; use .json or .toml")


def data_from_text(text: str, flag: str) -> Any:
    """What a command-line flag holds: a JSON object, or the path of a JSON or TOML file."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise FaultPlanError(f"{flag}: not valid JSON: {exc}") from None
    if not Path(text).is_file():
        raise FaultPlanError(f"{flag} {text!r}: neither a JSON object nor a file")
    return read_data(text)


def source_of(text: str, flag: str) -> str:
    """How errors name a flag's value: the flag, and the file when it names one."""
    return flag if text.lstrip().startswith("{") else f"{flag} {text}"


def dump_data(data: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        path.write_text(to_json(data), encoding="utf-8")
    elif suffix == ".toml":
        path.write_text(to_toml(data), encoding="utf-8")
    else:
        raise FaultPlanError(f"{path}: unknown file type {suffix!r}; use .json or .toml")


def to_json(data: dict[str, Any]) -> str:
    """JSON with one fault (or action, or field) a line."""
    lines = []
    for key, value in data.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            items = ",\n".join(f"    {json.dumps(v)}" for v in value)
            lines.append(f"  {json.dumps(key)}: [\n{items}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n" if lines else "{}\n"


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest repr that reads back exactly; valid TOML (1e-05, 0.5, 2000000000.0)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string uses the same escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise FaultPlanError(f"cannot write {value!r} to TOML")


def to_toml(data: dict[str, Any]) -> str:
    """TOML for the dicts of this module: scalars, lists, one level of tables, arrays of tables.
    A list of small tables (two keys or fewer) is written inline, one table a line."""
    head: list[str] = []
    tail: list[str] = []
    for key, value in data.items():
        k = _toml_key(key)
        if isinstance(value, dict):
            tail.append(f"\n[{k}]")
            tail.extend(f"{_toml_key(kk)} = {_toml_value(vv)}" for kk, vv in value.items())
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            if all(len(v) <= 2 for v in value):
                head.append(f"{k} = [\n" + "".join(f"  {_toml_value(v)},\n" for v in value) + "]")
            else:
                for v in value:
                    tail.append(f"\n[[{k}]]")
                    tail.extend(f"{_toml_key(kk)} = {_toml_value(vv)}" for kk, vv in v.items())
        else:
            head.append(f"{k} = {_toml_value(value)}")
    text = "\n".join(head + tail).lstrip("\n")
    return text + "\n" if text else ""
