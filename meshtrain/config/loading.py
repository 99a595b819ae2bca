"""Reading and writing a training configuration: TOML files, ``--section.key=value`` overrides,
typed values, and the TOML that ``meshtrain train --print-config`` prints.

Precedence: the defaults (``schema.py``) < the TOML file < the overrides, in the order given.
Every error is a ``ConfigError`` that names the field (``section.key``) and says what to do.
Nothing here imports torch: the CLI can load, check and print a config before starting anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import typing
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError
from .check import validate
from .schema import SECTIONS, TOP_LEVEL, Config, all_keys, field_docs, hints, unknown

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


# ------------------------------------------------------------------------------------------- keys

def _target(config: Config, key: str) -> tuple[Any, str, Any]:
    """The object holding the dotted ``key``, the attribute's name and its type."""
    if key in SECTIONS:
        raise ConfigError(f"'{key}' is a section, not a key: set one of its keys, e.g. "
                          f"{key}.{dataclasses.fields(SECTIONS[key])[0].name}")
    if key in TOP_LEVEL:
        return config, key, hints(Config)[key]
    section, _, name = key.partition(".")
    if section not in SECTIONS or name not in hints(SECTIONS[section]):
        raise unknown(key, all_keys())
    return getattr(config, section), name, hints(SECTIONS[section])[name]


# ------------------------------------------------------------------------------------------ values

def _base_and_optional(tp: Any) -> tuple[type, bool]:
    args = typing.get_args(tp)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def _alternatives(tp: Any) -> tuple[type, ...]:
    """The types a field accepts, None aside: ``float | str`` (a size or "auto") has two."""
    return tuple(a for a in typing.get_args(tp) if a is not type(None)) or (tp,)


_TYPE_NAMES = {bool: ("a boolean", "true"), int: ("an integer", "1"), float: ("a number", "1.0"), str: ("a string", '"..."')}


def _type_error(key: str, tp: Any, got: str) -> ConfigError:
    _, opt = _base_and_optional(tp)
    names = [_TYPE_NAMES[a] for a in _alternatives(tp)]
    return ConfigError(f"{key} must be {' or '.join(n for n, _ in names)}{' (or none)' if opt else ''}, got {got}; "
                       f"e.g. {key} = {names[0][1]}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """A TOML value checked against the field type (ints are accepted for floats)."""
    _, opt = _base_and_optional(tp)
    bases = _alternatives(tp)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ((value is None and opt) or (float in bases and number) or (int in bases and number and isinstance(value, int))
            or any(b in (bool, str) and isinstance(value, b) for b in bases)):
        raise _type_error(key, tp, f"{type(value).__name__} {value!r}")
    return float(value) if float in bases and number else value


def parse_value(key: str, raw: str, tp: Any) -> Any:
    """A command-line string parsed to the field type: booleans true/false/1/0/yes/no/on/off,
    ints (underscores allowed), floats, strings as given, "none" for optional fields."""
    _, opt = _base_and_optional(tp)
    text = raw.strip().lower()
    if opt and text in ("none", "null"):
        return None
    for base in _alternatives(tp):  # in the order written: ``float | str`` tries the number first
        try:
            if base is bool and text in _TRUE + _FALSE:
                return text in _TRUE
            if base in (int, float):
                return base(text)
        except ValueError:
            pass
        if base is str:
            return raw
    raise _type_error(key, tp, repr(raw))


# ------------------------------------------------------------------------------------- from / to dict

def from_dict(data: dict[str, Any]) -> Config:
    """A ``Config`` from nested dicts (a parsed TOML file, or ``to_dict`` output); unknown
    sections or keys and wrongly typed values raise ``ConfigError``."""
    cfg = Config()
    for name, value in data.items():
        if isinstance(value, dict) and name not in SECTIONS:
            raise unknown(name, SECTIONS, "config section")
        items = [(f"{name}.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(name, value)]
        for key, v in items:
            obj, attr, tp = _target(cfg, key)
            setattr(obj, attr, _coerce(key, v, tp))
    return cfg


def to_dict(config: Config) -> dict[str, Any]:
    """Nested plain dicts of the config (fields set to None included)."""
    return dataclasses.asdict(config)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else "nan" if math.isnan(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    return repr(v)


def to_toml(config: Config, comments: bool = True) -> str:
    """The config as TOML that ``load_config`` reads back to an equal config; with ``comments``
    each key carries its docstring. Fields set to None (TOML has no null) appear commented out."""
    lines = []
    for name in TOP_LEVEL:
        if comments:
            lines.append(f"# {field_docs(Config)[name]}")
        lines.append(f"{name} = {_toml_value(getattr(config, name))}")
    for name, cls in SECTIONS.items():
        lines += ["", f"[{name}]"]
        # a section's own fields first (ParallelSection: the degrees, then ParallelConfig's)
        for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in vars(cls).get("__annotations__", {})):
            v = getattr(getattr(config, name), f.name)
            if comments:
                lines.append(f"# {field_docs(cls).get(f.name, '')}")
            if v is not None:
                lines.append(f"{f.name} = {_toml_value(v)}")
            elif comments:
                lines.append(f"# {f.name} = (unset)")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ loading

def _split_overrides(overrides: Iterable[str]) -> list[tuple[str, str]]:
    """(key, raw value) for ``--a.b=v``, ``a.b=v`` or the pair ``--a.b v``."""
    items, out, i = list(overrides), [], 0
    while i < len(items):
        item = items[i]
        body = item[2:] if item.startswith("--") else item
        if "=" in body:
            key, raw = body.split("=", 1)
        elif item.startswith("--") and i + 1 < len(items) and not items[i + 1].startswith("--"):
            key, raw, i = body, items[i + 1], i + 1
        else:
            raise ConfigError(f"override {item!r} has no value: write --section.key=value (e.g. --train.lr=3e-4)")
        parts = key.split(".")
        if len(parts) > 2 or not all(p.isidentifier() for p in parts):
            raise ConfigError(f"bad override {item!r}: write --section.key=value (e.g. --train.lr=3e-4)")
        out.append((key, raw))
        i += 1
    return out


def apply_overrides(config: Config, overrides: Iterable[str]) -> Config:
    """Set ``--section.key=value`` overrides on ``config`` (in place, later ones win); returns it."""
    for key, raw in _split_overrides(overrides):
        obj, attr, tp = _target(config, key)
        setattr(obj, attr, parse_value(key, raw, tp))
    return config


def load_config(path: str | None = None, overrides: Iterable[str] = (), *, check: bool = True) -> Config:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides`` (``--section.key=value``);
    with ``check``, ``validate`` the result. Every problem is a ``ConfigError``."""
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path!r} does not exist; pass the path of a TOML file "
                              f"(`meshtrain train --print-config > my.toml` writes one to start from)")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    config = apply_overrides(from_dict(data), overrides)
    if check:
        validate(config)
    return config


def resolve_out(config: Config, now: float | None = None) -> Config:
    """Fill an empty ``out`` with runs/<YYYYmmdd-HHMMSS> (local time); call once, before spawning."""
    if not config.out:
        config.out = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.localtime(now)))
    return config


__all__ = ["load_config", "apply_overrides", "parse_value", "from_dict", "to_dict", "to_toml", "resolve_out"]
