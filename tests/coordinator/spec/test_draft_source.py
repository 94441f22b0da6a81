"""coordinator.spec.source: a draft's source as (family, evidence), never parsed from text."""

from __future__ import annotations

import pathlib
import re

from hypothesis import given
from hypothesis import strategies as st

from coordinator.spec.source import ALL_SOURCES, DraftSource

ROOT = pathlib.Path(__file__).resolve().parents[3]
names = st.text(st.characters(min_codepoint=97, max_codepoint=122), max_size=6)


def test_text_is_the_key_statistics_and_benchmarks_have_always_used():
    # Bug guarded: benchmark JSON and job stats are keyed by this text; a changed format
    # would silently split old and new results. Sound: each drafter's real sources.
    assert [str(s) for s in (DraftSource("ngram", "3"), DraftSource("ngram", "0"), DraftSource("eagle", "tree"),
                             DraftSource("merged"), ALL_SOURCES)] == ["ngram:3", "ngram:0", "eagle:tree", "merged", ""]


@given(names, names)
def test_statistics_fall_back_from_the_evidence_to_the_family_to_every_drafter(family, evidence):
    # Bug guarded: the planner looking a draft's acceptance up under a key that apply()
    # never wrote (the fallbacks of both were spelt out separately). Sound: any source.
    source = DraftSource(family, evidence)
    assert source.fallbacks[0] == source and source.fallbacks[-1] == ALL_SOURCES
    assert source.family_key == DraftSource(family) and source.family_key.family == family
    assert len(set(source.fallbacks)) == len(source.fallbacks)  # each width once
    assert source.family_key in source.fallbacks
    assert hash(source) == hash(DraftSource(family, evidence))  # a dict key


# A family read back out of a source's text: what DraftSource exists to replace.
PARSED_SOURCE = re.compile(r"source\w*\)?\.r?split\(|\.split\([\"']:[\"']\)\[0\]")


def test_no_code_parses_a_source_out_of_its_text():
    # Bug guarded: a seventh copy of `source.split(":")[0]` that disagrees with the
    # others. Sound: scans every module, script and test; the pattern is checked below.
    bad = [f"{path.relative_to(ROOT)}:{n}" for top in ("coordinator", "scripts", "tests", "ring", "shard", "receipts")
           for path in sorted((ROOT / top).rglob("*.py")) if path != pathlib.Path(__file__).resolve()
           for n, line in enumerate(path.read_text().splitlines(), 1) if PARSED_SOURCE.search(line)]
    assert not bad, bad


def test_parse_pattern_catches_what_it_should():
    for line in ['family = tree.source.split(":")[0]', "s.split(':')[0] for s in sources", "out.source.rsplit(':', 1)"]:
        assert PARSED_SOURCE.search(line), line
    for line in ['host, port = config.http.rsplit(":", 1)', "tree.source.family", "text.split()"]:
        assert not PARSED_SOURCE.search(line), line
