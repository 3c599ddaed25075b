"""Configuration files: JSON (what runs write and read) and TOML (what people write).

``read_config_file(path, cls)`` reads either (by the suffix ``.toml``; anything else is
JSON) into configuration dataclass ``cls``; ``toml_text(doc)`` writes a configuration's
dict (``schema.to_dict``) as TOML, which Python reads back with ``tomllib``: sections as
tables, ``None`` left out (every field whose value may be None defaults to None).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport (a dependency there)
    import tomli as tomllib

from diloco.runtime.schema import ConfigError, from_dict


def read_config_file(path: str | Path, cls: type) -> Any:
    """Configuration ``cls`` from the JSON or TOML file ``path``; ``ConfigError`` says what
    is wrong (unreadable, not JSON / TOML, a key or value that does not fit)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config {path}: not TOML ({exc})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config {path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected an object of settings")
    return from_dict(cls, data)


def toml_text(doc: dict[str, Any]) -> str:
    """``doc`` (nested dicts of scalars and lists of scalars) as TOML text."""
    lines: list[str] = []
    _table(doc, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _table(doc: dict[str, Any], where: list[str], lines: list[str]) -> None:
    tables = {k: v for k, v in doc.items() if isinstance(v, dict)}
    if where and (len(tables) < len(doc) or not doc):
        lines.append("")
        lines.append("[" + ".".join(_key(k) for k in where) + "]")
    for key, value in doc.items():
        if value is None or isinstance(value, dict):
            continue
        lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in tables.items():
        _table(value, [*where, key], lines)


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise ValueError(f"{value!r} ({type(value).__name__}) has no TOML form here")
