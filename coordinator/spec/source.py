"""Where a draft came from: the drafter family and the evidence it rests on.

A draft's acceptance is learnt at three widths, narrowest first: its exact source (an
n-gram draft from a 4-token match), its family (every n-gram draft), and every drafter
pooled. `DraftSource` holds the two parts as fields, so no caller parses them out of
text; `str()` gives the text that statistics and benchmark JSON are keyed by
("ngram:3", "eagle:tree", "merged", "" for the pool).

This module does not know what a family's evidence means, nor any statistics.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftSource:
    """`family`: the drafter (its `Drafter.name`: "ngram", "eagle"; "merged" for a
    hybrid draft; "" pools every drafter). `evidence`: what this draft rests on, in the
    family's own terms (an n-gram match length "3", EAGLE's "chain" or "tree"; "0" for
    an empty draft), or "" for the family as a whole."""

    family: str
    evidence: str = ""

    @property
    def family_key(self) -> DraftSource:
        """The source that stands for this one's whole family (no evidence)."""
        return DraftSource(self.family)

    @property
    def fallbacks(self) -> tuple[DraftSource, ...]:
        """The sources this one's statistics are kept and looked up under, narrowest
        first and each once: itself, its family, every drafter pooled."""
        return tuple(dict.fromkeys((self, self.family_key, ALL_SOURCES)))

    def __str__(self) -> str:
        return f"{self.family}:{self.evidence}" if self.evidence else self.family


ALL_SOURCES = DraftSource("")  # the key that pools every drafter
