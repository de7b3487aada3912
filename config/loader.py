"""Load a topology TOML file, apply ``--set`` overrides, convert and validate it.

This module parses (TOML, ``--set``, the schema's conversion) and says where each error is; the
semantic checks of a converted topology are ``config.checks``.

Every failure is a ``TopologyError`` whose message reads ``<file>: <key.path>: <problem>`` so an
operator can go straight to the offending line. msgspec reports dict entries as ``[...]``; we find
the offending key ourselves (see ``_resolve_path``) because "pools[...]" does not say which pool.
"""

from __future__ import annotations

import copy
import re
import tomllib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from config.checks import check_topology, join_keys
from config.topology import Topology

# first characters of a --set value that can only mean TOML (an inline table, an array, a quoted string)
_TOML_OPENERS = ("{", "[", '"', "'")


class TopologyError(ValueError):
    """A topology that cannot be loaded; the message names the file, the key path and the problem."""

    def __init__(self, file: str, key: str | None, problem: str) -> None:
        self.file, self.key, self.problem = file, key, problem
        super().__init__(f"{file}: {key}: {problem}" if key else f"{file}: {problem}")


def load_topology(path: str | Path, overrides: Iterable[str] = ()) -> Topology:
    """Read ``path``, apply ``key.path=value`` overrides, convert to ``Topology`` and check it."""
    file = str(path)
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise TopologyError(file, None, f"cannot read topology: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(file, None, f"invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise TopologyError(file, None, f"not UTF-8 text: {e}") from None
    return topology_from_dict(raw, file, overrides)


def topology_from_dict(raw: dict[str, Any], file: str = "<topology>",
                       overrides: Iterable[str] = ()) -> Topology:
    data = copy.deepcopy(raw)
    overridden: set[str] = set()
    for item in overrides:
        overridden.add(apply_override(data, item, file))
    topo = _convert(data, file, overridden)

    def fail(key: str, problem: str) -> NoReturn:
        if key in overridden:
            problem += " (set by --set)"
        raise TopologyError(file, key, problem)

    check_topology(topo, fail)
    return topo


# --- overrides ----------------------------------------------------------------------------------


def parse_override(item: str, file: str = "<topology>") -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a", "b", "c"], value); value is a TOML literal when it parses as one."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise TopologyError(file, None, f"--set {item!r}: expected key.path=value")
    parts = [p.strip() for p in key.split(".")]
    if any(not p for p in parts):
        raise TopologyError(file, None, f"--set {item!r}: empty segment in key path {key!r}")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        if text.strip()[:1] in _TOML_OPENERS:
            # it was meant as a table, an array or a quoted string: a broken one must not pass as
            # the string "{...}" (the schema would then say "expected table, got str")
            where = re.sub(r"\(at line 1, column (\d+)\)", lambda m: f"(at column {int(m.group(1)) - 4})", str(e))
            raise TopologyError(file, None, f"--set {item!r}: not a TOML value ({where}); write a table as "
                                "{ key = \"text\", n = 1, inner = { k = true } } on one line, an array as "
                                "[1, 2], a string as \"text\" or a bare word") from None
        value = text  # bare words (hosts, URLs, paths) are strings, no quoting needed on a shell
    return parts, value


def apply_override(data: dict[str, Any], item: str, file: str = "<topology>") -> str:
    """Set one override in the raw TOML dict, creating intermediate tables; returns the key path."""
    parts, value = parse_override(item, file)
    if _unwrap(_field_type(parts)) is str and not isinstance(value, str):
        # `--set pools.w.env.OMP_NUM_THREADS=1` means the string "1" where the schema wants text
        value = item.partition("=")[2].strip()
    node = data
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            where = join_keys(parts[: i + 1])
            raise TopologyError(file, where, f"--set {item!r}: {where} is a {_kind(nxt)}, not a table")
        node = nxt
    node[parts[-1]] = value
    return join_keys(parts)


# --- conversion and msgspec error translation ---------------------------------------------------


def _convert(data: dict[str, Any], file: str, overridden: set[str]) -> Topology:
    try:
        return msgspec.convert(data, Topology, strict=True)
    except msgspec.ValidationError as e:
        msg = str(e)
    problem, _, where = msg.rpartition(" - at `")
    if not _:
        problem, where = msg, "$`"
    where = where.rstrip("`")
    keys = _resolve_path(data, where, msg)
    m = re.match(r"Object contains unknown field `(.+)`$", problem)
    if m:
        keys.append(m.group(1))
        problem = f"unknown key (allowed: {', '.join(_allowed_fields(keys[:-1]))})"
    elif (m := re.match(r"Object missing required field `(.+)`$", problem)):
        keys.append(m.group(1))
        problem = "required key is missing"
    else:
        problem = _friendly(problem, keys, data)
    key = join_keys(keys) or None
    if key and key in overridden:
        problem += " (set by --set)"
    raise TopologyError(file, key, problem) from None


def _resolve_path(data: dict[str, Any], where: str, msg: str) -> list[str]:
    """Turn msgspec's ``$.pools[...].env[...]`` into real keys by narrowing each ``[...]`` dict
    to one entry at a time until the same error reappears."""
    tokens = re.findall(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]", where.removeprefix("$"))
    trial = copy.deepcopy(data)
    node: Any = trial
    keys: list[str] = []
    for name, index in tokens:
        if name:
            keys.append(name)
            node = node.get(name) if isinstance(node, dict) else None
        elif index != "...":
            keys.append(index)
            node = node[int(index)] if isinstance(node, list) and int(index) < len(node) else None
        elif isinstance(node, dict):
            items = dict(node)
            found = None
            for k, v in items.items():
                node.clear()
                node[k] = v
                try:
                    msgspec.convert(trial, Topology, strict=True)
                except msgspec.ValidationError as e:
                    if str(e) == msg:
                        found = k
                        break
            if found is None:  # should not happen; keep msgspec's placeholder rather than guess
                node.update(items)
                keys.append("[...]")
                node = None
                continue
            keys.append(found)
            node = node[found]
        else:
            keys.append("[...]")
    return keys


def _friendly(problem: str, keys: list[str], data: dict[str, Any]) -> str:
    value = _lookup(data, keys)
    m = re.match(r"Expected `(.+)`, got `(.+)`$", problem)
    if m:
        want, got = (_toml_name(x.replace("`", "")) for x in m.groups())
        return f"expected {want}, got {got}{_show(value)}"
    if problem.startswith("Invalid enum value"):
        choices = _literal_choices(keys)
        allowed = f" (expected one of {', '.join(map(str, choices))})" if choices else ""
        return f"invalid value {value!r}{allowed}"
    return problem[:1].lower() + problem[1:]


def _lookup(data: Any, keys: list[str]) -> Any:
    for k in keys:
        if isinstance(data, dict) and k in data:
            data = data[k]
        elif isinstance(data, list) and k.isdigit() and int(k) < len(data):
            data = data[int(k)]
        else:
            return None
    return data


def _field_type(keys: list[str]) -> Any:
    """The annotated type at a key path in the Topology schema (None when unknown)."""
    typ: Any = Topology
    for k in keys:
        typ = _unwrap(typ)
        if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
            typ = typing.get_type_hints(typ).get(k)
        elif typing.get_origin(typ) is dict:
            typ = typing.get_args(typ)[1]
        elif typing.get_origin(typ) is list:
            typ = typing.get_args(typ)[0]
        else:
            return None
    return typ


def _unwrap(typ: Any) -> Any:
    """Optional[X] → X (the schema never uses other unions)."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return typ


def _literal_choices(keys: list[str]) -> list[Any]:
    typ = _unwrap(_field_type(keys))
    return list(typing.get_args(typ)) if typing.get_origin(typ) is typing.Literal else []


def _allowed_fields(keys: list[str]) -> list[str]:
    typ = _unwrap(_field_type(keys))
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        return list(typ.__struct_fields__)
    return []


def _kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array"}.get(
        type(value), type(value).__name__)


def _show(value: Any) -> str:
    return "" if value is None or isinstance(value, dict | list) else f" ({value!r})"


def _toml_name(msgspec_type: str) -> str:
    return msgspec_type.replace("object", "table")
