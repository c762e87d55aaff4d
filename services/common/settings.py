"""Every setting declared once: a frozen config dataclass's fields carry their flag's help.

A field made with ``flag(...)`` is a command-line flag: ``--<name with dashes>``, its type from
the annotation (``int``, ``float``, ``str``, ``Path``, ``bool`` as a switch (one that defaults
to on is named for turning it off: ``--no-image-prefetch``), ``tuple[str, ...]`` as a
comma-separated list (``repeatable``: the flag may also come once per item), ``X | None`` as
``X``), its default the field's. ``nested(...)`` flattens a dataclass field's flags under a
prefix (``--http-max-body-bytes``), or none. A field made
with plain ``field`` (or none) is not a flag: the service computes it.

``add_config_args`` builds a parser's flags from a config class, ``config_from_args`` builds the
config from the parsed namespace, and ``config_to_argv`` turns a config back into the argv that
parses to it, so a launcher derives a child's command line from the child's own config.
``config_to_argv`` writes only the settings that differ from the class's defaults: the child's
default stays in one place, and a default read from the environment (``--log-level``) is left
to the child's environment, as when a person starts it by hand.

The validators below are argparse ``type`` callables: a bad value is a usage error naming the
flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

_FLAG = "stageserve.flag"
_NESTED = "stageserve.nested"
MAX_PORT = 65535


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line."""

    help: str
    name: str | None = None  # the flag without dashes; None: the field's name with dashes
    type: Callable[[str], Any] | None = None  # None: from the annotation
    choices: Sequence[str] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # other spellings accepted (full flags, with dashes)
    repeatable: bool = False  # a tuple flag given more than once adds to the list


def flag(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | Any = MISSING,
    name: str | None = None,
    type: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    aliases: tuple[str, ...] = (),
    repeatable: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    meta = {_FLAG: Flag(help, name, type, choices, metavar, aliases, repeatable)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def nested(default_factory: Callable[[], Any], *, prefix: str = "") -> Any:
    """A dataclass field whose own flagged fields are flags named ``--<prefix>-<name>``
    (``--<name>`` without a prefix)."""
    return dataclasses.field(default_factory=default_factory, metadata={_NESTED: prefix})


@dataclass(frozen=True)
class _Setting:
    dest: str  # the namespace attribute: the field names along the path, joined by "_"
    path: tuple[str, ...]  # field names from the top config down to this field
    flag: Flag
    kind: Any  # the annotation, ``X | None`` unwrapped
    default: Any

    @property
    def option(self) -> str:
        return "--" + (self.flag.name or self.dest).replace("_", "-")


def _unwrap_optional(kind: Any) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _settings(cls: type, path: tuple[str, ...] = (), prefix: str = "") -> Iterator[_Setting]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            yield from _settings(hints[f.name], (*path, f.name), _inner(prefix, f))
        elif _FLAG in f.metadata:
            meta: Flag = f.metadata[_FLAG]
            kind = _unwrap_optional(hints[f.name])
            dest = f"{prefix}{f.name}"
            yield _Setting(dest, (*path, f.name), meta, kind, _default_of(f))


def _inner(prefix: str, f: dataclasses.Field) -> str:
    return prefix + (f"{f.metadata[_NESTED]}_" if f.metadata[_NESTED] else "")


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _parse_type(setting: _Setting) -> Callable[[str], Any] | None:
    if setting.flag.type is not None:
        return setting.flag.type
    if typing.get_origin(setting.kind) is tuple:
        return comma_list
    return setting.kind if setting.kind in (int, float, Path) else None


def add_config_args(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """Add a flag for each ``flag(...)`` field of ``cls`` (nested ones flattened).
    ``defaults`` / ``helps`` replace a field's default / help by its dest (the environment's
    ``--log-level``, an unused ``--device``)."""
    defaults, helps = defaults or {}, helps or {}
    for s in _settings(cls):
        default = defaults.get(s.dest, s.default)
        kwargs: dict[str, Any] = {"dest": s.dest, "help": helps.get(s.dest, s.flag.help)}
        if s.kind is bool:  # a switch; one whose default is on is named for turning it off
            action = "store_false" if default is True else "store_true"
            parser.add_argument(s.option, *s.flag.aliases, action=action, **kwargs)
            continue
        if s.flag.repeatable:  # "a,b", or the flag once per item
            kwargs["action"] = "extend"
            default = list(default)
        if default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        for key in ("choices", "metavar"):
            if getattr(s.flag, key) is not None:
                kwargs[key] = getattr(s.flag, key)
        parser.add_argument(s.option, *s.flag.aliases, type=_parse_type(s), **kwargs)


def config_from_args(cls: type, args: argparse.Namespace, **values: Any) -> Any:
    """``cls`` from the flags ``add_config_args`` added; ``values`` give the fields that are not
    flags (or override a flag's value). ``ValueError`` from the config's own checks."""
    return _build(cls, args, "", values)


def _build(cls: type, args: argparse.Namespace, prefix: str, values: dict) -> Any:
    kwargs: dict[str, Any] = dict(values)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            continue
        if _NESTED in f.metadata:
            kwargs[f.name] = _build(hints[f.name], args, _inner(prefix, f), {})
        elif _FLAG in f.metadata:
            value = getattr(args, f"{prefix}{f.name}")
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def _format(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def config_to_argv(config: Any, *, skip: Collection[str] = ()) -> list[str]:
    """The flags that parse back to ``config``: each setting that differs from its class's
    default (a required one always); fields that are not flags, and the dests in ``skip``
    (given some other way), are left out."""
    argv: list[str] = []
    for s in _settings(type(config)):
        if s.dest in skip:
            continue
        value = config
        for name in s.path:
            value = getattr(value, name)
        if s.default is not MISSING and value == s.default:
            continue
        if s.kind is bool:  # not the default: the switch is given
            argv.append(s.option)
            continue
        if value is not None:
            argv += [s.option, _format(value)]
    return argv


def at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


positive_int = at_least(1)
non_negative_int = at_least(0)


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a port in [0, {MAX_PORT}], got {value}")
    return value


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
