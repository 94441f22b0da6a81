"""Command-line options derived from a frozen config dataclass, so flags and defaults
cannot drift from the config. Each field becomes `--field-name`; its type, default and
the help text in `field.metadata["help"]` (optional) come from the dataclass.
Does not know any particular command.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def add_options(parser: argparse.ArgumentParser, config_cls: type, *, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kind = _scalar(hints[f.name])
        help_text = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        extra: dict[str, Any] = {}
        if "choices" in f.metadata:
            extra["choices"] = f.metadata["choices"]
        parser.add_argument(flag, type=kind, default=default, required=required,
                            help=f"{help_text} (default: %(default)s)" if not required else help_text, **extra)


def config_from_args(config_cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if hasattr(args, f.name)}
    values.update(overrides)
    return config_cls(**values)


def _scalar(hint: Any) -> type:
    """int | None -> int; str -> str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
