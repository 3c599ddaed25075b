"""Configuration dataclasses as the one place a setting is defined.

A component's settings are a keyword-only dataclass. A field made with :func:`option` is also
a command-line flag: its default is the dataclass default, its help text is the field's
attribute docstring (the string literal under it), its type is its default's type (or the
``type`` given). So a default is written once, in the dataclass, and ``--help``, the
dataclass and a configuration file can never disagree.

- :func:`add_options` adds a dataclass's options to an ``argparse`` parser (the CLI room
  calls it; nothing below the CLI imports argparse for this);
- :func:`from_namespace` builds the dataclass back from parsed flags;
- :func:`to_dict` / :func:`from_dict` write and read it as JSON-able data (unknown keys and
  wrong types are refused with the key's name), which is how a launcher hands a child its
  configuration: as a file, not as a rebuilt command line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Sequence
from typing import Any

_CLI = "cli"


def option(
    default: Any = dataclasses.MISSING,
    *,
    flag: str | None = None,
    short: str | None = None,
    type: Callable[[str], Any] | None = None,  # noqa: A002 - argparse's own name
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    hidden: bool = False,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring).

    ``flag`` overrides the name (default ``--field-name``); ``type`` parses the flag's text
    (default: the default value's type; ``bool`` fields become ``--x/--no-x``; a ``ValueError``
    a parsing function raises is the flag's error message); ``hidden`` keeps it out of
    ``--help`` (internal knobs the launchers set). A list, tuple or dict default makes the
    flag repeatable: each use adds an item (for a dict, ``type`` parses one ``(key, value)``
    pair).
    """
    meta = {
        _CLI: {
            "flag": flag,
            "short": short,
            "type": type,
            "choices": tuple(choices) if choices is not None else None,
            "metavar": metavar,
            "hidden": hidden,
        }
    }
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (one line, whitespace collapsed), base classes first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def options(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that are command-line options, in declaration order
    (not those of nested dataclasses: see :func:`sections`)."""
    return [f for f in dataclasses.fields(cls) if _CLI in f.metadata]


def sections(cls: type) -> dict[str, type]:
    """The fields of ``cls`` that hold a nested configuration dataclass: name -> its class."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])
    }


def same_option(cls: type, name: str) -> Any:
    """Option ``name`` of dataclass ``cls`` again, with its default, flag, type and choices,
    for a configuration that holds only some of ``cls``'s settings (its docstring is its
    own: say what the setting means there)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def flag_name(f: dataclasses.Field) -> str:
    """``--field-name`` unless the option names its own flag."""
    return f.metadata[_CLI]["flag"] or "--" + f.name.replace("_", "-")


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def on_off(text: str) -> bool:
    """A flag's ``on``/``off`` (or ``true``/``false``) as a bool: the ``type`` of a switch
    whose default is derived (None until resolved), so it takes a value, not ``--no-x``."""
    value = {"on": True, "true": True, "off": False, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value


def _scalar_type(cls: type, name: str) -> type:
    """The scalar type a field's flag parses to, from its annotation (``int | None`` -> int)."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if args[0] in (int, float, str) else str


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an ``argparse`` type: a parsing function's ``ValueError`` becomes the
    flag's error message (argparse would only say "invalid parse value"); the built-in types
    keep argparse's own message."""
    if isinstance(parse, type):
        return parse

    @functools.wraps(parse)
    def flag_type(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return flag_type


def _plain(text: str) -> str:
    """Docstring markup to terminal text: ````x```` -> ``x``; ``%`` escaped for argparse."""
    return text.replace("``", "").replace("%", "%%")


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    exclude: Sequence[str] = (),
    only: Collection[str] | None = None,
    defaults: dict[str, Any] | None = None,
    sparse: bool = False,
) -> None:
    """Add every option of ``cls`` and its sections (but ``exclude``; with ``only``, just
    those) to ``parser``; ``dest`` is the field name.

    ``defaults`` replaces a field's default for this parser only (a command whose own default
    differs; say so in the field's docstring; ``flat_values(cls())`` gives a section the
    values of its owner's default instance). ``sparse``: a flag that is not given leaves
    nothing in the namespace (``argparse.SUPPRESS``), so :func:`from_namespace` can tell it
    from one given with its default value (a configuration file then fills it); a field
    without a default is then checked by the dataclass, not by argparse.
    """
    docs = field_docs(cls)
    for f in options(cls):
        if f.name in exclude or (only is not None and f.name not in only):
            continue
        spec = f.metadata[_CLI]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = (defaults or {}).get(f.name, default_of(f))
        names = [flag_name(f)] + ([spec["short"]] if spec["short"] else [])
        kwargs: dict[str, Any] = {"dest": f.name, "default": default}
        if spec["hidden"]:
            kwargs["help"] = argparse.SUPPRESS
        else:
            hide = required or default is None or default is False or default in ("", [], (), {})
            shown = "" if hide else f" (default: {default})"
            kwargs["help"] = _plain(docs.get(f.name, "")) + (" (required)" if required else shown)
        if isinstance(default, bool) and spec["type"] is None:
            # an off switch is a plain flag (--json); an on switch can be turned off (--no-x)
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif isinstance(default, list | tuple | dict):
            kwargs["action"] = "append"
            kwargs["type"] = _flag_type(spec["type"] or str)
            kwargs["default"] = list(default.items() if isinstance(default, dict) else default)
        else:
            kwargs["type"] = _flag_type(spec["type"] or _scalar_type(cls, f.name))
        if spec["choices"] is not None:
            kwargs["choices"] = spec["choices"]
        if spec["metavar"] is not None:
            kwargs["metavar"] = spec["metavar"]
        if sparse:
            kwargs["default"] = argparse.SUPPRESS
        elif required:
            kwargs["required"] = True
            del kwargs["default"]
        parser.add_argument(*names, **kwargs)
    for name, section in sections(cls).items():
        group = parser
        if isinstance(parser, argparse.ArgumentParser):  # argparse groups do not nest
            group = parser.add_argument_group(name, section_description(section))
        add_options(group, section, exclude=exclude, only=only, defaults=defaults, sparse=sparse)


def section_description(section: type) -> str:
    """The first paragraph of a configuration section's own docstring, on one line, for its
    group in ``--help``; "" for a class without one (``dataclass`` then makes its docstring
    the constructor's signature, which is no description)."""
    doc = (section.__doc__ or "").strip()
    if doc.startswith(f"{section.__name__}("):  # dataclass's stand-in, not written by us
        return ""
    return " ".join(_plain(doc.split("\n\n")[0]).split())


def from_namespace(
    cls: type,
    ns: argparse.Namespace,
    *,
    base: Any = None,
    unset: Collection[str] = (),
    **overrides: Any,
) -> Any:
    """Build ``cls`` from parsed flags: its options found in ``ns``, nested sections built
    the same way, then ``overrides``. An option not in ``ns`` (a ``sparse`` parser) takes its
    value from ``base`` (e.g. read from a configuration file) or else the dataclass default;
    fields named in ``unset`` (at any depth) never take ``base``'s (a setting given on the
    command line that derives them: ``--comms`` and the H and codecs it names).
    A missing required field or a bad value raises ``ConfigError``."""
    kwargs = (
        {
            f.name: getattr(base, f.name)
            for f in dataclasses.fields(cls)
            if f.init and f.name not in unset
        }
        if base is not None
        else {}
    )
    kwargs.update(
        {
            name: from_namespace(sub, ns, base=getattr(base, name, None), unset=unset)
            for name, sub in sections(cls).items()
        }
    )
    for f in options(cls):
        if hasattr(ns, f.name):
            kwargs[f.name] = _collected(getattr(ns, f.name), default_of(f))
    kwargs.update(overrides)
    missing = [
        flag_name(f)
        for f in options(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{', '.join(missing)} is required")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def _collected(value: Any, default: Any) -> Any:
    """A repeatable flag's items as the type of its field's default (a tuple, a dict)."""
    if isinstance(value, list) and isinstance(default, tuple | dict):
        return type(default)(value)
    return value


def flat_values(obj: Any) -> dict[str, Any]:
    """Every option value of configuration ``obj`` and its sections, by flag destination (for
    ``parser.set_defaults``: a configuration file then gives the defaults that flags override)."""
    out: dict[str, Any] = {}
    for name in sections(type(obj)):
        out.update(flat_values(getattr(obj, name)))
    out.update({f.name: getattr(obj, f.name) for f in options(type(obj))})
    return out


def command_flags(obj: Any, *, skip: Sequence[str] = ()) -> list[str]:
    """The flags that rebuild configuration ``obj`` from the defaults: every option (of ``obj``
    and its sections, but ``skip``) whose value differs from its default, in declaration
    order. Pure; hidden options are included (a command line that reproduces a run must carry
    them too).

    >>> from diloco.wire.protocol import ProtocolConfig
    >>> command_flags(ProtocolConfig(sync_every=64))
    ['--sync-every', '64']
    """
    out: list[str] = []
    for f in options(type(obj)):
        value = getattr(obj, f.name)
        if f.name in skip or value == default_of(f) or value == _resolved_default(obj, f):
            continue
        flag = flag_name(f)
        if isinstance(value, bool) and f.metadata[_CLI]["type"] is None:
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, bool):  # an on_off switch
            out += [flag, "on" if value else "off"]
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    for name in sections(type(obj)):
        out += command_flags(getattr(obj, name), skip=skip)
    return out


def _resolved_default(obj: Any, f: dataclasses.Field) -> Any:
    """What a field whose default is None resolves to in ``obj`` when not given (a value
    the dataclass derives on creation, e.g. H from ``--comms``); ``None`` for the others."""
    if default_of(f) is not None or getattr(obj, f.name) is None:
        return None
    return getattr(dataclasses.replace(obj, **{f.name: None}), f.name)


def to_dict(obj: Any) -> dict[str, Any]:
    """A configuration dataclass as JSON-able data (nested dataclasses as nested dicts)."""
    return dataclasses.asdict(obj)


class ConfigError(ValueError):
    """A configuration file or dict that does not fit its dataclass."""


def from_dict(cls: type, data: dict[str, Any], *, where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data`` (as :func:`to_dict` writes it).

    Unknown keys and values of the wrong type are refused with :class:`ConfigError` naming
    the key; missing keys take the dataclass default; the dataclass's own checks run. A
    class with a static ``upgrade_file_data(data) -> data`` reads files of older versions.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected an object, got {data!r:.80}")
    upgrade = getattr(cls, "upgrade_file_data", None)  # files written by older versions
    if upgrade is not None:
        data = upgrade(data)
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown key(s) {', '.join(unknown)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(hints[name], value, key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    """``value`` checked against type ``hint`` (dataclasses, lists, optionals, scalars)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where=key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r:.80}")
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r:.80}")
        item = args[0] if args else Any
        out = [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple or hint is tuple else out
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r:.80}")
        return value
    return value
