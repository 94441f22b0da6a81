"""Command-line options derived from frozen config dataclasses, so flags and defaults cannot
drift from the config. Each field becomes `--field-name`; its type and default come from
the dataclass, and its command-line facts from the field's metadata (see `option`):
help text, a flag name where it differs from the field's, a parser for text that is not a
plain int/float/str, how its default reads on the command line, and choices.

A field whose type is itself a config dataclass is composed: a process config holds its
components' configs (each default kept once, on the component), the component's fields
declared with `option` become flags under their own names, and `config_from_args` puts
each value back in its component. A component's other fields (timeouts, buffers) stay
code-only, so a field added to a component never becomes a flag by accident. `internal`
marks a top-level field the command line does not offer.
Does not know any particular command.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
_CLI = "cli"  # metadata key: whether the command line offers the field (option: True, internal: False)


def option(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
           parse: Callable[[str], Any] | None = None, show: Callable[[Any], str] | None = None,
           choices: tuple[str, ...] | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its command-line facts. `help` names the default in words when
    "(default: ...)" is in it (otherwise the default is appended once); `flag` overrides
    `--field-name`; `parse` turns the flag's text into the field's value (errors: ValueError,
    raised by config_from_args); `show` writes the default as the flag would take it;
    `choices` are the flag's accepted texts (before `parse`)."""
    meta = {_CLI: True, "help": help, "flag": flag, "parse": parse, "show": show, "choices": choices}
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={k: v for k, v in meta.items() if v is not None})


def internal(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field the command line does not offer: code sets it, or assembly derives it."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_CLI: False})


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag: where its value goes (`path`, field names from the outer
    config inwards), the field it comes from, and its default (as the outer config has it:
    a component's default may differ from its class's)."""

    path: tuple[str, ...]
    field: dataclasses.Field
    kind: type
    default: Any

    @property
    def name(self) -> str:
        return self.field.metadata.get("flag") or "--" + self.field.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return ".".join(self.path)


def flags(config_cls: type, path: tuple[str, ...] = (), defaults: Any = None) -> Iterator[Flag]:
    """Every flag `config_cls` offers, its components' included, in field order: every
    top-level field but the `internal` ones, and a component's `option` fields.
    `defaults`: the instance whose values are the defaults (None: the class's own)."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if not f.metadata.get(_CLI, not path):
            continue
        kind = _scalar(hints[f.name])
        default = _default_of(f) if defaults is None else getattr(defaults, f.name)
        if dataclasses.is_dataclass(kind) and "parse" not in f.metadata:
            yield from flags(kind, (*path, f.name), default)
        else:
            yield Flag((*path, f.name), f, kind, default)


def add_options(parser: argparse.ArgumentParser, config_cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add a flag per field of `config_cls` (see `flags`). A flag not given leaves no value
    in the namespace, so the dataclass's own default applies."""
    for flag in flags(config_cls):
        if flag.path[-1] in skip:
            continue
        f = flag.field
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        help_text = f.metadata.get("help", "")
        if not required and "(default:" not in help_text:
            help_text = f"{help_text} (default: {f.metadata.get('show', str)(flag.default)})".lstrip()
        common = {"dest": flag.dest, "help": help_text.replace("%", "%%"), "default": argparse.SUPPRESS}
        if flag.kind is bool and "parse" not in f.metadata:
            parser.add_argument(flag.name, action=argparse.BooleanOptionalAction, **common)
            continue
        parser.add_argument(flag.name, type=str if "parse" in f.metadata else flag.kind, required=required,
                            choices=f.metadata.get("choices"),
                            metavar=None if "choices" in f.metadata else flag.name[2:].replace("-", "_").upper(),
                            **common)


def config_from_args(config_cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """The config the parsed flags describe: every flag given replaces its field (nested
    ones in their component), each `parse` applied; `overrides` replace top-level fields.
    Error handling: ValueError from a field's parser or from the config's own checks."""
    return config_cls(**{**_given_values(config_cls, vars(args), ()), **overrides})


def _given_values(config_cls: type, given: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """Field name -> value for the fields of `config_cls` (at `path`) that flags set."""
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if not f.metadata.get(_CLI, not path):
            continue
        kind, dest = _scalar(hints[f.name]), ".".join((*path, f.name))
        if dataclasses.is_dataclass(kind) and "parse" not in f.metadata:
            inner = _given_values(kind, given, (*path, f.name))
            if inner:  # the component as the outer field's default has it, with the flags given
                base = _default_of(f)
                values[f.name] = kind(**inner) if base is None else dataclasses.replace(base, **inner)
        elif dest in given:
            parse = f.metadata.get("parse")
            values[f.name] = given[dest] if parse is None else parse(given[dest])
    return values


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _scalar(hint: Any) -> type:
    """int | None -> int; str -> str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
