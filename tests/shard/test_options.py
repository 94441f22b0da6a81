"""shard.options derives flags from config dataclasses: guards the rules a process CLI
relies on (nested components, flag names, parsers, shown defaults, code-only fields)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from shard.options import add_options, config_from_args, internal, option


@dataclass(frozen=True)
class Part:
    size: int = option(4, "how big", flag="--part-size")
    name: str = option("a", "its name", parse=str.upper, show=str.lower, choices=("a", "b", "A"))
    timeout_s: float = 3.0  # a component field without `option`: code only


@dataclass(frozen=True)
class Whole:
    path: str  # required, plain: a flag like shard-node's
    part: Part = field(default_factory=lambda: Part(size=5))
    hidden: int = internal(7)
    verbose: bool = False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_options(parser, Whole)
    return parser


def test_nested_flags_land_in_their_component_from_the_outer_default():
    # Sound: the outer default Part(size=5) differs from Part's own, so keeping it proves
    # a component is replaced, not rebuilt from the class.
    whole = config_from_args(Whole, _parser().parse_args(["--path", "p", "--name", "b"]))
    assert whole == Whole(path="p", part=Part(size=5, name="B"))
    assert config_from_args(Whole, _parser().parse_args(["--path", "p", "--part-size", "9", "--verbose"])) == \
        Whole(path="p", part=Part(size=9), verbose=True)


def test_only_declared_fields_are_flags_and_each_shows_one_default():
    options = {a.option_strings[0]: a for a in _parser()._actions if a.option_strings and a.dest != "help"}
    assert set(options) == {"--path", "--part-size", "--name", "--verbose"}
    assert options["--part-size"].help == "how big (default: 5)"
    assert options["--name"].help == "its name (default: a)"
    assert options["--path"].required


def test_two_components_offering_one_flag_clash():
    @dataclass(frozen=True)
    class Twice:
        one: Part = field(default_factory=Part)
        two: Part = field(default_factory=Part)

    with pytest.raises(argparse.ArgumentError, match="conflicting option string: --part-size"):
        add_options(argparse.ArgumentParser(), Twice)


def test_shard_node_join_flags_each_have_help_and_one_default():
    # Bug guarded: a NodeConfig field added without its help, or a help naming its default
    # in words and getting a second "(default: ...)". Sound: walks the real parser.
    from shard.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = [a for a in sub.choices["join"]._actions if a.option_strings and a.dest != "help"]
    assert "--coordinator" in {a.option_strings[0] for a in actions}
    for action in actions:
        assert action.help, action.option_strings
        assert action.help.count("(default:") == (0 if action.required else 1), action.option_strings
