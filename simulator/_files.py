"""The simulator's plain-data format: fault plans, swarms, network and compute models as dicts,
JSON and TOML files; one reader and one writer per format, which every ``load``/``from_dict`` calls.

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
from typing import TYPE_CHECKING, Any

import tomllib

from ._errors import FaultPlanError
from ._faults._plan import (
    DEFAULT_GC_DELAY,
    Crash,
    Delay,
    Deliver,
    Drop,
    Duplicate,
    FaultPlan,
    Hold,
    Partition,
    Pause,
)
from ._faults._swarm import Swarm  # at run time: load_faults' documented signature names it
from ._network._model import NetworkModel

if TYPE_CHECKING:
    from ._kernel._compute import ComputeModel

_FAULTS: dict[str, type] = {
    "delay": Delay,
    "drop": Drop,
    "duplicate": Duplicate,
    "hold": Hold,
    "partition": Partition,
    "crash": Crash,
    "pause": Pause,
}
_ACTIONS: dict[str, type] = {"deliver": Deliver, "delay": Delay, "drop": Drop, "duplicate": Duplicate}
_NAME = {cls: name for name, cls in _FAULTS.items()} | {Deliver: "deliver"}
#: how a file says ``count=None`` (every matching message from the nth on)
_ALL = "all"


# -- values ------------------------------------------------------------------------------------------
def _convert(value: Any, annotation: str, where: str) -> Any:
    """``value`` read from a file, checked against a field's annotation (a string: the modules use
    ``from __future__ import annotations``)."""
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    if value is None or (value == _ALL and annotation == "int | None"):
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
        return tuple(_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    raise AssertionError(f"no converter for {annotation!r}")  # pragma: no cover


def _build(cls: type, data: Any, where: str, skip: tuple[str, ...] = ()) -> Any:
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
        kwargs[key] = _convert(value, str(f.type), f"{where}.{key}")
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


def _plain(obj: Any, include_defaults: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.default is not None:
            out[f.name] = _ALL  # count=None: every message (TOML has no null)
            continue
        if value is None or (
            not include_defaults and f.default is not dataclasses.MISSING and value == f.default
        ):
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# -- fault plans ---------------------------------------------------------------------------------------
def fault_to_dict(fault: Any) -> dict[str, Any]:
    return {"type": _NAME[type(fault)], **_plain(fault)}


def _item(data: Any, where: str, table: dict[str, type]) -> Any:
    if not isinstance(data, dict):
        example = f"{{type = {json.dumps(data)}}}" if isinstance(data, str) else '{type = "drop", ...}'
        raise FaultPlanError(f"{where}: expected a table/object with a 'type', e.g. {example}; got {data!r}")
    kind = data.get("type")
    cls = table.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise FaultPlanError(f"{where}.type: {kind!r} is not one of {', '.join(table)}")
    return _build(cls, data, f"{where} ({kind})", skip=("type",))


def plan_to_dict(plan: FaultPlan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if plan.gc_delay != DEFAULT_GC_DELAY:
        out["gc_delay"] = plan.gc_delay
    if plan.actions:
        out["actions"] = [fault_to_dict(a) for a in plan.actions]
    if plan.faults:
        out["faults"] = [fault_to_dict(f) for f in plan.faults]
    return out


def plan_from_dict(data: Any, where: str = "") -> FaultPlan:
    if not isinstance(data, dict):
        raise FaultPlanError(f"{where or 'fault plan'}: expected a table/object, got {type(data).__name__}")
    if "swarm" in data:
        raise FaultPlanError(
            f"{where or 'fault plan'}: this describes a Swarm, not a FaultPlan; read it with "
            "twinrpc.simulator.load_faults or Swarm.from_dict"
        )
    unknown = set(data) - {"gc_delay", "actions", "faults"}
    if unknown:
        raise FaultPlanError(
            f"{where}unknown field {sorted(unknown)[0]!r}; a fault plan has gc_delay, actions and faults"
        )
    gc_delay = _convert(data.get("gc_delay", DEFAULT_GC_DELAY), "float", f"{where}gc_delay")
    lists = {}
    for name, table in (("actions", _ACTIONS), ("faults", _FAULTS)):
        items = data.get(name, [])
        if not isinstance(items, list):
            raise FaultPlanError(f"{where}{name}: expected a list, got {items!r}")
        lists[name] = [_item(x, f"{where}{name}[{i}]", table) for i, x in enumerate(items)]
    try:
        return FaultPlan(lists["faults"], lists["actions"], gc_delay)
    except (FaultPlanError, TypeError) as exc:
        raise FaultPlanError(f"{where}{exc}") from None


# -- swarms and network models ---------------------------------------------------------------------------
def swarm_to_dict(swarm: Swarm) -> dict[str, Any]:
    return {"swarm": _plain(swarm, include_defaults=True)}


def swarm_from_dict(data: Any, where: str = "") -> Swarm:
    if not isinstance(data, dict) or set(data) != {"swarm"}:
        raise FaultPlanError(f"{where or 'swarm'}: expected exactly one table, 'swarm'")
    return _build(Swarm, data["swarm"], f"{where}swarm")  # type: ignore[no-any-return]


def network_to_dict(model: NetworkModel) -> dict[str, Any]:
    return _plain(model, include_defaults=True)


def network_from_dict(data: Any, where: str = "") -> NetworkModel:
    return _build(NetworkModel, data, where or "network model")  # type: ignore[no-any-return]


def compute_to_dict(model: ComputeModel) -> dict[str, Any]:
    return _plain(model, include_defaults=True)


def compute_from_dict(data: Any, where: str = "") -> ComputeModel:
    from ._kernel._compute import (
        ComputeModel,  # _compute imports torch's dispatch machinery: only when asked
    )

    return _build(ComputeModel, data, where or "compute model")  # type: ignore[no-any-return]


# -- files -------------------------------------------------------------------------------------------
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


def _data_from_text(text: str, flag: str) -> Any:
    """What a command-line flag holds: a JSON object, or the path of a JSON or TOML file."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise FaultPlanError(f"{flag}: not valid JSON: {exc}") from None
    if not Path(text).is_file():
        raise FaultPlanError(f"{flag} {text!r}: neither a JSON object nor a file")
    return read_data(text)


def _source(text: str, flag: str) -> str:
    """How errors name a flag's value: the flag, and the file when it names one."""
    return flag if text.lstrip().startswith("{") else f"{flag} {text}"


def plan_from_text(text: str, flag: str = "faults") -> FaultPlan:
    """A fault plan given as a flag's value (``--sim-faults``, ``replay --faults``): its JSON
    object, or the path of a JSON or TOML file; errors name ``flag``."""
    return plan_from_dict(_data_from_text(text, flag), f"{_source(text, flag)}: ")


def network_from_text(text: str, flag: str = "network") -> NetworkModel:
    """A network model given as a flag's value (``--sim-network``, ``replay --network``): its JSON
    object, or the path of a JSON or TOML file; errors name ``flag``."""
    return network_from_dict(_data_from_text(text, flag), _source(text, flag))


def compute_from_text(text: str, flag: str = "compute") -> ComputeModel:
    """A compute model given as a flag's value (``--sim-compute``): its JSON object, or the path of a
    JSON or TOML file; errors name ``flag``."""
    return compute_from_dict(_data_from_text(text, flag), _source(text, flag))


def load_plan(path: str | Path) -> FaultPlan:
    return plan_from_dict(read_data(path), f"{path}: ")


def load_network(path: str | Path) -> NetworkModel:
    return network_from_dict(read_data(path), f"{path}")


def load_compute(path: str | Path) -> ComputeModel:
    return compute_from_dict(read_data(path), f"{path}")


def load_faults(path: str | Path) -> FaultPlan | Swarm:
    """Read a ``.json`` or ``.toml`` fault file: a :class:`~twinrpc.simulator.FaultPlan`, or a
    :class:`~twinrpc.simulator.Swarm` when the file holds a ``swarm`` table (what ``--faults FILE``
    accepts).

    Raises:
        FaultPlanError: the file is not JSON or TOML, or a field is unknown or malformed (named).
        OSError: the file cannot be read.
    """
    data = read_data(path)
    if isinstance(data, dict) and "swarm" in data:
        return swarm_from_dict(data, f"{path}: ")
    return plan_from_dict(data, f"{path}: ")


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
